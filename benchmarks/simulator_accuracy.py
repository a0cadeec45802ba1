r"""The simulator's error: each scheduler family on lane processes and on the virtual clock.

    python -m benchmarks.simulator_accuracy                 # ~10 min on the 2-core CPU
    python -m benchmarks.simulator_accuracy --hidden=512 --batch=256 --steps=60 --warmup=10
                                                            # small tasks (1-5 ms), ~5 min
    python -m benchmarks.simulator_accuracy --steps=40 --families=ddg,asgd
    python -m benchmarks.simulator_accuracy --profile=/tmp/acc.json   # reuse a profile
    python -m benchmarks.simulator_accuracy --lanes=8 --depth=8 --batch=512 --repeats=1
                                                            # K=8 lanes (a 16-core machine)

`--lanes=K` (2 by default) gives every family K lanes on cores 0..K-1: K stages, K
workers beside the server, PD-ASGD 1:(K-1), K LPP-SGD replicas; `--depth` the hidden
layers (K stages need K-1). Each family runs the same config on both clocks, through `experiments.train`'s own path
(`training.train_and_evaluate`):
  measured   `clock='real', executor='processes'`: every lane an OS process pinned to
             a core (`--placement`, below), the run's trace as the lanes timed it;
             `--repeats` runs (3), the one of median time per iteration taken (each
             run's time is printed: one run against the next moved by up to 60 % here);
  predicted  `clock='virtual'` with `cost.profile` = one profile measured at the start
             for this executor (`cost.dispatch`: its host overhead per task is added
             to every task; `--dispatch=auto` takes `processes_cpu`, the CPU all the
             run's processes spend per task, where the two lanes take every core and
             the driver and Ray run on theirs, as here, else `processes`, the wall time
             per task of a chain), links between lane processes measured at the
             start (`measure_process_links`: a new value moved in every pair, as
             every message of a run is one),
             copies made by the sending lane between its tasks
             (`cost.copies='sender'`: Ray serializes the value in the lane process), and
             the same `placement.lanes` (lanes placed on one core share it on the
             virtual clock, as they do on the machine);
  repriced   the predicted run again with each task kind costing its median duration in
             the family's warm-up run on the lanes (another run, before the measured
             one: lane costs measured the way lanes run);
  replayed   the predicted run again with each task kind costing its median duration in
             the measured run: the schedule model alone, without the profile.
The virtual runs simulate the process executor's driver (`--driver`, `cost.driver` and
`cost.driver_latency`): predicted with the profile's figures (its thread's CPU per event
and the time a message takes between it and a lane, measured on an idle lane, or where
the K lanes take every core with one busy lane per core: `measure_loaded_driver`);
repriced and replayed with a latency from their lanes' run, so that the driver hears
of an end as late as there (the median from a task's end to the driver hearing of it,
less the CPU per event). The replay is run again without the driver, and printed, so
that what the driver model adds is seen against the same measured run.
The profile (`--profile` reuses one) is measured as the lanes run: in a process pinned
to core 0 with XLA's intra-op threads off (`--xla_cpu_multi_thread_eigen=false`, one
OpenMP thread), every task of every family's table (`experiments.profile`), the fastest
of `--reps` interleaved wall-clock calls; plus the process executor's dispatch overhead,
timed (wall and CPU) through one pinned lane (`lane_timing.measure_process_dispatch`).

Per family: time per iteration (an iteration is one applied update of the whole model:
a batch whose every stage has updated, or one server update), from the end of iteration
`--warmup` to the end of the last one (the lanes compile during the first ones);
utilization of each compute lane over the same window; and for the asynchronous methods
the staleness histogram of every applied update. Error = |predicted - measured| /
measured of the time per iteration; the last line is the largest over the families that
ran. The model is an MLP on MNIST-1D (40-1024-1024-1024-1024-10, batch 1024: tasks of
30-300 ms), so that a task is well above what the process executor's host spends on it
(the driver's and Ray's CPU, 1-2.5 ms per task on this 2-core VM, on the lanes' own
cores). With `--hidden=512 --batch=256` the tasks take 1-5 ms, that host time is of their
size, and the error measures mostly it (49 % here,
benchmarks/results/simulator_history.md). The predicted runs
read the profile's medians (`--statistic`, `cost.statistic`), time-slice lanes placed
on one core (`--sharing`, `cost.sharing`) and run processes ahead of their lanes as the
process executor's driver does (`--schedule`, `cost.schedule`). The machine's load average is printed: other
jobs on this 2-core machine take cores from the lanes, which the simulator cannot know.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

FAMILIES = ('bp', 'ddg', 'local', 'asgd', 'dcasgd', 'pdasgd', 'lppsgd')


def labels(lanes: int) -> dict:
  """Each family's name in the tables, with `lanes` (K) lanes."""
  return {
    'bp': f'staged BP K={lanes}',
    'ddg': f'DDG K={lanes}',
    'local': f'local K={lanes}',
    'asgd': f'ASGD M={lanes}',
    'dcasgd': f'DC-ASGD M={lanes}',
    'pdasgd': f'PD-ASGD 1:{lanes - 1}',
    'lppsgd': f'LPP-SGD {lanes}x1',
  }


