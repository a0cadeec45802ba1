"""From settings to an executor: the one place where `cost` becomes a cost model.

    table = task_costs(shared, tasks, kinds, num_stages)   # profile, compute, preset, calibration
    model = cost_model(shared, table, lane_speeds)          # + links, stragglers, seed
    executor = make_executor(shared, tasks, kinds, num_stages, lane_speeds=...)

`tasks` (a `Tasks`) names the policy's real jitted tasks: a calibration times them (once:
the result is kept as a profile by the data), a hardware preset compiles them for its
roofline, and a profile is looked up by their model, batch, stage split and task set.
"""

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxsgd.algorithms.settings import SharedSettings
from jaxsgd.scheduler import CostModel, Placement, RealExecutor
from jaxsgd.scheduler import executor as executor_lib
from jaxsgd.scheduler import hardware, profile_lookup, profiles, task_timing, transfer, virtual
from jaxsgd.scheduler import host as host_lib


@dataclasses.dataclass(frozen=True)
class Tasks:
  """What a policy's task costs are measured, looked up or computed for.

  Attributes:
    calls: returns `{(stage, kind): (jitted fn, args)}`: the policy's real tasks on a
      sample batch (timed by a calibration, compiled by the roofline).
    model: the `StagedModel`.
    batch_size: the batch of one task.
    split: `[start, end)` layers of each stage.
    name: the task set (`profile_lookup.roles_signature`, `profile_lookup.server_tasks`,
      ...): what a profile table is keyed by.
  """

  calls: Callable[[], Mapping[Any, tuple]]
  model: Any
  batch_size: int
  split: tuple[tuple[int, int], ...]
  name: str


def task_costs(shared: SharedSettings, tasks: Tasks, kinds: Sequence[str], num_stages: int) -> dict:
  """Seconds per `(stage, kind)` from the run's cost source (`CostSettings`): a profile,
  `cost.compute`, a hardware preset's roofline, or a calibration kept as a profile."""
  cost = shared.cost
  optimizer = profile_lookup.optimizer_id(shared.optimizer)
  if cost.profile is not None:
    return _look_up(profiles.load(cost.profile), tasks, optimizer, cost.profile)
  if cost.explicit_compute:
    return cost.explicit(kinds, num_stages)
  if cost.device is not None:
    return hardware.analytic_costs(tasks.calls(), hardware.preset(cost.device))
  return calibrated(shared, tasks)


def calibrated(shared: SharedSettings, tasks: Tasks) -> dict:
  """The tasks measured on this machine once, then read from the profile kept in
  `shared.profile_cache`: a rerun gets the same costs, whatever the load then."""
  optimizer = profile_lookup.optimizer_id(shared.optimizer)
  device = jax.devices()[0]
  key = json.dumps(
    [
      profile_lookup.model_id(tasks.model),
      tasks.batch_size,
      optimizer,
      device.device_kind,
      jax.__version__,
      shared.cost.reps,
    ],
    sort_keys=True,
  )
  path = os.path.join(shared.profile_cache, hashlib.sha1(key.encode()).hexdigest()[:16] + '.json')
  saved = profiles.load(path) if os.path.exists(path) else None
  if saved is not None:
    try:
      return _look_up(saved, tasks, optimizer, path)
    except profiles.ProfileError:
      pass  # This task set is not in it yet: measure it and add it.
  table = task_timing.measure_table(
    tasks.calls(), split=tasks.split, tasks=tasks.name, warmup=1, reps=shared.cost.reps
  )
  profile = task_timing.make_profile(
    tasks.model, tasks.batch_size, optimizer, [table], warmup=1, reps=shared.cost.reps
  )
  profiles.save(profile if saved is None else profiles.merge(saved, profile), path)
  logging.info(
    'cost: measured %s (%s); kept in %s for later runs.', tasks.name, tasks.model.name, path
  )
  return table.figures(profiles.STATISTIC)


