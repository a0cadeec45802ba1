"""A config, parsed once into frozen settings: the fields every algorithm shares.

Every algorithm module's `validate(config, model)` calls `shared_settings(config)` for the
shared fields and `section(config.algorithm, Settings)` for its own, so each config field
is read in exactly one place, checked there, and refused there when unknown (with the
closest known name). The settings are frozen, hashable dataclasses: an executor whose
lanes are other processes can send them and rebuild the same functions there.

The shared fields:

    train_steps, batch_size, seed, clock ('real' | 'virtual'), stages, workers
    executor ('in_process' | 'processes' | 'emulated': the real clock's lanes in this
      process, or each in an OS process of its own, `scheduler/process.py`; 'emulated':
      those lane processes, each task waiting its priced duration instead of computing,
      priced from `cost` as the virtual clock prices it), cluster_address (refused if
      nothing answers there within cluster_timeout_s seconds),
      tolerate_lost_workers (processes; asgd, dcasgd, pdasgd, lppsgd: a worker whose lane
      process dies or raises is replaced by a new lane process and rejoins; if none can
      start, asgd and dcasgd go on without it and the others stop; False: it stops the run)
    checkpoint_every (0: no periodic checkpoints)
    optimizer.{name, learning_rate, schedule, weight_decay, kwargs}  -> OptimizerSettings
    cost.{...}                                                       -> CostSettings
    placement.{devices, stage_to_device, lanes}                      -> PlacementSettings

`cost` is one schema for every family, one unit per quantity (seconds, bytes/s).
"""

import dataclasses
import difflib
import os
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxsgd.optimizers import OptimizerSettings
from jaxsgd.scheduler import hardware
from jaxsgd.scheduler import host as host_lib

CLOCKS = ('real', 'virtual')
# Where the real clock runs its lanes: devices of this process, or an OS process per lane
# (computing each task, or waiting its priced duration: `process.py`, emulated tasks).
EXECUTORS = ('in_process', 'processes', 'emulated')
LANE_PROCESS_EXECUTORS = ('processes', 'emulated')
KINDS = ('forward', 'backward', 'update', 'step')  # the task kinds `cost.compute` may cost

# The algorithms whose runs can go on without a lost worker (`tolerate_lost_workers`):
# their worker processes declare what replaces them (`core.Process.on_lost`).
TOLERATE_LOST_WORKERS = ('asgd', 'dcasgd', 'pdasgd', 'lppsgd')

# Fields that were renamed: the old name is refused with the new one.
RENAMED = {
  'cost.step_time': 'cost.compute.step (seconds per step; with cost.calibrate=False)',
  'cost.bandwidth_gbps': 'cost.link_bandwidth, in bytes/s (10 Gbit/s = 1.25e9)',
  'cost.latency': 'cost.link_latency (seconds per message)',
  'cost.calibration_steps': 'cost.reps',
  'cost.device_speeds': 'cost.speeds (one factor per stage device)',
  'cost.worker_speeds': 'cost.speeds (one factor per worker)',
  **{
    f'cost.{field}': 'cost.host (a host profile: python -m experiments.profile --host=EXECUTOR)'
    for field in ('dispatch', 'copies', 'statistic', 'sharing', 'schedule', 'driver')
    + ('driver_latency', 'driver_from')
  },
}


# --- field checks -------------------------------------------------------------------------------
def integer(value, field: str, minimum: int = 1, maximum: int | None = None) -> int:
  """`value` if it is an integer in [minimum, maximum], else a ValueError naming `field`."""
  if (
    isinstance(value, bool)
    or not isinstance(value, int)
    or value < minimum
    or (maximum is not None and value > maximum)
  ):
    if maximum is not None:
      raise ValueError(f'{field}: must be an integer in [{minimum}, {maximum}], got {value!r}.')
    what = 'a positive integer' if minimum == 1 else f'an integer >= {minimum}'
    raise ValueError(f'{field}: must be {what}, got {value!r}.')
  return int(value)