LABELS = labels(2)  # `--lanes` updates it
SIDES = ('measured', 'predicted', 'repriced', 'replayed')
ASYNCHRONOUS = ('asgd', 'dcasgd', 'pdasgd', 'lppsgd')
# The profile's tables: DDG and PD-ASGD (K stages, sequential roles) compute what staged
# BP computes (`profile_lookup.roles_signature`), so BP's table serves all three.
TABLE_OF = {'ddg': 'bp', 'pdasgd': 'bp'}  # else the family's own
MEASURED = tuple(f for f in FAMILIES if f not in TABLE_OF)  # the families with a table


# What a lane process runs with (`lanes.placement.LaneSpec.environment`, one core).
LANE_ENV = {
  'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false',
  'OMP_NUM_THREADS': '1',
  'MKL_NUM_THREADS': '1',
  'OPENBLAS_NUM_THREADS': '1',
}


def family_config(
  name: str,
  args,
  side: str,
  profile: str | None = None,
  links=(0.0, 0.0),
  dispatch='processes',
  driver=(0.0, 0.0),
):
  """The config of family `name` for `side`: 'measured' (lane processes), 'predicted'
  (the virtual clock with `profile`, its simulated driver taking `driver` = (seconds per
  event, seconds of each message's way)) or 'tables' (what the profile measures)."""
  import ml_collections

  from benchmarks import common as bench_common  # (imports JAX: not at the module's top)
  from experiments.configs import default

  config = default.get_config()
  config.dataset = 'mnist1d/5k'
  config.model = ml_collections.ConfigDict({'name': 'mlp', 'hidden': (args.hidden,) * args.depth})
  config.batch_size = args.batch
  config.train_steps = args.steps
  config.eval_every = args.steps
  config.eval_batch_size = 500
  config.optimizer.name = 'sgd'
  config.optimizer.schedule = 'constant'
  config.optimizer.learning_rate = 0.05
  config.algorithm = default.algorithm(name)
  if name in ('bp', 'ddg', 'local'):
    config.stages = args.lanes
  if name in ('asgd', 'dcasgd'):
    config.workers = args.lanes
  if name == 'pdasgd':
    config.stages = args.lanes
    config.algorithm.update({'n_fwd': 1, 'n_bwd': args.lanes - 1})
  if name == 'lppsgd':
    config.algorithm.update({'devices': args.lanes, 'workers_per_device': 1})
  config.placement.lanes = '; '.join(bench_common.family_lanes(name, args.lanes))
  if side == 'measured':
    config.clock, config.executor = 'real', 'processes'
  else:
    config.clock = 'virtual'
  if side == 'predicted':
    config.cost.profile = profile
    config.cost.dispatch = dispatch
    config.cost.copies = 'sender'  # a lane serializes what it sends, between its tasks
    config.cost.statistic = args.statistic
    config.cost.sharing = args.sharing
    config.cost.schedule = args.schedule
    config.cost.driver, config.cost.driver_latency = driver
    config.cost.link_latency, config.cost.link_bandwidth = links
  return config


# --- the profile: measured in a process set up as a lane ---------------------------------------
def measure_profile(path: str, args) -> None:
  """Runs this module in a process pinned to core 0 with the lanes' flags; it writes the
  tables the asked families need to `path` (`_write_tables`): a profile reused with
  `--profile` must hold the tables of these families at this `--lanes`, `--depth`,
  `--hidden` and `--batch` (else `ProfileError` names what does not fit)."""
  env = {**os.environ, **LANE_ENV}
  command = [sys.executable, '-m', 'benchmarks.simulator_accuracy', '--_tables', path]
  command += [f'--{k}={v}' for k, v in _shape_args(args).items()]
  subprocess.run(command, env=env, check=True)


def _shape_args(args) -> dict:
  return {
    'hidden': args.hidden,
    'depth': args.depth,
    'lanes': args.lanes,
    'batch': args.batch,
    'steps': args.steps,
    'reps': args.reps,
    'neighbours': args.neighbours,
    'families': args.families,
  }


def _write_tables(path: str, args) -> None:
  """In the profile's own process: pins it to core 0, busies cores 1..K-1 if asked
  (`--neighbours=busy`), and writes the profile of `_measured_tables` to `path`."""
  from jaxsgd.scheduler import profiles, task_timing

  task_timing.pin_to_core(0)  # before JAX's first computation
  with contextlib.ExitStack() as neighbours:
    if args.neighbours == 'busy':  # the lanes' other cores compute, as in the runs
      neighbours.enter_context(task_timing.BusyNeighbours(range(1, args.lanes)))
    profiles.save(_measured_tables(args), path)


