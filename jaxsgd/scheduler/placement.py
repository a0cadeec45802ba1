"""Which device each stage (lane) runs on: an explicit stage → device map.

    placement = Placement.create(num_stages=4, devices=jax.devices()[:4])
    placement.device(k)           # where stage k's parameters live and run

`config.placement` (devices, stage_to_device) is parsed and checked by
`jaxsgd.algorithms.settings.placement_settings`; the engine reads no config.
"""

import dataclasses
from collections.abc import Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Placement:
  devices: tuple[jax.Device, ...]
  stage_device: tuple[int, ...]  # stage k runs on devices[stage_device[k]]

  @property
  def num_stages(self) -> int:
    return len(self.stage_device)

  def device(self, stage: int) -> jax.Device:
    return self.devices[self.stage_device[stage]]

  @classmethod
  def create(
    cls,
    num_stages: int,
    devices: Sequence[jax.Device] | None = None,
    stage_to_device: Sequence[int] | None = None,
  ) -> 'Placement':
    """Stage k on `devices[k]` (round-robin if fewer devices), or as mapped."""
    devices = tuple(jax.devices() if devices is None else devices)
    if stage_to_device is None:
      stage_to_device = [k % len(devices) for k in range(num_stages)]
    return cls(devices, tuple(int(i) for i in stage_to_device))