def _look_up(profile, tasks: Tasks, optimizer: str, source: str) -> dict:
  """`tasks`' table of `profile` (each task's cost as the profile measured it: the
  median of its repetitions, or a run's median if re-priced from a run); refuses a
  profile of another model, batch or split."""
  return profile_lookup.costs_for(
    profile,
    model=tasks.model,
    batch_size=tasks.batch_size,
    split=tasks.split,
    tasks=tasks.name,
    optimizer=optimizer,
    source=source,
  )


def cost_model(
  shared: SharedSettings,
  table: dict,
  lane_speeds: Sequence[float] = (),
  host: host_lib.SimulatedHost = host_lib.SimulatedHost(),
) -> CostModel:
  """The virtual clock's cost model: `table`, lane speeds, links, stragglers, seed, and
  the simulated host's dispatch and driver (`simulated_host`).

  Links are `cost.link_*`; left at 0, they are the host's (a host profile of the process
  executor measures its moves between lanes), else a hardware preset's (`cost.device`),
  else free. A lane's taking in what was moved to it is the host's, on any link.
  """
  cost = shared.cost
  latency, bandwidth, per_array = cost.link_latency, cost.bandwidth, 0.0
  if not cost.link_latency and not cost.link_bandwidth:
    if host.link is not None:
      latency, bandwidth, per_array = host.link
    elif cost.device is not None:
      spec = hardware.preset(cost.device)
      latency, bandwidth = spec.link_latency, spec.link_bandwidth
  return CostModel(
    compute=dict(table),
    device_speeds=tuple(lane_speeds),
    link_latency=latency,
    link_bandwidth=bandwidth,
    link_per_array=per_array,
    straggler_std=cost.straggler_std,
    seed=shared.cost_seed,
    dispatch=host.dispatch,
    driver=host.driver,
    driver_latency=host.driver_latency,
    take_in=host.take_in,
    export=host.export,
  )


def simulated_host(shared: SharedSettings, compute_lanes: int) -> host_lib.SimulatedHost:
  """What the virtual clock simulates of `cost.host` for this run: the host's figures
  measured with every core busy where the run's compute lanes take every core of the
  host (placed by `placement.lanes`: the cores they are pinned to, an unpinned lane one;
  unplaced: one core per lane, as the process executor places them)."""
  busy_cores = compute_lanes
  if shared.placement.lanes is not None:
    from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

    placed = LanePlacement.parse(shared.placement.lanes).lanes
    cores = {core for lane in placed if not lane.gpu for core in (lane.cores or ())}
    busy_cores = len(cores) + sum(1 for lane in placed if not lane.gpu and lane.cores is None)
  return host_lib.simulated(shared.cost.host_profile(), busy_cores)


def make_executor(
  shared: SharedSettings,
  tasks: Tasks,
  kinds: Sequence[str],
  num_stages: int,
  *,
  lane_speeds: Sequence[float] = (),
  threads: bool = False,
  adjust: Callable[[dict], dict] = lambda table: table,
  devices: Mapping[str, Sequence[jax.Device]] | None = None,
  run_ahead: int | None = None,
):
  """`(executor, cost table)`: the real clock (`threads`: a thread per process; with
  `executor='processes'`, a process per lane) and `{}`, or the virtual clock with a cost
  model of `adjust(table)`. With `executor='emulated'`, the process executor whose tasks
  wait the durations that same cost model prices (`ProcessExecutor(emulate=...)`), and
  the table. On the in-process real clock every task is compiled first, on
  the devices each kind of task runs on (`devices`: kind -> devices; `warm_up`). Call
  the executor's `close()` when the run is over.

  `run_ahead`: the process executor's (`executor.RUN_AHEAD` if None); a
  parameter server's workers take 1 (`asgd.RUN_AHEAD`). The virtual clock takes the
  same bound where it simulates that executor's host (`cost.host`)."""
  run_ahead = executor_lib.RUN_AHEAD if run_ahead is None else run_ahead
  if shared.on_lane_processes:
    from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.
    from jaxsgd.scheduler.process import ProcessExecutor

    table, model = {}, None
    if shared.emulated:  # priced as the virtual clock prices them: the same model
      table = task_costs(shared, tasks, kinds, num_stages)
      model = cost_model(shared, adjust(table), lane_speeds)
    lanes = shared.placement.lanes
    placement = None if lanes is None else LanePlacement.parse(lanes)
    executor = ProcessExecutor(
      placement,
      address=shared.cluster_address,
      tolerate_lost=shared.tolerate_lost_workers,
      run_ahead=run_ahead,
      emulate=model,
      copies=shared.placement.copy_placement(shared.executor),
      # Its driver CPU per task in summary.json from batch 1 on: batch 0's tasks wait
      # for the lanes to compile, while the driver describes their first results.
      steady_from_batch=1,
    )
    return executor, table
  if not shared.virtual:
    warm_up(tasks, devices)
    return RealExecutor(threads=threads), {}
  table = task_costs(shared, tasks, kinds, num_stages)
  host = simulated_host(shared, max(len(lane_speeds), num_stages))
  model = cost_model(shared, adjust(table), lane_speeds, host)
  executor = virtual.make(
    model,
    lane_hardware=lane_hardware(shared),
    copies_on_sender=host.copies_on_sender,
    receiver_reads=host.receiver_reads,
    time_sliced=host.time_sliced,
    core_shares=core_shares(shared, host.core_share),
    run_ahead=run_ahead if host.run_ahead else 0,
  )
  return executor, table