def at_least(value, field: str, minimum: int) -> int:
  """`value` if it is an integer >= `minimum` (said so), else a ValueError naming `field`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'{field}: must be an integer >= {minimum}, got {value!r}.')
  return int(value)


def number(
  value, field: str, *, minimum: float = 0.0, strict: bool = False, maximum: float = math.inf
) -> float:
  """A finite number in [minimum, maximum] (`strict`: > minimum), else a ValueError."""
  ok = (
    not isinstance(value, bool)
    and isinstance(value, (int, float))
    and math.isfinite(value)
    and (value > minimum if strict else value >= minimum)
    and value <= maximum
  )
  if not ok:
    bound = f'> {minimum}' if strict else f'>= {minimum}'
    if maximum < math.inf:
      bound += f' and <= {maximum}'
    raise ValueError(f'{field}: must be {bound} (a finite number), got {value!r}.')
  return float(value)


def local_cluster_address() -> str:
  """`cluster_address='auto'`: the address of the Ray cluster running on this machine
  (`ray start --head`), found as Ray finds it (its GCS process); joining one that is
  running saves the seconds a run spends starting its own."""
  from ray._private import services  # Ray is imported only when asked for.

  found = sorted(services.find_gcs_addresses())
  if len(found) != 1:
    raise ValueError(
      "cluster_address: 'auto' joins the Ray cluster running on this machine, but "
      + (
        'none is running (start one: ray start --head)'
        if not found
        else f'{len(found)} are ({", ".join(found)}); name one'
      )
      + '; or leave cluster_address unset to start one for the run.'
    )
  return found[0]


def check_reachable(address: str, timeout: float) -> None:
  """Refuses a `cluster_address` nobody answers at within `timeout` seconds (tried every
  half second): Ray's own connect retries every 5 s for as long as it is left to."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise ValueError(f"cluster_address: 'host:port' of a Ray cluster, got {address!r}.")
  deadline = time.monotonic() + timeout
  while True:
    try:
      socket.create_connection((host, int(port)), timeout=min(timeout, 2.0)).close()
      return
    except OSError as error:
      if time.monotonic() + 0.5 >= deadline:
        raise ValueError(
          f'cluster_address: nothing answers at {address} ({error.strerror or error}; '
          f'waited {timeout:g} s, cluster_timeout_s); start the cluster there '
          '(ray start --head --port=PORT) or leave cluster_address unset to start one here.'
        ) from None
      time.sleep(0.5)


def choice(value, field: str, allowed) -> Any:
  if value not in allowed:
    raise ValueError(f'{field}: {value!r}; allowed: {", ".join(map(str, allowed))}.')
  return value


def boolean(value, field: str) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f'{field}: True or False, got {value!r}.')
  return value


def refuse_unknown(given, allowed, prefix: str) -> None:
  """Refuses keys of `given` not in `allowed`, naming the closest allowed one."""
  for key in given:
    if key in allowed:
      continue
    full = f'{prefix}.{key}' if prefix else key
    if full in RENAMED:
      raise ValueError(f'{full}: renamed; use {RENAMED[full]}.')
    close = closest(key, allowed)
    hint = f' Did you mean {prefix + "." if prefix else ""}{close}?' if close else ''
    raise ValueError(f'{full}: unknown field.{hint} Allowed: {", ".join(sorted(allowed))}.')


def closest(name: str, allowed) -> str | None:
  """The allowed name `name` most likely meant: a close spelling, or the initials
  (`lr` for `learning_rate`); None if none is close."""
  close = difflib.get_close_matches(name, list(allowed), n=1)
  if close:
    return close[0]
  by_initials = [a for a in allowed if '_' in a and ''.join(w[:1] for w in a.split('_')) == name]
  return by_initials[0] if len(by_initials) == 1 else None


def section(given, cls, prefix: str, *, ignore=('name',)):
  """An instance of the frozen dataclass `cls` from the sub-config `given`.

  Fields missing from `given` take the dataclass's default (defaults live only in the
  dataclass); unknown keys are refused; a value whose type does not fit the field's
  default (int, float, bool, str, tuple) is refused naming `prefix.field`.
  """
  given = dict(given or {})
  names = {f.name: f for f in dataclasses.fields(cls) if f.init and f.metadata.get('config', True)}
  refuse_unknown([k for k in given if k not in ignore], names, prefix)
  values = {}
  for name, f in names.items():
    if name not in given:
      continue
    values[name] = _coerce(given[name], f, f'{prefix}.{name}')
  return cls(**values)