def _measured_tables(args):
  """One profile of the tables of the asked families (`TABLE_OF`: DDG and PD-ASGD read
  BP's), each measured through `experiments.profile`, the dispatch overhead with the
  first."""
  from experiments import profile as profile_command
  from jaxsgd import data as data_lib
  from jaxsgd.scheduler import lane_timing, profile_lookup, profiles, task_timing
  from jaxsgd.training.loop import build_model

  merged = None
  families = set(args.families.split(','))
  for name in [m for m in MEASURED if m in {TABLE_OF.get(f, f) for f in families}]:
    config = family_config(name, args, 'tables')
    dataset = data_lib.load(config.dataset, config.get('data_dir'))
    model = build_model(config, dataset)

    def batch_for(size, dataset=dataset, config=config):
      return next(dataset.train_batches(size, seed=config.seed))

    table, batch = profile_command.measure_table(
      config, model, batch_for, warmup=3, reps=args.reps, clock='cpu'
    )
    profile = task_timing.make_profile(
      model,
      batch,
      profile_lookup.optimizer_id(dict(config.optimizer)),
      [table],
      warmup=3,
      reps=args.reps,
      clock='cpu',
      pinned=True,
      dispatch=lane_timing.measure_dispatch() if merged is None else {},
    )
    merged = profile if merged is None else profiles.merge(merged, profile)
  return merged


# --- reading a run's trace ---------------------------------------------------------------------
def read_trace(workdir: str):
  """`(lane names, [(lane, kind, start, end, batch, stage)])` of the run's trace.json
  (seconds)."""
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
  tasks = [
    (
      e['tid'],
      e['cat'],
      e['ts'] / 1e6,
      (e['ts'] + e['dur']) / 1e6,
      e['args'].get('batch'),
      e['args'].get('stage'),
    )
    for e in events
    if e.get('ph') == 'X'
  ]
  return names, tasks


def iteration_ends(tasks, per_task: bool = False) -> list[float]:
  """When each iteration ended: per batch, the last end of its update tasks (every stage
  updated); without update tasks (updates applied in the driver), its backward tasks.
  `per_task` (`ONE_UPDATE_PER_TASK`): every such task ends an iteration of its own."""
  for kind in ('update', 'backward'):
    ends = {}
    for i, (_, task_kind, _, end, batch, _) in enumerate(tasks):
      if task_kind == kind and batch is not None:
        key = i if per_task else batch
        ends[key] = max(ends.get(key, 0.0), end)
    if ends:
      return sorted(ends.values()) if per_task else [ends[b] for b in sorted(ends)]
  raise ValueError('the trace has no update or backward tasks')


# Families whose every update (or, with updates applied in the driver, every backward) is
# an iteration: an LPP-SGD worker updates its replica alone, and numbers its batches
# itself, so that grouping tasks by batch made one iteration of two workers' updates on
# the virtual clock (no update tasks there) and of one on the lanes.
ONE_UPDATE_PER_TASK = ('lppsgd',)


def _per_task(workdir: str) -> bool:
  """Whether the run at `workdir` (`<family>-<side>`) counts an iteration per task."""
  return os.path.basename(workdir).split('-')[0] in ONE_UPDATE_PER_TASK


def window(names, tasks, warmup: int, per_task: bool = False) -> tuple[float, float, int]:
  """`(start, stop, iterations)` of the steady state: from the end of the first
  iteration after both `warmup` iterations and the first `warmup` tasks of every
  compute lane that runs more (a lane compiles its tasks on first use: a worker still
  compiling while the others run would make the start look unlike the rest), to the
  end of the last."""
  ends = sorted(iteration_ends(tasks, per_task))
  per_lane = {}
  for lane, _, _, end, _, _ in tasks:
    if not names[lane].startswith('link '):
      per_lane.setdefault(lane, []).append(end)
  # A lane with no more than `warmup` tasks (LPP-SGD's all-reduce, which averages once,
  # at the end) does no per-iteration work to warm up.
  warm = max((sorted(e)[warmup - 1] for e in per_lane.values() if len(e) > warmup), default=0.0)
  warm = max(warm, ends[min(warmup, len(ends) - 2)])
  after = [e for e in ends if e >= warm]
  if len(after) < 2:
    raise ValueError(f'fewer than 2 iterations after the warm-up; run more than {len(ends)}')
  return after[0], after[-1], len(after) - 1


# Iterations per block: the time per iteration is the median over blocks of this many.
BLOCK = 5


def window_stats(workdir: str, warmup: int) -> dict:
  """Seconds per iteration in the steady state (`window`): the median over blocks of
  `BLOCK` iterations (a burst of other jobs' load slows some blocks; the median is the
  time the run takes when they leave it alone), and the mean; each compute lane's
  utilization over the window."""
  names, tasks = read_trace(workdir)
  start, stop, iterations = window(names, tasks, warmup, _per_task(workdir))
  busy = {}
  for lane, _, begin, end, _, _ in tasks:
    name = names[lane]
    if name.startswith('link '):
      continue
    overlap = max(0.0, min(end, stop) - max(begin, start))
    key = _short(name)
    busy[key] = busy.get(key, 0.0) + overlap
  utilization = {lane: seconds / (stop - start) for lane, seconds in sorted(busy.items())}
  ends = [e for e in sorted(iteration_ends(tasks, _per_task(workdir))) if start <= e <= stop]
  blocks = [(ends[i + BLOCK] - ends[i]) / BLOCK for i in range(0, len(ends) - BLOCK, BLOCK)] or [
    (stop - start) / iterations
  ]
  from benchmarks import common as bench_common

  steady = [(lane, kind, b, e, batch) for lane, kind, b, e, batch, _ in tasks if b >= start]
  return {
    'per_iteration': float(np.median(blocks)),
    'mean_per_iteration': (stop - start) / iterations,
    'utilization': utilization,
    'iterations': iterations,
    # A backward's end -> its lane's copy of that batch (an ASGD worker's push), s.
    'send_delays': bench_common.send_delays(names, steady),
    # A compute task's end -> the driver hearing of it, s (`TaskRecord.heard`).
    'hear_delays': hear_delays(workdir, start),
  }