def warm_up(tasks: Tasks, devices: Mapping[str, Sequence[jax.Device]] | None = None) -> None:
  """Runs every task of `tasks` once where its sample arguments are placed and once on
  each device its kind runs on (`devices[kind]`), so that the real clock measures the
  run, not XLA compiling.

  jit compiles a function once per device its inputs are on. Unwarmed, a lane whose
  device had not run the model yet compiled while the others ran: LPP-SGD's replicas on
  devices 1 and 2 took none of 60 steps while device 0's two workers took them all (and,
  past their share of the learning-rate schedule, stopped learning), in a clean clone on
  2 cores.
  """
  for (_, kind), (fn, args) in tasks.calls().items():
    transfer.wait(fn(*args))
    for device in dict.fromkeys((devices or {}).get(kind, ())):
      transfer.wait(fn(*transfer.to_device(args, device)))


def lane_hardware(shared: SharedSettings) -> dict[str, str]:
  """`placement.lanes` on the virtual clock: lanes pinned to the same cores (or a GPU) of
  one host share that hardware, so their tasks run one at a time (time-sliced, with a
  host profile), as the process executor would run them with this placement. Lanes by
  placement name (`stage0`, `worker1`, `server`: `process.lane_name`) -> a hardware key;
  a lane pinned to nothing has none: its hardware is its own, shared with no other lane
  nor with its copies (its process exports them in a thread the system runs anywhere)."""
  if shared.placement.lanes is None:
    return {}
  from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

  placement = LanePlacement.parse(shared.placement.lanes)
  return {
    lane.name: _hardware_key(lane) for lane in placement.lanes if lane.gpu or lane.cores is not None
  }


def core_shares(shared: SharedSettings, share: float) -> dict[str, float]:
  """The CPU cores `placement.lanes` pins lanes to (`lane_hardware` values) -> `share`, what
  the host's own processes leave of each to its lanes while all of them compute
  (`SimulatedHost.core_share`); none where the host takes nothing from them, and none
  where the CPU lanes `placement.lanes` names are not all pinned on one host (the host
  profile's upkeep is one host's; a lane pinned to nothing has no core whose tasks could
  be watched). Lanes it does not name are on no core here, as `simulated_host` counts."""
  if share == 1 or shared.placement.lanes is None:
    return {}
  from jaxsgd.scheduler.lanes import LanePlacement  # Ray is imported only when used.

  on_cpus = [lane for lane in LanePlacement.parse(shared.placement.lanes).lanes if not lane.gpu]
  if any(lane.cores is None for lane in on_cpus) or len({lane.host for lane in on_cpus}) > 1:
    return {}
  return {_hardware_key(lane): share for lane in on_cpus}