def derived(default=None):
  """A settings field that is not read from the config's section (e.g. the shared `run`)."""
  return dataclasses.field(default=default, metadata={'config': False})


def _coerce(value, f: dataclasses.Field, field: str):
  default = f.default if f.default is not dataclasses.MISSING else None
  if isinstance(default, bool):
    return boolean(value, field)
  if isinstance(default, int) and not isinstance(value, bool) and isinstance(value, int):
    return value
  if isinstance(default, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
    return float(value)
  if isinstance(default, tuple) and isinstance(value, (list, tuple)):
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
  if isinstance(default, (bool, int, float, str)) and not isinstance(value, type(default)):
    raise ValueError(f'{field}: expected a {type(default).__name__}, got {value!r}.')
  return value


# --- the shared sub-configs ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CostSettings:
  """The virtual clock's costs (`config.cost`): devices, links, noise and the host.

  Where task costs come from (the first that applies):
    `profile`  a cost profile file (`python -m experiments.profile`): measured once;
    `compute`  explicit seconds, with `calibrate=False`;
    `device`   a hardware preset (`jaxsgd.scheduler.hardware.PRESETS`): roofline costs from
               XLA's cost analysis; links default to the preset's when left at 0;
    `calibrate` measured on this machine the first time and kept as a profile where the data
               lives (`<data_dir>/jaxsgd_profiles/`), so later runs reuse the same costs.
  Every source but a first calibration is deterministic: the same config gives the same
  simulated times, under any load.

  Attributes:
    calibrate: measure the tasks on this machine (once; kept, see above).
    reps: timed calls of each task in that measurement (their median counts).
    profile: a cost profile file.
    device: a hardware preset name (`cpu`, `v100`, `a100`, `h100`, `tpu_v4`, ...).
    compute: `(kind, seconds)` pairs; seconds is a number or one per stage. Kinds:
      forward, backward, update (scheduler families), step (data-parallel families).
    speeds: one speed factor per compute lane: a pipeline's stage devices, an
      asynchronous method's workers (PD-ASGD: forward workers, then backward ones); () =
      all 1.
    link_latency: seconds per transfer or all-reduce message.
    link_bandwidth: bytes/s of every link; 0 = free links.
    straggler_std: sigma of the seeded log-normal per-task noise.
    seed: seeds the noise; None = `config.seed`.
    failures: `(worker, seconds)` pairs: from then on, that worker stops.
    host: a host profile (`python -m experiments.profile --host=EXECUTOR --out=PATH`):
      the executor whose host the simulation adds to the devices' time — its dispatch per
      task and, for the process executor, its driver, its copies and its schedule
      (`jaxsgd.scheduler.host`). None (default): the devices' time alone, as on hardware
      whose host keeps every device fed.
  """

  calibrate: bool = True
  reps: int = 5
  profile: str | None = None
  device: str | None = None
  compute: tuple[tuple[str, Any], ...] = ()
  speeds: tuple[float, ...] = ()
  link_latency: float = 0.0
  link_bandwidth: float = 0.0
  straggler_std: float = 0.0
  seed: int | None = None
  failures: tuple[tuple[int, float], ...] = ()
  host: str | None = None

  def host_profile(self) -> host_lib.HostProfile | None:
    """The host profile `host` names (checked when the config was parsed), or None."""
    return None if self.host is None else host_lib.load(self.host)

  @property
  def explicit_compute(self) -> bool:
    """Costs are the given `compute` (not measured, not from a profile or preset)."""
    return not self.calibrate and self.profile is None and self.device is None

  @property
  def bandwidth(self) -> float:
    """Bytes/s of a link (`inf` for free links)."""
    return self.link_bandwidth or math.inf

  def links_are_costed(self, clock: str) -> bool:
    return clock == 'virtual' and (self.link_latency > 0 or self.link_bandwidth > 0)

  def explicit(self, kinds, num_stages: int) -> dict[tuple[int, str], float]:
    """`{(stage, kind): seconds}` from `compute`, for every kind of `kinds`."""
    given = dict(self.compute)
    table = {}
    for kind in kinds:
      if given.get(kind) is None:
        raise ValueError(
          f'cost.compute.{kind}: missing (cost.calibrate is False, so every '
          f'task kind {list(kinds)} needs a cost in seconds).'
        )
      value = given[kind]
      per_stage = list(value) if isinstance(value, (list, tuple)) else [value] * num_stages
      if len(per_stage) != num_stages:
        raise ValueError(f'cost.compute.{kind}: {len(per_stage)} values for {num_stages} stages.')
      for stage, seconds in enumerate(per_stage):
        if (
          isinstance(seconds, bool)
          or not isinstance(seconds, (int, float))
          or not 0 <= seconds < math.inf
        ):
          raise ValueError(
            f'cost.compute.{kind}: stage {stage} cost must be a finite number '
            f'of seconds >= 0, got {seconds!r}.'
          )
        table[(stage, kind)] = float(seconds)
    return table


def cost_settings(given, *, clock: str) -> CostSettings:
  """`config.cost` parsed and range-checked (the sub-config is optional)."""
  given = dict(given or {})
  compute = dict(given.pop('compute', None) or {})
  compute = {k: tuple(v) if isinstance(v, list) else v for k, v in compute.items() if v is not None}
  refuse_unknown(compute, KINDS, 'cost.compute')
  cost = section(
    {**given, 'compute': tuple(sorted(compute.items()))}, CostSettings, 'cost', ignore=()
  )
  integer(cost.reps, 'cost.reps')
  for field in ('link_latency', 'straggler_std'):
    number(getattr(cost, field), f'cost.{field}')
  if not (isinstance(cost.link_bandwidth, (int, float)) and cost.link_bandwidth >= 0):
    raise ValueError(
      f'cost.link_bandwidth: bytes/s >= 0 (0 or inf: free), got {cost.link_bandwidth!r}.'
    )
  _check_cost_source(cost)
  cost.host_profile()  # Refuses a missing or bad host profile, naming the field.
  for i, speed in enumerate(cost.speeds):
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf:
      raise ValueError(f'cost.speeds: must be > 0, got {speed!r} for lane {i}.')
  if cost.seed is not None:
    integer(cost.seed, 'cost.seed', minimum=0, maximum=2**32 - 1)
  for pair in cost.failures:
    if not isinstance(pair, tuple) or len(pair) != 2:
      raise ValueError(f'cost.failures: (worker, seconds) pairs expected, got {pair!r}.')
    integer(pair[0], 'cost.failures (worker)', minimum=0)
    number(pair[1], 'cost.failures (seconds)')
  return cost


def _check_cost_source(cost: CostSettings) -> None:
  """One source of task costs (a profile, a preset, explicit seconds or a calibration),
  and the one named exists."""
  if cost.compute and not cost.explicit_compute:
    named = ', '.join(f'cost.compute.{kind}' for kind, _ in cost.compute)
    raise ValueError(
      f'{named}: explicit costs are used only with cost.calibrate=False and no cost.profile '
      f'or cost.device; set those, or remove {named}.'
    )
  if cost.profile is not None and cost.device is not None:
    raise ValueError(
      'cost.profile / cost.device: give one cost source, not both (a profile is measured '
      'costs, a device preset analytic ones).'
    )
  if cost.device is not None:
    hardware.preset(cost.device)  # Refuses an unknown name, listing the presets.
  if cost.profile is not None and not os.path.exists(os.path.expanduser(cost.profile)):
    raise ValueError(
      f'cost.profile: no file {cost.profile!r}; make one with python -m experiments.profile '
      f'--config=... --out={cost.profile}.'
    )


def refuse_cost_fields(cost: CostSettings, fields, why: str) -> None:
  """Refuses the first of `cost.<fields>` that is set (non-empty), naming it: `why`."""
  for field in fields:
    if getattr(cost, field):
      raise ValueError(f'cost.{field}: {why}')


def check_lane_speeds(cost: CostSettings, num_lanes: int, what: str = 'lane') -> None:
  """`cost.speeds` has one factor per compute lane (or none)."""
  if cost.speeds and len(cost.speeds) != num_lanes:
    raise ValueError(f'cost.speeds: {len(cost.speeds)} values for {num_lanes} {what}s.')


def placed_lanes(shared: 'SharedSettings', lanes: Callable[[], Sequence[str]]) -> 'SharedSettings':
  """`shared` knowing the run's lanes (`lanes()`: their names as a trace shows them,
  `stage 0`, `worker 1`; kept as placement names, `SharedSettings.lanes`), after
  checking `placement.lanes` against them, before anything compiles. A placed name that
  is none of the run's lanes is refused on either clock (the virtual clock ignored it: a
  typo left a lane unplaced without a word); with executor='processes' every lane needs a
  place, since the placement starts its process (likewise with 'emulated').

  A run neither placed nor on lane processes needs no names, and they are not made: a
  config of ten million workers, say, is refused by `training.limits` in a second rather
  than after a minute of naming its lanes."""
  if shared.placement.lanes is None and not shared.on_lane_processes:
    return shared
  from jaxsgd.scheduler.placement import lane_name

  names = tuple(lane_name(lane) for lane in lanes())
  shared = dataclasses.replace(shared, lanes=names)
  if shared.placement.lanes is None:
    return shared
  from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

  placement = LanePlacement.parse(shared.placement.lanes)
  placement.check_run(list(names), every_lane=shared.on_lane_processes)
  if shared.on_lane_processes:  # (the virtual clock's cores may be a machine's you lack)
    here = sorted(os.sched_getaffinity(0))
    for spec in placement.lanes:
      missing = sorted(set(spec.cores or ()) - set(here)) if spec.host is None else []
      if missing:
        raise ValueError(
          f'placement.lanes: lane {spec.name!r}: core {missing[0]} is not one of this '
          f"host's cores ({', '.join(map(str, here))}); a lane would run unpinned there."
        )
  return shared


def refuse_workers_field(name: str, workers: int) -> None:
  """For algorithms whose worker count is not `config.workers`."""
  if workers != 1:
    raise ValueError(
      f'workers: {name} does not read `workers` (got {workers}); leave it at 1 '
      f'(lppsgd: algorithm.devices and workers_per_device; pdasgd: '
      f'algorithm.n_fwd and n_bwd; pipelines: stages).'
    )


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
  """Which device each stage runs on (`config.placement`).

  Attributes:
    devices: positions in `jax.devices()` to use; None = all of them.
    stage_to_device: for each stage, an index into that list; None = stage k on device
      k, round-robin when there are fewer devices than stages and `devices` is None.
    lanes: with `executor='processes'`, where each lane process runs, in the text form
      of `LanePlacement` (`'stage0@cores=0; stage1@host=10.0.0.2@cores=0-3@gpu=1'`);
      None = one core per lane, round-robin over this host's cores.
    lane_to_device: the asynchronous algorithms on the virtual clock (asgd, dcasgd:
      the server, then the workers; pdasgd: the shared model, then the forward and the
      backward workers): the simulated device of each lane. Lanes mapped to one device
      share it: their tasks run one at a time (an ASGD server on a worker's GPU). None =
      every lane a device of its own.
    copies: lane processes' copy threads (the values each takes in and sends): 'auto' —
      moved once, by the load the run measures, off the cores that bound the run onto
      cores that wait (`scheduler.copy_load`); 'own' — where `lanes` puts them (a lane's
      `copies=`, else its own cores). None = 'auto' with executor='processes' unless
      `lanes` places some lane's copies, else 'own' (emulated tasks: the simulator's
      executor model keeps them on their lanes' cores; told 'auto', an emulated run
      places them by its copies' load alone, since its tasks wait rather than compute).
  """

  devices: tuple[int, ...] | None = None
  stage_to_device: tuple[int, ...] | None = None
  lanes: str | None = None
  lane_to_device: tuple[int, ...] | None = None
  copies: str | None = None

  def copy_placement(self, executor: str) -> str:
    """`copies` as the process executor takes it (`ProcessExecutor(copies=...)`)."""
    if self.copies is not None:
      return self.copies
    if executor != 'processes':
      return 'own'
    if self.lanes is None:
      return 'auto'
    from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

    placed = any(lane.copy_cores is not None for lane in LanePlacement.parse(self.lanes).lanes)
    return 'own' if placed else 'auto'


def placement_settings(given, num_stages: int) -> PlacementSettings:
  """`config.placement`, checked against the visible devices and the stage count."""
  given = dict(given or {})
  refuse_unknown(
    given, ('devices', 'stage_to_device', 'lanes', 'lane_to_device', 'copies'), 'placement'
  )
  lanes, copies = given.pop('lanes', None), given.pop('copies', None)
  if copies is not None:  # Ray is imported only when used.
    from jaxsgd.scheduler.copy_load import COPIES, refuse_placed_copies
  if copies is not None and copies not in COPIES:
    raise ValueError(
      f'placement.copies: one of {", ".join(COPIES)} (or None: by the executor) expected, '
      f'got {copies!r}.'
    )
  if lanes is not None:
    from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

    if not isinstance(lanes, str):
      raise ValueError(f'placement.lanes: a placement string expected, got {lanes!r}.')
    try:
      placement = LanePlacement.parse(lanes)
    except ValueError as error:
      raise ValueError(f'placement.lanes: {str(error).removeprefix("placement: ")}') from None
    if copies == 'auto':
      try:
        refuse_placed_copies(placement, placement.names)
      except ValueError as error:
        raise ValueError(f'placement.{error}') from None
  for key, value in given.items():
    if value is not None and not isinstance(value, (list, tuple)):
      raise ValueError(f'placement.{key}: a tuple of integers (or None) expected, got {value!r}.')
  given = {k: (tuple(v) if v is not None else None) for k, v in given.items()}
  settings = PlacementSettings(**given, lanes=lanes, copies=copies)
  lane_map = settings.lane_to_device
  if lane_map is not None and (
    not lane_map or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in lane_map)
  ):
    raise ValueError(
      f'placement.lane_to_device: a device index >= 0 per lane expected, got {list(lane_map)}.'
    )
  available = len(jax.devices())
  positions = settings.devices
  if positions is not None:
    bad = [
      p
      for p in positions
      if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < available
    ]
    if not positions or bad:
      raise ValueError(
        f'placement.devices: positions in jax.devices() (0..{available - 1}) '
        f'expected, got {list(positions)}.'
      )
  mapping = settings.stage_to_device
  num_devices = available if positions is None else len(positions)
  if mapping is None:
    if positions is not None and len(positions) < num_stages:
      raise ValueError(
        f'placement.devices: {len(positions)} devices listed for '
        f'{num_stages} stages; list at least {num_stages}, or map stages '
        f'onto them with placement.stage_to_device.'
      )
    return settings
  if len(mapping) != num_stages:
    raise ValueError(f'placement.stage_to_device: {len(mapping)} entries for {num_stages} stages.')
  if any(
    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_devices for i in mapping
  ):
    raise ValueError(
      f'placement.stage_to_device: indices into the {num_devices} devices '
      f'(0..{num_devices - 1}) expected, got {list(mapping)}.'
    )
  return settings