def hear_delays(workdir: str, since: float) -> list[float]:
  """Seconds from the end of each compute task that started at `since` or later to its
  run's driver hearing of it (the trace's 'heard': the process executor's, or the virtual
  clock's simulated driver; none without one)."""
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  return [
    (e['args']['heard'] - e['ts'] - e['dur']) / 1e6
    for e in events
    if e.get('ph') == 'X' and 'heard' in e['args'] and e['ts'] / 1e6 >= since
  ]


def driver_seconds(how: str, profile: tuple, workdir: str | None, warmup: int) -> tuple:
  """`(cost.driver, cost.driver_latency)` of a virtual run (`--driver`): 'none', zeros;
  'profile', the profile's figures (`profile`: the driver's CPU per event, the latency
  on an idle machine); 'heard', the same for the predicted run (`workdir` None), and for
  a run costed by the lanes' run at `workdir`, the latency that makes the driver hear of
  an end as late as that run's median (its median hear delay less the CPU per event)."""
  if how == 'none':
    return 0.0, 0.0
  if how == 'profile' or workdir is None:
    return profile
  heard = float(np.median(window_stats(workdir, warmup)['hear_delays']))
  return profile[0], max(heard - profile[0], 0.0)


def _short(name: str) -> str:
  from jaxsgd.scheduler.placement import lane_name

  return lane_name(name)


def task_medians(workdir: str, warmup: int) -> dict:
  """`{(stage, kind): median seconds}` of the compute tasks of the run's steady state."""
  names, tasks = read_trace(workdir)
  start, _, _ = window(names, tasks, warmup, _per_task(workdir))
  durations = {}
  for lane, kind, begin, end, _, stage in tasks:
    if begin >= start and not names[lane].startswith('link '):
      durations.setdefault((stage, kind), []).append(end - begin)
  return {key: float(np.median(d)) for key, d in durations.items()}


def observed_profile(profile: str, workdir: str, warmup: int) -> str:
  """A copy of `profile` whose task costs are the median durations of each task kind
  in the measured run at `workdir` (steady state), as the lanes timed them.

  What the virtual clock then predicts differs from the measured run only by what the
  schedule model leaves out or gets wrong (dispatch, links, the order of tasks on a
  shared core), not by how much longer tasks took under the machine's load.
  """
  import dataclasses

  from jaxsgd.scheduler import profiles, repricing

  medians = task_medians(workdir, warmup)
  loaded = profiles.load(profile)

  # Every figure the run's median (whichever `cost.statistic` reads), as `reprice_from_trace` does.
  timed = {key: [seconds] for key, seconds in medians.items()}
  tables = tuple(repricing.repriced_table(t, timed) for t in loaded.tables)
  path = os.path.join(workdir, 'observed_profile.json')
  profiles.save(dataclasses.replace(loaded, tables=tables), path)
  return path


def slowdown(root: str, name: str, warmup: int, dispatch: float) -> float:
  """Median over task kinds of (the task's median duration in the measured run) / (its
  cost in the profile): how much longer the lanes took for the same work (1 on an
  idle machine whose lanes match the profile; other jobs' load raises it)."""
  measured = task_medians(os.path.join(root, f'{name}-measured'), warmup)
  predicted = task_medians(os.path.join(root, f'{name}-predicted'), warmup)
  ratios = [
    measured[k] / (predicted[k] - dispatch)
    for k in measured
    if k in predicted and predicted[k] > dispatch
  ]
  return float(np.median(ratios)) if ratios else float('nan')


def warm_up(name: str, args, workdir: str, attempts: int = 3) -> None:
  """Runs family `name` on lane processes until every lane has run `args.warmup` tasks
  in one run (at most `attempts` runs): each run adds the programs its lanes compiled
  to the shared compilation cache. An asynchronous worker that compiles slowly can see
  the others take every step of a run, and compile its next program only in the next."""
  from jaxsgd import training

  config = family_config(name, args, 'measured')
  config.train_steps = config.eval_every = args.steps
  for _ in range(attempts):
    training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
    names, tasks = read_trace(workdir)
    counts = [sum(1 for t in tasks if t[0] == lane) for lane in names]
    if min(c for c, n in zip(counts, names.values()) if not n.startswith('link ')) >= args.warmup:
      return