def _hardware_key(lane) -> str:
  if lane.gpu == 1:
    return f'{lane.host or "local"} gpu of {lane.name}'  # one GPU per lane process
  if lane.gpu:  # shares: simulated as one GPU per host (Ray may spread them over several)
    return f'{lane.host or "local"} shared gpu'
  return f'{lane.host or "local"} cores {",".join(map(str, sorted(lane.cores)))}'


def cost_table(executor) -> dict | None:
  """The (adjusted) seconds per task the virtual clock or the emulated tasks used; None
  where tasks compute on the real clock."""
  model = getattr(executor, 'cost_model', None)
  return None if model is None else dict(model.compute)


def executor_summary(executor) -> dict:
  """What the executor adds to `summary.json`: lane processes' lanes lost and tolerated
  (`lost_lanes`), how long each checkpoint held the run (`checkpoint_pauses_ms`: from
  the drain's start to the driver going on, the save included), the driver's CPU per
  task, every thread of its process (`driver_cpu_ms_per_task`:
  `ProcessExecutor.driver_cpu_per_task`) and,
  with `placement.copies='auto'`, each lane's measured load and whose copy threads moved
  where, and the driver's load and where it was pinned (`copies_by_load`)."""
  summary = {}
  per_task = executor.driver_cpu_per_task() if hasattr(executor, 'driver_cpu_per_task') else None
  if per_task is not None:
    summary['driver_cpu_ms_per_task'] = round(1e3 * per_task, 3)
  if getattr(executor, 'lost', None):
    summary['lost_lanes'] = [dataclasses.asdict(lost) for lost in executor.lost]
  if getattr(executor, 'pauses', None):
    summary['checkpoint_pauses_ms'] = [round(1e3 * pause, 1) for pause in executor.pauses]
  measured = getattr(executor, 'copies_by_load', None)
  if measured is not None and measured.loads:
    summary['copies_by_load'] = {
      'load_percent': {  # tasks, copies: of a core
        lane: [round(100 * share, 1) for share in load] for lane, load in measured.loads.items()
      },
      'moved_to_cores': {lane: list(cores) for lane, cores in measured.moved.items()},
      'driver_load_percent': None
      if measured.driver_load is None
      else round(100 * measured.driver_load, 1),
      'driver_pinned_to_cores': None
      if measured.driver_cores is None
      else list(measured.driver_cores),
    }
  return summary


def placement(shared: SharedSettings, num_stages: int) -> Placement:
  """Stage k's device, from `config.placement` (checked by `shared_settings`)."""
  devices = jax.devices()
  if shared.placement.devices is not None:
    devices = [devices[p] for p in shared.placement.devices]
  return Placement.create(num_stages, devices, shared.placement.stage_to_device)


def lane_devices(shared: SharedSettings, num_lanes: int) -> list[jax.Device]:
  """Real clock: lane i on `jax.devices()[i % n]`; virtual: every lane on the first
  (only simulated time depends on the lanes; the bits do not depend on the device)."""
  devices = jax.devices()
  if shared.virtual:
    return [devices[0]] * num_lanes
  return [devices[i % len(devices)] for i in range(num_lanes)]


def worker_speeds(
  shared: SharedSettings, num_workers: int, what: str = 'worker'
) -> tuple[float, ...]:
  """`cost.speeds` (default all 1), one per worker."""
  speeds = shared.cost.speeds or (1.0,) * num_workers
  if len(speeds) != num_workers:
    raise ValueError(f'cost.speeds: {len(speeds)} values for {num_workers} {what}s.')
  return tuple(float(s) for s in speeds)


def failures(shared: SharedSettings, num_workers: int, what: str = 'worker') -> dict[int, float]:
  """`cost.failures` as worker -> the earliest (simulated or wall) second it fails."""
  result: dict[int, float] = {}
  for m, time in shared.cost.failures:
    if not 0 <= m < num_workers:
      raise ValueError(f'cost.failures: worker {m!r} is not a {what} in [0, {num_workers}).')
    result[m] = min(float(time), result.get(m, float('inf')))
  return result