def optimizer_settings(given, prefix: str = 'optimizer') -> OptimizerSettings:
  """`config.optimizer` (or another optimizer sub-config) as checked settings."""
  given = dict(given or {})
  kwargs = given.pop('kwargs', None)
  settings = section(
    {**given, 'kwargs': tuple(sorted(dict(kwargs or {}).items()))},
    OptimizerSettings,
    prefix,
    ignore=(),
  )
  return settings.check(prefix)


ASYNCHRONOUS = ('asgd', 'dcasgd', 'pdasgd', 'lppsgd')  # Their lanes: `placement.lane_to_device`.


@dataclasses.dataclass(frozen=True)
class SharedSettings:
  """The fields every algorithm shares (top level of the config, `optimizer`, `cost`)."""

  train_steps: int
  batch_size: int
  seed: int
  clock: str
  stages: int
  workers: int
  optimizer: OptimizerSettings
  cost: CostSettings
  placement: PlacementSettings
  profile_cache: str | None = None  # where calibrated profiles are kept (by the data)
  executor: str = 'in_process'  # the real clock: 'in_process', 'processes' or 'emulated'
  cluster_address: str | None = None  # lane processes: a Ray cluster (None: start one here)
  checkpoint_every: int = 0  # steps between checkpoints (0: none but the one SIGTERM asks for)
  tolerate_lost_workers: bool = False  # processes: a lost worker's lane is replaced, it rejoins
  # The run's lanes as placement names (`placed_lanes`), known before the model is built:
  # their processes start while it is (`training.loop._start_lane_cluster`). Empty unless
  # the run is on lane processes or sets `placement.lanes`.
  lanes: tuple[str, ...] = ()

  @property
  def virtual(self) -> bool:
    return self.clock == 'virtual'

  @property
  def on_lane_processes(self) -> bool:
    """Whether every lane runs in an OS process of its own (`executor='processes'`, or
    'emulated': the same executor whose tasks wait their priced durations)."""
    return self.executor in LANE_PROCESS_EXECUTORS

  @property
  def emulated(self) -> bool:
    """Lane processes whose tasks wait their priced durations (`executor='emulated'`)."""
    return self.executor == 'emulated'

  @property
  def prices_tasks(self) -> bool:
    """Whether the run prices its tasks from `cost`: the virtual clock, or emulated tasks."""
    return self.virtual or self.emulated

  @property
  def lane_processes(self) -> bool:
    """Whether policies take their lane-process forms: every lane an OS process
    (`on_lane_processes`), or the virtual clock simulating that executor's host
    (`cost.host`: a host profile of the process executor)."""
    return self.on_lane_processes or (self.virtual and self.simulates_lane_processes)

  @property
  def simulates_lane_processes(self) -> bool:
    """The virtual clock simulates the process executor (`cost.host`'s executor)."""
    profile = self.cost.host_profile()
    return profile is not None and profile.executor == 'processes'

  @property
  def cost_seed(self) -> int:
    return self.seed if self.cost.seed is None else self.cost.seed