class NoSteadyState(ValueError):
  """A run whose lanes did not all get past `--warmup` (`window_stats`)."""


def steady_stats(workdir: str, warmup: int) -> dict:
  """`window_stats`, raising `NoSteadyState` where it finds no steady state."""
  try:
    return window_stats(workdir, warmup)
  except ValueError as error:
    raise NoSteadyState(str(error)) from error


def measured_runs(config, workdir: str, args) -> tuple[dict, dict, list, float]:
  """`--repeats` runs on the lanes, one after another: `(stats, summary)` of the one of
  median time per iteration — the family's measured run, kept at `workdir`, where the
  replayed run and the task slowdown read its tasks — every run's seconds per iteration
  in order, and the largest load average seen. One run against the next moved by up to
  60 % here (ASGD 106–181 ms per iteration in four runs of 2026-11-26, minutes apart):
  more than the errors to be measured, so the error is taken against the median run."""
  from jaxsgd import training

  runs, load = [], 0.0
  for repeat in range(args.repeats):
    wait_for_quiet(args.max_load, args.max_wait)
    load = max(load, os.getloadavg()[0])
    path = f'{workdir}-run{repeat}'
    summary = training.train_and_evaluate(config, path, show_progress=False, overwrite=True)
    stats = steady_stats(path, args.warmup)
    load = max(load, os.getloadavg()[0])
    runs.append((stats['per_iteration'], repeat, path, stats, summary))
  _, _, path, stats, summary = sorted(runs, key=lambda run: run[:2])[len(runs) // 2]
  os.rename(path, workdir)
  return stats, summary, [run[0] for run in runs], load


def wait_for_quiet(max_load: float, max_wait: float) -> None:
  """Waits until the 1-minute load average is below `max_load` (at most `max_wait` s):
  on a shared machine, other jobs take the lanes' cores, which no simulator can know."""
  deadline = time.time() + max_wait
  while os.getloadavg()[0] >= max_load and time.time() < deadline:
    time.sleep(5)


def run_family(
  name: str, args, profile: str, links, dispatch: tuple, root: str, driver: tuple
) -> dict:
  """Every run of family `name`: their statistics, or why one could not run. `dispatch`:
  `(cost.dispatch, its seconds)` of the virtual clock's runs; `driver`: the profile's
  `(driver, driver_latency)` (`driver_seconds`)."""
  from jaxsgd import training

  result = {'driver': {}}
  for side in SIDES:
    given, lanes_run = profile, None
    if side == 'replayed':  # the schedule alone: the measured run's own task times
      lanes_run = os.path.join(root, f'{name}-measured')
    if side == 'repriced':  # lane costs from another run: the warm-up run
      lanes_run = os.path.join(root, f'{name}-measured-warm')
    try:
      if lanes_run is not None:
        given = observed_profile(profile, lanes_run, args.warmup)
        result['driver'][side] = driver_seconds(args.driver, driver, lanes_run, args.warmup)
      elif side == 'predicted':
        result['driver'][side] = driver_seconds(args.driver, driver, None, args.warmup)
    except ValueError:  # no steady state in the warm-up run
      if side != 'repriced':
        raise
      result[side] = None
      continue
    virtual = side in ('repriced', 'replayed')
    config = family_config(
      name,
      args,
      'predicted' if virtual else side,
      given,
      links,
      dispatch[0],
      result['driver'].get(side, (0.0, 0.0)),
    )
    workdir = os.path.join(root, f'{name}-{side}')
    try:
      if side == 'measured':  # fills the compilation cache: the lanes of the next run load
        warm_up(name, args, workdir + '-warm')
        stats, summary, result['measured_runs'], result['load'] = measured_runs(
          config, workdir, args
        )
      else:
        summary = training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
        stats = steady_stats(workdir, args.warmup)
    except NoSteadyState as error:  # a lane that barely ran (compiling, or starved)
      return {'skipped': f'{side} run has no steady state: {error}'}
    except Exception as error:  # noqa: BLE001 - reported, the other families go on
      line = ' '.join(str(error).split())[:160]
      if side == 'measured' and name in ('pdasgd', 'lppsgd'):
        return {'skipped': f'not on processes yet ({type(error).__name__}: {line})'}
      return {'skipped': f'{side} run failed ({type(error).__name__}: {line})'}
    stats['staleness'] = summary.get('staleness_histogram', {})
    result[side] = stats
    if side == 'predicted':
      result['slowdown'] = slowdown(root, name, args.warmup, dispatch[1])
  if any(result['driver'].get('replayed', ())):  # what the driver adds: the replay without it
    config.cost.driver = config.cost.driver_latency = 0.0
    workdir = os.path.join(root, f'{name}-replayed-no-driver')
    training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
    result['replayed_no_driver'] = steady_stats(workdir, args.warmup)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=40, help='iterations of each run')
  parser.add_argument('--warmup', type=int, default=8, help='iterations left out (compiling)')
  parser.add_argument('--hidden', type=int, default=1024, help='width of the MLP')
  parser.add_argument('--depth', type=int, default=4, help='hidden layers of the MLP')
  parser.add_argument(
    '--lanes', type=int, default=2, help='K: stages, workers or replicas, on cores 0..K-1'
  )
  parser.add_argument('--batch', type=int, default=1024)
  parser.add_argument('--reps', type=int, default=20, help='timed calls per task (profile)')
  parser.add_argument('--families', default=','.join(FAMILIES))
  parser.add_argument(
    '--repeats',
    type=int,
    default=3,
    help='measured runs per family; the error is against the median one (odd: a run)',
  )
  parser.add_argument(
    '--dispatch',
    default='auto',
    choices=('auto', 'processes', 'processes_cpu'),
    help='host overhead per task the virtual clock adds (cost.dispatch); auto: '
    "'processes_cpu' where the K lanes take every core this process may use (K=2 on a "
    "2-core machine), else 'processes'",
  )
  parser.add_argument(
    '--statistic',
    default='median',
    choices=('min', 'median', 'p90'),
    help="which figure of the profile's repetitions a task costs (cost.statistic)",
  )
  parser.add_argument(
    '--sharing',
    default='time_slice',
    choices=('fifo', 'time_slice'),
    help='how lanes placed on one core share it on the virtual clock (cost.sharing)',
  )
  parser.add_argument(
    '--schedule',
    default='run_ahead',
    choices=('in_order', 'run_ahead'),
    help='when a simulated process goes on: at its task end, or at its dispatch as the '
    "process executor's driver runs ahead of its lanes (cost.schedule)",
  )
  parser.add_argument(
    '--driver',
    default='heard',
    choices=('heard', 'profile', 'none'),
    help='the simulated driver (cost.driver: its CPU per event, cost.driver_latency: each '
    "message's way): 'profile', the profile's figures (an idle lane) for every virtual "
    "run; 'heard' (default), those for the predicted run, and for the repriced and "
    'replayed runs a latency from the warm-up and the measured run (the median time from '
    "a task's end to the driver hearing of it, less the CPU per event); 'none': no driver",
  )
  parser.add_argument(
    '--neighbours',
    default='idle',
    choices=('idle', 'busy'),
    help='cores 1..K-1 while the profile is measured on core 0: idle, or busy with matrix '
    'products (`task_timing.BusyNeighbours`), as the lanes keep them in the runs',
  )
  parser.add_argument('--profile', default=None, help='a profile to use (default: measure)')
  parser.add_argument('--link_latency', type=float, default=None, help='s (default: measure)')
  parser.add_argument('--link_bandwidth', type=float, default=None, help='B/s, with the above')
  parser.add_argument(
    '--max_load', type=float, default=1e9, help='wait for a 1-min load average below this'
  )
  parser.add_argument('--max_wait', type=float, default=600, help='s, at most, per family')
  parser.add_argument('--_tables', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._tables:
    _write_tables(args._tables, args)
    return
  if args.repeats < 1:
    parser.error(f'--repeats: measured runs per family, at least 1; got {args.repeats}')
  if args.lanes < 2 or not set(range(args.lanes)) <= os.sched_getaffinity(0):
    parser.error(
      f'--lanes: K >= 2 lanes pinned to cores 0..K-1, which this process may use '
      f'(it may use {sorted(os.sched_getaffinity(0))}); got {args.lanes}'
    )
  if args.depth + 1 < args.lanes:
    parser.error(
      f'--depth: {args.lanes} stages need {args.lanes - 1} hidden layers; got {args.depth}'
    )
  LABELS.update(labels(args.lanes))
  families = [f for f in args.families.split(',') if f]
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown:
    parser.error(f'--families: unknown {unknown}; allowed: {", ".join(FAMILIES)}')
  started = time.time()
  print(
    f'machine: {os.cpu_count()} CPU cores, load average '
    f'{"/".join(f"{x:.1f}" for x in os.getloadavg())} at start; MLP 40-'
    f'{"-".join([str(args.hidden)] * args.depth)}-10 on MNIST-1D, batch {args.batch}, SGD; '
    f'{args.lanes} lanes per family; '
    f'{args.steps} iterations per run, the first {args.warmup} left out',
    flush=True,
  )
  root = tempfile.mkdtemp(prefix='simacc-')
  # Every process (lanes inherit the cluster's environment) shares one compilation cache:
  # a lane compiling a task for seconds while the others run would not be steady state.
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.path.join(root, 'jax_cache'),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )
  import jax

  from jaxsgd.scheduler import lane_timing, profiles
  from jaxsgd.scheduler.lanes import cluster

  profile = args.profile
  if profile is None:
    profile = os.path.join(root, 'profile.json')
    measure_profile(profile, args)
  cluster.connect(None)  # one Ray cluster for every run (each run starts its own lanes)
  try:
    loaded = profiles.load(profile)
    wait_for_quiet(args.max_load, args.max_wait)
    if not {'processes', 'processes_cpu', 'driver', 'driver_latency'} <= loaded.dispatch.keys():
      dispatch = lane_timing.measure_process_dispatch(cores=(0,))
      loaded = profiles.merge(loaded, _with_dispatch(loaded, dispatch))
      profiles.save(loaded, profile)
    # Lanes on cores 0..K-1: do they leave the driver and Ray a core of their own?
    free = len(os.sched_getaffinity(0)) > args.lanes
    dispatch_kind = args.dispatch
    if dispatch_kind == 'auto':
      dispatch_kind = 'processes' if free else 'processes_cpu'
    # The driver's figures the predicted runs simulate: measured with every core busy
    # (`lane_timing.measure_loaded_driver`) where the K lanes leave the driver no core.
    driver_keys = profiles.DRIVER_FIGURES['profile' if free else 'profile_loaded']
    busy_lanes = loaded.dispatch.get('driver_loaded_lanes')
    if not free and busy_lanes != args.lanes:  # the lanes keep every core busy: measured so
      figures = lane_timing.measure_loaded_driver(cores=range(args.lanes))
      loaded = profiles.merge(loaded, _with_dispatch(loaded, figures))
      profiles.save(loaded, profile)
    measured_how = 'a profile given' if args.profile else _neighbours_label(args)
    print(
      f'profile: {profile} ({loaded.date}, pinned to core 0, lane flags, {measured_how}'
      f'; min, median, p90 of '
      f'{loaded.reps}); dispatch per task (µs): '
      + ', '.join(f'{k} {1e6 * v:.1f}' for k, v in loaded.dispatch.items() if 'driver' not in k)
      + f'; the driver (µs): {1e6 * loaded.dispatch["driver"]:.1f} of CPU per event, '
      f"{1e6 * loaded.dispatch['driver_latency']:.1f} per message's way"
      + (
        ''
        if free
        else f'; with the lanes busy on cores 0-{args.lanes - 1} (used here): '
        f'{1e6 * loaded.dispatch[driver_keys[0]]:.1f} per event, '
        f'{1e6 * loaded.dispatch[driver_keys[1]]:.1f} per way'
      )
      + f'; predicted with {dispatch_kind}, cost.statistic={args.statistic!r}, '
      f'cost.sharing={args.sharing!r}, cost.schedule={args.schedule!r}, '
      f'--driver={args.driver!r}',
      flush=True,
    )
    if args.link_latency is None:
      links = lane_timing.measure_process_links(cores=(0, 1))
    else:
      links = (args.link_latency, args.link_bandwidth)
    print(
      f'links between lane processes: {1e6 * links[0]:.0f} µs + bytes / {links[1] / 1e9:.2f} GB/s',
      flush=True,
    )
    results = {}
    for name in families:
      results[name] = run_family(
        name,
        args,
        profile,
        links,
        (dispatch_kind, loaded.dispatch[dispatch_kind]),
        root,
        tuple(loaded.dispatch[key] for key in driver_keys),
      )
      with open(os.path.join(root, 'results.json'), 'w') as f:
        json.dump(results, f)
      print(f'  {LABELS[name]}: {_one_line(results[name])}', flush=True)
  finally:
    cluster.shutdown()
  print(
    f'load average {"/".join(f"{x:.1f}" for x in os.getloadavg())} at end; '
    f'jax {jax.__version__}; {time.time() - started:.0f} s'
  )
  print_table(results)


