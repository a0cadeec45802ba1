"""Which device each stage (lane) runs on: an explicit stage → device map.

    placement = Placement.create(num_stages=4, devices=jax.devices()[:4])
    placement.device(k)           # where stage k's parameters live and run

From a config (`config.placement`, optional):
  - `devices`: positions in `jax.devices()` to use (default: all of them);
  - `stage_to_device`: for each stage, an index into that list (default: stage k
    on device k, wrapping round-robin when there are fewer devices than stages and
    no explicit `devices` list was given).
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


def check_config(config, num_stages: int) -> None:
  """Refuses an impossible placement before anything compiles (names the field)."""
  settings = dict(config.get('placement') or {})
  unknown = set(settings) - {'devices', 'stage_to_device'}
  if unknown:
    raise ValueError(
      f'placement: unknown field(s) {sorted(unknown)}; allowed: devices, stage_to_device.'
    )
  available = len(jax.devices())
  positions = settings.get('devices')
  if positions is not None:
    positions = list(positions)
    bad = [p for p in positions if not isinstance(p, int) or not 0 <= p < available]
    if not positions or bad:
      raise ValueError(
        f'placement.devices: positions in jax.devices() (0..{available - 1}) '
        f'expected, got {positions}.'
      )
  mapping = settings.get('stage_to_device')
  num_devices = available if positions is None else len(positions)
  if mapping is None:
    if positions is not None and len(positions) < num_stages:
      raise ValueError(
        f'placement.devices: {len(positions)} devices listed for '
        f'{num_stages} stages; list at least {num_stages}, or map stages '
        f'onto them with placement.stage_to_device.'
      )
    return
  mapping = list(mapping)
  if len(mapping) != num_stages:
    raise ValueError(f'placement.stage_to_device: {len(mapping)} entries for {num_stages} stages.')
  if any(not isinstance(i, int) or not 0 <= i < num_devices for i in mapping):
    raise ValueError(
      f'placement.stage_to_device: indices into the {num_devices} devices '
      f'(0..{num_devices - 1}) expected, got {mapping}.'
    )


def from_config(config, num_stages: int) -> Placement:
  check_config(config, num_stages)
  settings = dict(config.get('placement') or {})
  all_devices = jax.devices()
  positions = settings.get('devices')
  devices = all_devices if positions is None else [all_devices[p] for p in positions]
  return Placement.create(num_stages, devices, settings.get('stage_to_device'))