def shared_settings(config) -> SharedSettings:
  """The shared fields of `config`, each checked once."""
  stages = integer(config.stages, 'stages')
  clock = choice(config.clock, 'clock', CLOCKS)
  executor = choice(config.get('executor', 'in_process'), 'executor', EXECUTORS)
  if executor == 'processes' and clock != 'real':
    raise ValueError("executor: 'processes' runs the real clock; set clock='real'.")
  if executor == 'emulated' and clock != 'real':
    raise ValueError(
      "executor: 'emulated' runs lane processes on the real clock (each task waits its "
      "priced duration); set clock='real', or executor='in_process' for the virtual clock."
    )
  address = config.get('cluster_address')
  if address is not None and (
    executor not in LANE_PROCESS_EXECUTORS or not isinstance(address, str)
  ):
    raise ValueError(
      "cluster_address: a Ray cluster's 'host:port', with executor='processes' or "
      f"'emulated'; got {address!r} with executor={executor!r}."
    )
  timeout = number(config.get('cluster_timeout_s', 30.0), 'cluster_timeout_s', strict=True)
  if address == 'auto':
    address = local_cluster_address()
  if address is not None:
    check_reachable(address, timeout)
    from jaxsgd.scheduler.lanes import cluster  # Ray is imported only when asked for.

    cluster.check_joinable(address)
  _check_placement_for(clock, executor, dict(config.get('placement') or {}))
  placement = placement_settings(config.get('placement'), stages)
  name = config.algorithm.name
  if placement.lane_to_device is not None and name not in ASYNCHRONOUS:
    raise ValueError(
      f'placement.lane_to_device: maps the lanes of {", ".join(ASYNCHRONOUS)}; {name} '
      'places stages with placement.stage_to_device.'
    )
  tolerate = tolerate_lost_workers(config, executor)
  cost = cost_settings(config.get('cost'), clock=clock)
  every = integer(config.get('checkpoint_every', 0), 'checkpoint_every', minimum=0)
  if cost.host is not None and clock == 'real':
    raise ValueError(
      "cost.host: a host profile prices an executor's host on the virtual clock; a real-clock "
      f"run (executor={executor!r}) has its own host. Leave it None, or set clock='virtual'."
    )
  source = 'cost.profile' if cost.profile is not None else 'cost.device' if cost.device else None
  if source and clock == 'real' and executor != 'emulated':
    raise ValueError(
      f"{source}: prices tasks on the virtual clock, or emulated tasks (executor='emulated'); "
      f'a real-clock run (executor={executor!r}) times its own. Leave it None, or set '
      "clock='virtual'."
    )
  host = cost.host_profile()
  if every and clock == 'virtual' and host is not None and host.executor == 'processes':
    raise ValueError(
      'checkpoint_every: a virtual run of the process executor (cost.host) writes no '
      "checkpoints (its tasks in flight and its cores' shares are not saved); set "
      'checkpoint_every=0, or simulate another host.'
    )
  return SharedSettings(
    train_steps=integer(config.train_steps, 'train_steps'),
    batch_size=integer(config.batch_size, 'batch_size'),
    seed=integer(config.seed, 'seed', minimum=0, maximum=2**32 - 1),
    clock=clock,
    stages=stages,
    workers=integer(config.workers, 'workers'),
    optimizer=optimizer_settings(config.optimizer),
    cost=cost,
    placement=placement,
    profile_cache=_profile_cache(config.get('data_dir')),
    executor=executor,
    cluster_address=address,
    checkpoint_every=every,
    tolerate_lost_workers=tolerate,
  )