def _neighbours_label(args) -> str:
  """How the other lanes' cores were while the profile was measured (`--neighbours`)."""
  if args.neighbours == 'idle':
    return 'neighbours idle'
  busy = '1' if args.lanes == 2 else f'1-{args.lanes - 1}'
  return f'core{"s" if args.lanes > 2 else ""} {busy} busy'


def _with_dispatch(profile, dispatch: dict):
  import dataclasses

  return dataclasses.replace(profile, tables=(), dispatch=dispatch)


def _one_line(result: dict) -> str:
  if 'skipped' in result:
    return result['skipped']
  return ', '.join(
    f'{side} {1e3 * result[side]["per_iteration"]:.2f} ms/iteration'
    for side in SIDES
    if result.get(side)
  )


def _ms(stats) -> str:
  return f'{1e3 * stats["per_iteration"]:.2f}' if stats else '-'


def _error(result: dict, side: str) -> float:
  measured = result['measured']['per_iteration']
  return 100 * abs(result[side]['per_iteration'] - measured) / measured


def print_table(results: dict) -> None:
  header = (
    'family',
    'measured ms/it',
    '(mean)',
    'measured runs',
    'predicted ms/it',
    'error %',
    'repriced ms/it',
    'error %',
    'replayed ms/it',
    'error %',
    'task slowdown',
    'load',
    'utilization measured',
    'utilization predicted',
  )
  rows, errors, notes = [], {}, []
  for name, result in results.items():
    if 'skipped' in result:
      notes.append(f'{LABELS[name]}: {result["skipped"]}')
      continue
    errors[name] = _error(result, 'predicted')
    rows.append(
      (
        LABELS[name],
        f'{1e3 * result["measured"]["per_iteration"]:.2f}',
        f'{1e3 * result["measured"]["mean_per_iteration"]:.2f}',
        ' '.join(f'{1e3 * seconds:.0f}' for seconds in result['measured_runs']),
        f'{1e3 * result["predicted"]["per_iteration"]:.2f}',
        f'{errors[name]:.1f}',
        _ms(result['repriced']),
        f'{_error(result, "repriced"):.1f}' if result['repriced'] else '-',
        f'{1e3 * result["replayed"]["per_iteration"]:.2f}',
        f'{_error(result, "replayed"):.1f}',
        f'{result["slowdown"]:.2f}',
        f'{result["load"]:.1f}',
        _lanes(result['measured']['utilization']),
        _lanes(result['predicted']['utilization']),
      )
    )
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
  print(
    f'ms/it: median over blocks of {BLOCK} iterations of the steady state (mean: over all '
    'of it); measured: the run of median ms/it among the measured runs (each listed, in '
    'the order run); error: |predicted - measured| / measured of the median'
  )
  print(
    'repriced: the virtual clock with each task kind costing its median duration in '
    "the family's warm-up run on the lanes (another run, before the measured one)"
  )
  print(
    'replayed: the virtual clock again, with each task kind costing its median duration '
    'in the measured run (the schedule model alone, without the profile); task slowdown: '
    'median over task kinds of its measured duration / its profiled cost; load: the '
    '1-minute load average during the measured run (the larger of its start and end)'
  )
  staleness = [n for n in results if n in ASYNCHRONOUS and 'skipped' not in results[n]]
  if staleness:
    print('staleness histogram {staleness: updates}, ' + ' | '.join(SIDES) + ':')
    for name in staleness:
      cells = (
        _histogram(results[name][s]['staleness']) if results[name][s] else '-' for s in SIDES
      )
      print(f'  {LABELS[name]}: ' + ' | '.join(cells))
  pushing = [n for n in staleness if n in ('asgd', 'dcasgd')]
  if pushing:
    print(
      "a backward's end -> its push's copy starts, ms median / mean (the process executor's "
      'driver sends it once it has heard of that end), ' + ' | '.join(SIDES) + ':'
    )
    for name in pushing:
      cells = (_delays(results[name][s]) for s in SIDES)
      print(f'  {LABELS[name]}: ' + ' | '.join(cells))
  heard = [n for n in results if 'skipped' not in results[n]]
  if heard:
    print(
      "a task's end -> the driver hears of it, ms median / mean, " + ' | '.join(SIDES) + ';'
      " the simulated driver's ms per event + ms per message (cost.driver, "
      'cost.driver_latency), ' + ' | '.join(SIDES[1:]) + ':'
    )
    for name in heard:
      cells = (_delays(results[name][s], 'hear_delays') for s in SIDES)
      used = (
        '{:.2f} + {:.2f}'.format(*(1e3 * x for x in results[name]['driver'].get(s, (0, 0))))
        for s in SIDES[1:]
      )
      print(f'  {LABELS[name]}: ' + ' | '.join(cells) + '; ' + ' | '.join(used))
  undriven = [n for n in errors if results[n].get('replayed_no_driver')]
  if undriven:
    print(
      'replayed without the simulated driver (cost.driver=cost.driver_latency=0), ms/it '
      'and error %: '
      + '; '.join(
        f'{LABELS[n]} {_ms(results[n]["replayed_no_driver"])} '
        f'({_error(results[n], "replayed_no_driver"):.1f})'
        for n in undriven
      )
    )
  for note in notes:
    print(note)
  if errors:
    worst = max(errors, key=errors.get)
    replayed = max(_error(results[n], 'replayed') for n in errors)
    if undriven:
      undriven_worst = max(_error(results[n], 'replayed_no_driver') for n in undriven)
      print(
        f'replayed without the simulated driver, max error across families: {undriven_worst:.1f}%'
      )
    repriced = [_error(results[n], 'repriced') for n in errors if results[n]['repriced']]
    if repriced:
      print(
        'with lane costs from a warm-up run of the same family (repriced), '
        f'max error across families: {max(repriced):.1f}%'
      )
    print(
      f'(largest: {LABELS[worst]}; median over families {np.median(list(errors.values())):.1f} %; '
      f'replayed, largest {replayed:.1f} %)'
    )
    print(f'simulator max error across families: {errors[worst]:.1f}%')
  else:
    print('simulator max error across families: n/a (no family ran)')


def _delays(stats: dict | None, which: str = 'send_delays') -> str:
  delays = (stats or {}).get(which)
  if not delays:
    return '-'
  ms = lambda seconds: round(1e3 * float(seconds), 2) + 0.0  # (no '-0.00' from rounding)
  return f'{ms(np.median(delays)):.2f} / {ms(np.mean(delays)):.2f}'


def _lanes(utilization: dict) -> str:
  return ' '.join(f'{lane} {value:.2f}' for lane, value in utilization.items())


def _histogram(histogram: dict) -> str:
  return (
    '{'
    + ', '.join(f'{k}: {v}' for k, v in sorted(histogram.items(), key=lambda x: int(x[0])))
    + '}'
  )


if __name__ == '__main__':
  main()
