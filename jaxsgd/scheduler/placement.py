"""Which device each stage (lane) runs on: an explicit stage → device map.

    placement = Placement.create(num_stages=4, devices=jax.devices()[:4])
    placement.device(k)           # where stage k's parameters live and run

`config.placement` (devices, stage_to_device) is parsed and checked by
`jaxsgd.algorithms.settings.placement_settings`; the engine reads no config.
"""

import dataclasses
import re
from collections.abc import Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Placement:
  devices: tuple[jax.Device, ...]
  stage_device: tuple[int, ...]  # stage k runs on devices[stage_device[k]]
  # The map is the hardware being modelled: stages mapped to one device share it, and the
  # virtual clock runs their tasks one at a time. False: every stage is simulated on a
  # device of its own, whatever devices this machine has.
  shared_devices: bool = False

  def hardware(self, stage: int) -> str | None:
    """The `LaneSpec.shares` key of stage `stage`'s lane (None: a device of its own)."""
    return f'device {self.stage_device[stage]}' if self.shared_devices else None

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
    """Stage k on `devices[k]` (round-robin if fewer devices), or as mapped; an explicit
    map is the hardware modelled (`shared_devices`)."""
    devices = tuple(jax.devices() if devices is None else devices)
    explicit = stage_to_device is not None
    if stage_to_device is None:
      stage_to_device = [k % len(devices) for k in range(num_stages)]
    return cls(devices, tuple(int(i) for i in stage_to_device), shared_devices=explicit)


def lane_name(cluster_name: str) -> str:
  """A cluster lane's name as a placement lane name (`LanePlacement`, `placement.lanes`):
  the name up to its first ' (' without spaces, `stage 0 (cpu:0)` → `stage0`."""
  return re.sub(r'[^A-Za-z0-9_.-]', '', cluster_name.split(' (')[0]) or 'lane'