def _check_placement_for(clock: str, executor: str, placement: dict) -> None:
  """`placement.devices`/`stage_to_device` place stages on this process's devices;
  `placement.lanes` places lane processes (and, on the virtual clock, the lanes it
  simulates: `clocks.lane_hardware`): each goes with its executor only."""
  if executor in LANE_PROCESS_EXECUTORS:
    for field in ('devices', 'stage_to_device'):
      if placement.get(field) is not None:
        raise ValueError(
          f"placement.{field}: places stages on this process's devices; with "
          f'executor={executor!r} every lane is a process, placed by placement.lanes.'
        )
  elif placement.get('lanes') is not None and clock != 'virtual':
    raise ValueError(
      "placement.lanes: places lane processes (or the simulated lanes, clock='virtual'); "
      f"it needs executor='processes' or 'emulated' (got {executor!r})."
    )
  if placement.get('copies') is not None and executor not in LANE_PROCESS_EXECUTORS:
    raise ValueError(
      "placement.copies: places lane processes' copy threads; it needs "
      f"executor='processes' or 'emulated' (got clock={clock!r}, executor={executor!r})."
    )


def tolerate_lost_workers(config, executor: str) -> bool:
  """`tolerate_lost_workers`, refused where a lost worker cannot be survived."""
  tolerate = boolean(config.get('tolerate_lost_workers', False), 'tolerate_lost_workers')
  if not tolerate:
    return False
  name = config.algorithm.name
  if name not in TOLERATE_LOST_WORKERS:
    raise ValueError(
      f'tolerate_lost_workers: {name} cannot go on without a lost worker (its lanes '
      f'all depend on each other); only {", ".join(TOLERATE_LOST_WORKERS)} can. '
      'Leave it False.'
    )
  if executor not in LANE_PROCESS_EXECUTORS:
    raise ValueError(
      "tolerate_lost_workers: needs executor='processes' or 'emulated' (a worker is lost "
      'when its lane process dies or raises); on the virtual clock, cost.failures stops '
      'workers.'
    )
  return True


def _profile_cache(data_dir) -> str:
  """`<data_dir>/jaxsgd_profiles`: calibrated costs are kept where the data lives."""
  root = data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets'
  return os.path.join(os.path.abspath(os.path.expanduser(root)), 'jaxsgd_profiles')


def as_dict(settings) -> Mapping[str, Any]:
  """A settings dataclass as a plain dict (for summaries and config files)."""
  return dataclasses.asdict(settings)
