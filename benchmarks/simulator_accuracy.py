r"""The simulator's error: each scheduler family on lane processes and on the virtual clock.

    python -m benchmarks.simulator_accuracy                 # every family, tasks of 30-300 ms
    python -m benchmarks.simulator_accuracy --hidden=512 --batch=256 --steps=60 --warmup=10
                                                            # small tasks (1-5 ms)
    python -m benchmarks.simulator_accuracy --steps=40 --families=ddg,asgd
    python -m benchmarks.simulator_accuracy --profile=/tmp/acc.json --host=/tmp/host.json
                                                            # reuse both profiles
    python -m benchmarks.simulator_accuracy --lanes=8 --depth=8 --batch=512 --repeats=1
                                                            # K=8 lanes (16 cores)

`--lanes=K` (2 by default) gives every family K lanes on cores 0..K-1
(`benchmarks.common.family_lanes`): K stages, K workers beside the server, PD-ASGD
1:(K-1), K LPP-SGD replicas; `--depth` the hidden layers (K stages need K-1). Each family
runs the same config on both clocks, through `experiments.train`'s own path
(`training.train_and_evaluate`):
  measured   `clock='real', executor='processes'`: every lane an OS process pinned to
             its core, the run's trace as the lanes timed it; `--repeats` runs (3), the
             one of median time per iteration taken (each run's time is printed);
  predicted  `clock='virtual'` with the same `placement.lanes`, `cost.profile` = a cost
             profile of the families' tasks and `cost.host` = a host profile of the
             process executor, both measured at the start: each task costs the cost
             profile's figure, and the virtual clock simulates the executor's host as
             `jaxsgd.scheduler.host` says (run-ahead schedule, simulated driver, copies
             on the sender, a copy's time on both ends' cores, lanes on one core
             time-sliced, the host's links; its `_loaded` figures where the K lanes
             take every core of the host);
  repriced   the predicted run with each task kind costing its mean duration in the
             family's warm-up run on the lanes (another run, before the measured one),
             as `experiments.reprice` prices a pilot run;
  replayed   the predicted run with each task kind costing its mean duration in the
             measured run: the schedule and host model alone, without the cost profile.
             The mean, since a run's time is its tasks' sum and their durations often
             lean right (DC-ASGD's server updates: mean 1.2-1.35x the median), and the
             virtual clock's noise keeps a price's mean; at the median the replay was
             fast by that.
             Both on lanes placed on no core: a lane's own durations already hold what
             sharing its core cost it (a neighbour's tasks, the copies it read and sent);
             its copies then take no core either, so a copy slowed by a busy core is
             not (the replay is that much fast).
The replayed run is run once more with the host profile's driver figures at 0 (a second
host file), so that what the simulated driver adds is seen against the same measured run.
And the predicted run once more with each task kind costing its mean CPU time in the
measured run (the lanes time their process's CPU over each task, `TaskRecord.cpu`), its
lanes on their cores as predicted (cpu-replayed): the profile prices CPU time, so
predicted against it is what the tasks' work cost more or less in the run, and it
against measured is what the model of the rest misses (the cores' other work: another
lane, the driver, Ray, the copies). A task's CPU leaves out what its lane's copy threads
used meanwhile (`CopyCpu`), which the virtual clock charges apart as links and take-ins.

The cost profile (`--profile` reuses one) describes tasks as they run on lanes: it is
measured in a process pinned to core 0 with XLA's intra-op threads off
(`--xla_cpu_multi_thread_eigen=false`, one OpenMP thread), as a lane runs, every task of
every asked family's table (`experiments.profile`) timed by its CPU time, the median of
`--reps` interleaved calls: the figure the virtual clock prices a task at; by default
with cores 1..K-1 computing meanwhile (`--neighbours=busy`, `experiments.profile
--busy_cores=K-1`), as the other lanes keep them in the runs: a core computes slower
beside busy neighbours (shared cache and memory bus, a lower all-core clock). The host
profile (`--host` reuses one of the process executor) is what
`python -m experiments.profile --host=processes` writes (`measure_host`), measured here
on the Ray cluster the runs use, before them.

Per family: time per iteration (an iteration is one applied update of the whole model:
a batch whose every stage has updated, or one server update), from the end of iteration
`--warmup`, or of each lane's first task of each kind if later (a lane compiles a task on
first use: `window`), to the end of the last one;
utilization of each compute lane over the same window; and for the asynchronous methods
the staleness histogram of every applied update. Error = |predicted - measured| /
measured of the time per iteration; the last line is the largest over the families that
ran. Before it, one table per family: each lane's task kinds, their priced cost against
their durations in the measured run's steady state (median, mean, p10, p90, median /
priced).
The model is an MLP on MNIST-1D (40-1024-1024-1024-1024-10, batch 1024: tasks of
30-300 ms), so that a task is well above what the process executor's host spends on it
(the host profile's figures, printed at the start: about 1 ms per task where the lanes
take every core); with `--hidden=512 --batch=256` the tasks take 1-5 ms, that host time
is of their size, and the error measures mostly it. The machine's load
average is printed: other jobs take cores from the lanes, which the simulator cannot
know. Results: benchmarks/results/simulator_history.md.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxsgd.errors import Preempted

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


# What a lane process on one core runs with (`lanes.placement.LaneSpec.environment`), its
# XLA_FLAGS after the driver's (`lanes.cluster.lane_xla_flags`, `measure_profile`).
LANE_ENV = {
  'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false',
  'OMP_NUM_THREADS': '1',
  'MKL_NUM_THREADS': '1',
  'OPENBLAS_NUM_THREADS': '1',
}


# LPP-SGD averages once every `averaging_freq` updates of each replica, and an averaging
# lane's first rounds in a fresh process pay what its later ones do not (the mean's
# first call traced and loaded from the compilation cache, its buffers' first pages):
# 148, 62 and 57 ms against ~1.7 ms in a trace of 2x1. Its runs are twice `--steps`, so
# that the window, which begins after the averaging lane's first round (`window`), still
# holds several rounds.
STEPS_FACTOR = {'lppsgd': 2}


def family_config(
  name: str,
  args,
  side: str,
  profile: str | None = None,
  host: str | None = None,
  on_cores: bool = True,
):
  """The config of family `name` for `side`: 'measured' (lane processes), 'predicted'
  (the virtual clock with the cost profile `profile` and the host profile `host`; the
  host's links unless `--link_latency` gives others) or 'tables' (what the cost profile
  measures). `on_cores`: each lane placed on its core (`benchmarks.common.family_lanes`),
  else the same lanes on none (a virtual run priced by the lanes' own durations, which
  hold what sharing a core cost them: the placed model would charge that again)."""
  import ml_collections

  from benchmarks import common as bench_common  # (imports JAX: not at the module's top)
  from experiments.configs import default

  config = default.get_config()
  config.dataset = 'mnist1d/5k'
  config.model = ml_collections.ConfigDict({'name': 'mlp', 'hidden': (args.hidden,) * args.depth})
  config.batch_size = args.batch
  config.train_steps = args.steps * STEPS_FACTOR.get(name, 1)
  config.eval_every = config.train_steps
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
  place = bench_common.family_lanes if on_cores else bench_common.unplaced_lanes
  config.placement.lanes = '; '.join(place(name, args.lanes))
  if side == 'measured':
    config.clock, config.executor = 'real', 'processes'
  else:
    config.clock = 'virtual'
  if side == 'predicted':
    config.cost.profile = profile
    config.cost.host = host
    if args.link_latency is not None:
      config.cost.link_latency = args.link_latency
      config.cost.link_bandwidth = args.link_bandwidth
  return config


# --- the cost profile: measured in a process set up as a lane ----------------------------------
def measure_profile(path: str, args) -> None:
  """Runs this module in a process pinned to core 0 with the lanes' flags; it writes the
  tables the asked families need to `path` (`_write_tables`): a profile reused with
  `--profile` must hold the tables of these families at this `--lanes`, `--depth`,
  `--hidden` and `--batch` (else `ProfileError` names what does not fit)."""
  from jaxsgd.scheduler.lanes import cluster

  env = {**os.environ, **LANE_ENV}
  env['XLA_FLAGS'] = cluster.lane_xla_flags(os.environ.get('XLA_FLAGS', ''), LANE_ENV)
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
  """In the profile's own process: sets its allocator as a lane's, pins it to core 0,
  busies cores 1..K-1 if asked (`--neighbours=busy`), and writes the profile of
  `_measured_tables` to `path`."""
  from jaxsgd import allocator
  from jaxsgd.scheduler import profiles, task_timing

  allocator.keep_freed_memory()  # as a lane's: a task's outputs in memory used before
  task_timing.pin_to_core(0)  # before JAX's first computation
  with contextlib.ExitStack() as neighbours:
    if args.neighbours == 'busy':  # the lanes' other cores compute, as in the runs
      neighbours.enter_context(task_timing.BusyNeighbours(range(1, args.lanes)))
    profiles.save(_measured_tables(args), path)


def _measured_tables(args):
  """One profile of the tables of the asked families (`TABLE_OF`: DDG and PD-ASGD read
  BP's), their tasks measured together, interleaved, through `experiments.profile` (the
  host's figures are the host profile's: none here)."""
  from experiments import profile as profile_command
  from jaxsgd import data as data_lib
  from jaxsgd.scheduler import profile_lookup, profiles, task_timing
  from jaxsgd.training.loop import build_model

  prepared = []
  families = set(args.families.split(','))
  for name in [m for m in MEASURED if m in {TABLE_OF.get(f, f) for f in families}]:
    config = family_config(name, args, 'tables')
    dataset = data_lib.load(config.dataset, config.get('data_dir'))
    model = build_model(config, dataset)

    def batch_for(size, dataset=dataset, config=config):
      return next(dataset.train_batches(size, seed=config.seed))

    prepared.append((config, model, profile_command.table_calls(config, model, batch_for)))
  tables = profile_command.measure_tables(
    [entry for _, _, entry in prepared], warmup=3, reps=args.reps, clock='cpu'
  )
  merged = None
  for (config, model, entry), table in zip(prepared, tables):
    profile = task_timing.make_profile(
      model,
      entry.batch_size,
      profile_lookup.optimizer_id(dict(config.optimizer)),
      [table],
      warmup=3,
      reps=args.reps,
      clock='cpu',
      pinned=True,
      busy_cores=args.lanes - 1 if args.neighbours == 'busy' else 0,
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


def task_cpu(workdir: str) -> dict:
  """`{(lane, start): CPU seconds}` of the run's tasks whose lane timed its process's CPU
  (`TaskRecord.cpu`: the process executor's), keyed as `read_trace`'s tasks."""
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  return {
    (e['tid'], e['ts'] / 1e6): e['args']['cpu'] / 1e6
    for e in events
    if e.get('ph') == 'X' and 'cpu' in e.get('args', {})
  }


def iteration_ends(tasks, per_task: bool = False) -> list[float]:
  """When each iteration ended: per batch, the last end of its update tasks, for the
  batches every updating lane updated (`bench_common.update_ends`: a DDG pipeline's
  last K-1 batches, updated by fewer stages, end in stage 0's last iteration); without
  update tasks (updates applied in the driver), its backward tasks. `per_task`
  (`ONE_UPDATE_PER_TASK`): every such task ends an iteration of its own."""
  for kind in ('update', 'backward'):
    found = [
      (lane, batch, end)
      for lane, task_kind, _, end, batch, _ in tasks
      if task_kind == kind and batch is not None
    ]
    if found and per_task:
      return sorted(end for *_, end in found)
    if found:
      from benchmarks import common as bench_common  # (imports JAX: not at the module's top)

      ends = bench_common.update_ends(found)
      return [ends[b] for b in sorted(ends)]
  raise ValueError('the trace has no update or backward tasks')


# Families whose every update (or, with updates applied in the driver, every backward) is
# an iteration: an LPP-SGD worker updates its replica alone, and numbers its batches
# itself, so that grouping tasks by batch made one iteration of two workers' updates on
# the virtual clock (no update tasks there) and of one on the lanes.
ONE_UPDATE_PER_TASK = ('lppsgd',)


def _family_of(workdir: str) -> str:
  """The family of the run at `workdir` (`<family>-<side>...`)."""
  return os.path.basename(workdir).split('-')[0]


def _per_task(workdir: str) -> bool:
  """Whether the run at `workdir` counts an iteration per task."""
  return _family_of(workdir) in ONE_UPDATE_PER_TASK


# Families whose every update is an iteration, one of each worker a round: their time
# per iteration is the median over blocks of whole rounds (`block_for`). A parameter
# server's M workers of equal costs push in bursts on the virtual clock as LPP-SGD's
# replicas update: ASGD M=2's updates came 12.5 and 46.9 ms apart by turns, so blocks of
# 5 spanned 131 or 166 ms alternately and their median read 26.2 ms per iteration where
# the run took 29.7.
IN_ROUNDS = ('asgd', 'dcasgd', 'lppsgd')


def in_rounds(workdir: str) -> bool:
  """Whether the run at `workdir` is measured over whole rounds."""
  return _family_of(workdir) in IN_ROUNDS


# Kinds of task that a lane runs every iteration (not an averaging lane's rounds).
ITERATION_KINDS = frozenset({'forward', 'backward', 'update', 'step'})


def window(
  names, tasks, warmup: int, per_task: bool = False, iterations: int | None = None
) -> tuple[float, float, int]:
  """`(start, stop, iterations)` of the steady state: from the end of the first
  iteration after `iterations` iterations (default `warmup`), the first `warmup` tasks
  of every lane that runs more and does per-iteration work (`ITERATION_KINDS`), and the
  first task of each kind and stage on each such lane (a lane compiles a task on first
  use, which the virtual clock does not price: a worker still compiling while the
  others run would make the start look unlike the rest, and LPP-SGD's first merges,
  each compiled on its worker's lane, came one averaging round late), to the end of the
  last. Every lane's first task of each kind counts, LPP-SGD's all-reduce lane's first
  average too (its first rounds took 33-87x the later ones' 1.7 ms)."""
  ends = sorted(iteration_ends(tasks, per_task))
  per_lane, kinds, first_use = {}, {}, {}
  for lane, kind, _, end, _, stage in tasks:
    if not names[lane].startswith('link '):
      per_lane.setdefault(lane, []).append(end)
      kinds.setdefault(lane, set()).add(kind)
      first_use[lane, kind, stage] = min(end, first_use.get((lane, kind, stage), end))
  warming = {
    lane for lane, e in per_lane.items() if len(e) > warmup and kinds[lane] & ITERATION_KINDS
  }
  why = {sorted(per_lane[lane])[warmup - 1]: f'{names[lane]}: task {warmup}' for lane in warming}
  for (lane, kind, stage), end in first_use.items():
    why[end] = f'{names[lane]}: its first {kind} (stage {stage})'
  left_out = warmup if iterations is None else iterations
  why[ends[min(left_out, len(ends) - 2)]] = f'iteration {left_out}'
  warm = max(why)
  after = [e for e in ends if e >= warm]
  if len(after) < 2:
    raise ValueError(
      f'fewer than 2 iterations after the warm-up (ended by {why[warm]}); run more than {len(ends)}'
    )
  return after[0], after[-1], len(after) - 1


# Iterations per block: the time per iteration is the median over blocks of this many.
BLOCK = 5


def block_for(workers: int, family: str = '') -> int:
  """Iterations per block where every update is an iteration (`IN_ROUNDS`): the
  fewest whole rounds (one update of each of `workers` workers) of at least `BLOCK`.
  Workers of equal costs end their updates together on the virtual clock, so a block that
  is not whole rounds measures where the blocks begin in the round: LPP-SGD 2×1's blocks
  of 5 updates spanned two rounds or three less a burst, alternately (0.0259 s per
  iteration where its rounds took 0.0278 per update; 8×1 and 16×1, whose blocks were a
  round, were not off).

  LPP-SGD's blocks are at least an averaging period (`averaging_freq` rounds: each
  replica joins a round after that many updates), so that every block holds its share
  of merges: blocks of one round held a replica's merge or not, 6.9-9.8 ms per update at
  8×1, and their median moved by 3.5 % between two virtual runs of the same tasks (one
  figure of the host profile changed) while the means agreed to 0.5 %."""
  rounds = math.ceil(BLOCK / workers)
  if family == 'lppsgd':
    rounds = max(rounds, lpp_averaging_freq())
  return workers * rounds


def lpp_averaging_freq() -> int:
  """A replica's updates between two of its averaging rounds, as the configs here leave
  it (`algorithm.averaging_freq`; imported here: JAX starts after this module's flags)."""
  from jaxsgd.algorithms import lppsgd

  return lppsgd.Settings.averaging_freq


def blocks_median(ends: list[float], block: int) -> float | None:
  """The median over consecutive blocks of `block` iterations (`ends`: when each ended,
  sorted) of the seconds per iteration; None if there is not one block."""
  blocks = [(ends[i + block] - ends[i]) / block for i in range(0, len(ends) - block, block)]
  return float(np.median(blocks)) if blocks else None


def window_stats(workdir: str, warmup: int, left_out: int | None = None) -> dict:
  """Seconds per iteration in the steady state (`window`, leaving out `left_out`
  iterations, default `warmup`): the median over blocks of `BLOCK` iterations (of whole
  rounds for `IN_ROUNDS`; a burst of other jobs' load slows some blocks; the median is the
  time the run takes when they leave it alone), and the mean; each compute lane's
  utilization over the window."""
  names, tasks = read_trace(workdir)
  per_task = _per_task(workdir)
  from benchmarks import common as bench_common  # (imports JAX: not at the module's top)

  start, stop, iterations = window(names, tasks, warmup, per_task, left_out)
  busy = {}
  for lane, _, begin, end, _, _ in tasks:
    name = names[lane]
    if name.startswith('link '):
      continue
    key = _short(name)
    busy[key] = busy.get(key, 0.0) + bench_common.overlap(begin, end, start, stop)
  utilization = {lane: seconds / (stop - start) for lane, seconds in sorted(busy.items())}
  ends = [e for e in sorted(iteration_ends(tasks, per_task)) if start <= e <= stop]
  workers = len({lane for lane, kind, *_ in tasks if kind == 'backward'})
  block = block_for(workers, _family_of(workdir)) if in_rounds(workdir) else BLOCK
  median = blocks_median(ends, block)
  # The tasks of the window, not those of the end of the run: there the driver stops
  # listening, and the tasks still queued end unheard until the pool closes.
  steady = [
    (lane, kind, b, e, batch) for lane, kind, b, e, batch, _ in tasks if b >= start and e <= stop
  ]
  return {
    'per_iteration': (stop - start) / iterations if median is None else median,
    'mean_per_iteration': (stop - start) / iterations,
    'utilization': utilization,
    'iterations': iterations,
    'steady': (start, stop),  # the window's bounds, s
    # A backward's end -> its lane's copy of that batch (an ASGD worker's push), s.
    'send_delays': bench_common.send_delays(names, steady),
    # A compute task's end -> the driver hearing of it, s (`TaskRecord.heard`).
    'hear_delays': hear_delays(workdir, start, stop),
    'hear_delays_at_once': hear_delays(workdir, start, stop, at_once=True),
  }


def hear_delays(
  workdir: str, since: float, until: float = math.inf, at_once: bool = False
) -> list[float]:
  """Seconds from the end of each compute task that started at `since` or later and
  ended by `until` to its run's driver hearing of it (the trace's 'heard': the process
  executor's, or the virtual clock's simulated driver; none without one). `at_once`:
  only the ends whose lane's next task was dispatched after them, which the lane sent as
  they came (a lane holds the end of a task run ahead while two calls are queued behind it;
  a proxy: an end held behind a queued call that is not a task is kept, one sent at
  once while a task was queued — hastened, waited for, or with one call behind it — is
  left out)."""
  import types

  from jaxsgd.scheduler.lane_timing import sent_at_once

  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  lanes: dict[tuple, list] = {}  # a trace row (a lane) -> its tasks, in order
  for e in sorted(
    (e for e in events if e.get('ph') == 'X' and 'heard' in e['args']), key=lambda e: e['ts']
  ):
    dispatched = e['args'].get('dispatched')
    lanes.setdefault((e.get('pid', 0), e.get('tid', 0)), []).append(
      types.SimpleNamespace(
        start=e['ts'] / 1e6,
        end=(e['ts'] + e['dur']) / 1e6,
        heard=e['args']['heard'] / 1e6,
        dispatched=None if dispatched is None else dispatched / 1e6,
      )
    )
  return [
    task.heard - task.end
    for chain in lanes.values()
    for task in (sent_at_once(chain) if at_once else chain)
    if since <= task.start and task.end <= until
  ]


def _short(name: str) -> str:
  from jaxsgd.scheduler.placement import lane_name

  return lane_name(name)


def task_figures(workdir: str, warmup: int, figure: str = 'duration') -> dict:
  """`{(stage, kind): seconds}` of the compute tasks of the run's steady state, each
  kind's mean duration (a run's time is its tasks' sum; as `experiments.reprice`), or
  with `figure='cpu'` the mean CPU time its lane's process used over them (`task_cpu`)."""
  if figure not in ('duration', 'cpu'):
    raise ValueError(f"figure: 'duration' or 'cpu', got {figure!r}")
  names, tasks = read_trace(workdir)
  start, _, _ = window(names, tasks, warmup, _per_task(workdir))
  cpu_of = task_cpu(workdir) if figure == 'cpu' else {}
  durations = {}
  for lane, kind, begin, end, _, stage in tasks:
    if begin >= start and not names[lane].startswith('link '):
      seconds = end - begin if figure == 'duration' else cpu_of.get((lane, begin))
      if seconds is not None:
        durations.setdefault((stage, kind), []).append(seconds)
  return {key: float(np.mean(d)) for key, d in durations.items()}


def observed_profile(profile: str, workdir: str, warmup: int) -> str:
  """A copy of `profile` whose task costs are each task kind's mean duration in the run
  at `workdir` (steady state), as the lanes timed them.

  Priced so, on lanes placed on no core, what the virtual clock predicts differs from
  the measured run only by what the schedule model leaves out or gets wrong (dispatch,
  links, the order of tasks on a shared core), not by how much longer tasks took under
  the machine's load (`cpu_replay` prices the tasks' CPU time instead).
  """
  path = os.path.join(workdir, 'observed_duration_profile.json')
  return priced_profile(profile, task_figures(workdir, warmup), path)


def priced_profile(profile: str, figures: dict, path: str) -> str:
  """Writes to `path` a copy of `profile` whose task kinds in `figures` (`task_figures`)
  cost their figure, and returns `path`."""
  import dataclasses

  from jaxsgd.scheduler import profiles, repricing

  loaded = profiles.load(profile)
  # One figure per task kind: the cost and its spread alike.
  timed = {key: [seconds] for key, seconds in figures.items()}
  tables = tuple(repricing.repriced_table(t, timed) for t in loaded.tables)
  profiles.save(dataclasses.replace(loaded, tables=tables), path)
  return path


def task_costs(workdir: str, warmup: int, priced_ms: dict) -> list[dict]:
  """Each compute lane's task kinds in the run at `workdir`, over its steady state
  (`window`: the tasks that start and end inside it): their priced cost (`priced_ms`, the
  virtual clock's table as a run's summary writes it, `'stage K kind'` -> ms; None where
  it has none), the median, mean, p10 and p90 of their durations, and the median CPU time
  of the lane's process over them (`cpu`; None if the lanes did not time it), in seconds."""
  names, tasks = read_trace(workdir)
  start, stop, _ = window(names, tasks, warmup, _per_task(workdir))
  cpu_of = task_cpu(workdir)
  durations, cpu = {}, {}
  for lane, kind, begin, end, _, stage in tasks:
    if start <= begin and end <= stop and not names[lane].startswith('link '):
      key = (_short(names[lane]), stage, kind)
      durations.setdefault(key, []).append(end - begin)
      if (lane, begin) in cpu_of:
        cpu.setdefault(key, []).append(cpu_of[(lane, begin)])
  order = {kind: i for i, kind in enumerate(('forward', 'backward', 'update'))}
  rows = []
  for (lane, stage, kind), seconds in sorted(
    durations.items(),
    key=lambda item: (item[0][0], str(item[0][1]), order.get(item[0][2], 3), item[0][2]),
  ):
    priced = priced_ms.get(f'stage {stage} {kind}')
    p10, median, p90 = np.percentile(seconds, (10, 50, 90))
    used = cpu.get((lane, stage, kind))
    rows.append(
      {
        'lane': lane,
        'task': kind if stage is None else f'{stage}/{kind}',
        'tasks': len(seconds),
        'priced': None if priced is None else priced / 1e3,
        'median': float(median),
        'mean': float(np.mean(seconds)),
        'p10': float(p10),
        'p90': float(p90),
        'cpu': float(np.median(used)) if used else None,
      }
    )
  return rows


def slowdown(rows: list[dict], figure: str = 'median') -> float:
  """Median over the lanes' task kinds (`task_costs`) of their measured `figure`
  ('median' duration, or 'cpu': the median CPU time of the lane's process) / their priced
  cost: how much longer the lanes took for the same work than the cost profile says (1
  where they run as it was measured; other jobs' load raises the duration, not the CPU)."""
  ratios = [row[figure] / row['priced'] for row in rows if row['priced'] and row.get(figure)]
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
  """A run whose lanes did not all get past `--warmup`, or their first task of each kind,
  with two iterations left (`window_stats`)."""


def steady_stats(workdir: str, warmup: int, left_out: int | None = None) -> dict:
  """`window_stats` (`left_out`: `window`'s `iterations`), raising `NoSteadyState` where it
  finds no steady state."""
  try:
    return window_stats(workdir, warmup, left_out)
  except ValueError as error:
    raise NoSteadyState(str(error)) from error


def measured_runs(config, workdir: str, args) -> tuple[dict, dict, list, float]:
  """`--repeats` runs on the lanes, one after another: `(stats, summary)` of the one of
  median time per iteration — the family's measured run, kept at `workdir`, where the
  replayed run and the task-cost table read its tasks — every run's seconds per
  iteration in order, and the largest load average seen. One run against the next can
  move by more than the errors to be measured: the error is taken against the median."""
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


def run_family(name: str, args, profile: str, hosts: dict, root: str) -> dict:
  """Every run of family `name`: their statistics, or why one could not run. `hosts`:
  the host profile of the virtual runs (`'host'`) and the same without a driver
  (`'no_driver'`, for the replay run again)."""
  from jaxsgd import training

  result, priced_by = {}, {}
  for side in SIDES:
    given = priced_by[side] = profile
    lanes_run = {  # the lanes' run whose task durations price the virtual run
      'replayed': f'{name}-measured',  # the schedule alone: the run's own times
      'repriced': f'{name}-measured-warm',  # another run's, as a pilot's
    }.get(side)
    if lanes_run is not None:
      try:
        given = priced_by[side] = observed_profile(
          profile, os.path.join(root, lanes_run), args.warmup
        )
      except ValueError:  # no steady state in the warm-up run
        if side != 'repriced':
          raise
        result[side] = None
        continue
    config = family_config(
      name,
      args,
      'measured' if side == 'measured' else 'predicted',
      given,
      hosts['host'],
      on_cores=lanes_run is None,  # priced by the lanes' durations: on no core
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
    except Preempted:  # SIGTERM: the benchmark stops, not only this row
      raise
    except Exception as error:  # noqa: BLE001 - reported, the other families go on
      line = ' '.join(str(error).split())[:160]
      if side == 'measured' and name in ('pdasgd', 'lppsgd'):
        return {'skipped': f'not on processes yet ({type(error).__name__}: {line})'}
      return {'skipped': f'{side} run failed ({type(error).__name__}: {line})'}
    stats['staleness'] = summary.get('staleness_histogram', {})
    result[side] = stats
    if side == 'predicted':  # the priced costs against the measured run's durations
      measured = os.path.join(root, f'{name}-measured')
      result['task_costs'] = task_costs(measured, args.warmup, summary.get('cost_model_ms', {}))
      result['slowdown'] = slowdown(result['task_costs'])
      result['cpu_slowdown'] = slowdown(result['task_costs'], 'cpu')
  # What the simulated driver adds: the replay again, with a host whose driver costs 0.
  config = family_config(
    name, args, 'predicted', priced_by['replayed'], hosts['no_driver'], on_cores=False
  )
  workdir = os.path.join(root, f'{name}-replayed-no-driver')
  training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
  try:
    result['replayed_no_driver'] = steady_stats(workdir, args.warmup)
  except NoSteadyState:
    result['replayed_no_driver'] = None
  result['cpu_replayed'] = cpu_replay(name, args, profile, hosts, root)
  return result


def cpu_replay(name: str, args, profile: str, hosts: dict, root: str) -> dict | None:
  """The predicted run again with each task kind costing its mean CPU time in the
  measured run (`TaskRecord.cpu`; a kind the lanes did not time keeps the profile's
  price), its lanes on their cores as predicted: against the profile, what the tasks'
  work cost in the run; against the measured run, what the model of the rest (the cores'
  other work, the driver, the copies) misses. The CPU is the lane process's less what its
  copy threads used meanwhile (`CopyCpu`: the virtual clock charges the copies apart).
  None where the lanes timed no CPU or the run failed (its error printed: the other
  families go on)."""
  from jaxsgd import training

  measured = os.path.join(root, f'{name}-measured')
  figures = task_figures(measured, args.warmup, 'cpu')
  if not figures:
    return None
  priced = priced_profile(profile, figures, os.path.join(measured, 'observed_cpu_profile.json'))
  config = family_config(name, args, 'predicted', priced, hosts['host'], on_cores=True)
  workdir = os.path.join(root, f'{name}-cpu-replayed')
  try:
    training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
    return steady_stats(workdir, args.warmup)
  except NoSteadyState:
    return None
  except Exception as error:  # noqa: BLE001 - reported, the other families go on
    print(f'{LABELS[name]}: cpu-replayed run failed ({type(error).__name__}: {error})')
    return None


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
    '--neighbours',
    default='busy',
    choices=('idle', 'busy'),
    help='cores 1..K-1 while the profile is measured on core 0: idle, or busy with matrix '
    'products (`task_timing.BusyNeighbours`), as the lanes keep them in the runs',
  )
  parser.add_argument('--profile', default=None, help='a cost profile to use (default: measure)')
  parser.add_argument(
    '--profile_each',
    action='store_true',
    help='price each family by its tables measured again just before its runs, as at the '
    'start (how much of the error is the machine drifting between the profile and a run)',
  )
  parser.add_argument(
    '--host',
    default=None,
    help='a host profile of the process executor to use (cost.host; default: measure one, '
    'as python -m experiments.profile --host=processes does)',
  )
  parser.add_argument(
    '--link_latency', type=float, default=None, help="s (default: the host profile's links)"
  )
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
  if args.profile_each and args.profile:
    parser.error("--profile_each: measures each family's tables here; not with --profile")
  if (args.link_latency is None) != (args.link_bandwidth is None):
    parser.error('--link_latency and --link_bandwidth: give both, or neither')
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
    f'{args.steps} iterations per run (LPP-SGD {args.steps * STEPS_FACTOR["lppsgd"]}), the first {args.warmup} left out',
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

  from experiments import profile as profile_command
  from jaxsgd.scheduler import host as host_lib
  from jaxsgd.scheduler import profiles
  from jaxsgd.scheduler.lanes import cluster

  host = None
  if args.host is not None:  # (JAX imported after the cache's settings above)
    try:
      host = host_lib.load(args.host)
    except host_lib.HostProfileError as error:
      parser.error(str(error))
    if host.executor != 'processes':
      parser.error(
        f'--host: a host profile of the process executor; {args.host} is of {host.executor!r}'
      )
  profile = args.profile
  if profile is None:
    profile = os.path.join(root, 'profile.json')
    measure_profile(profile, args)
  cluster.connect(None)  # one Ray cluster for every run (each run starts its own lanes)
  try:
    loaded = profiles.load(profile)
    measured_how = 'a profile given' if args.profile else _neighbours_label(args)
    if args.profile_each:
      measured_how += '; each family priced by its tables measured again before its runs'
    print(
      f'cost profile: {profile} ({loaded.date}, pinned to core 0, lane flags, '
      f'{measured_how}; each task the {loaded.statistic} of {loaded.reps} '
      f'{loaded.clock}-timed calls)',
      flush=True,
    )
    hosts = {'host': args.host}
    if host is None:  # measured on this cluster, as `experiments.profile --host` does
      wait_for_quiet(args.max_load, args.max_wait)
      host = profile_command.measure_host('processes')
      hosts['host'] = os.path.join(root, 'host.json')
      host_lib.save(host, hosts['host'])
    hosts['no_driver'] = os.path.join(root, 'host_no_driver.json')
    host_lib.save(without_driver(host), hosts['no_driver'])
    print(_host_line(hosts['host'], host, args), flush=True)
    results = {}
    for name in families:
      priced_by = profile
      if args.profile_each:  # the family's tables measured again, just before its runs
        priced_by = os.path.join(root, f'profile_{name}.json')
        measure_profile(priced_by, argparse.Namespace(**{**vars(args), 'families': name}))
      results[name] = run_family(name, args, priced_by, hosts, root)
      with open(os.path.join(root, 'results.json'), 'w') as f:
        json.dump(results, f)
      print(f'  {LABELS[name]}: {_one_line(results[name])}', flush=True)
  finally:
    cluster.shutdown()
  if args.profile is None:  # how far the tasks' prices moved meanwhile
    again = os.path.join(root, 'profile_at_end.json')
    try:
      measure_profile(again, args)
      print(drift_line(profiles.load(profile), profiles.load(again)), flush=True)
    except (subprocess.CalledProcessError, profiles.ProfileError) as error:
      print(f'task costs at the end against the start: not measured ({error})', flush=True)
  print(
    f'load average {"/".join(f"{x:.1f}" for x in os.getloadavg())} at end; '
    f'jax {jax.__version__}; {time.time() - started:.0f} s'
  )
  print_table(results)


def drift_line(first, second) -> str:
  """How much each task's price moved between two profiles measured alike, at the
  benchmark's start and at its end (one pair of measurements: the machine's speed moving
  and a profile's own spread between two measurements, together). The runs are priced
  by the first; a prediction can be no closer than the tasks' own speed holds still.
  Tables are paired by their stage split and task set."""
  later = {(table.split, table.tasks): table for table in second.tables}
  moved = []
  for before in first.tables:
    after = later.get((before.split, before.tasks))
    if after is None:
      continue
    moved += [
      after.costs[key] / cost - 1.0
      for key, cost in before.costs.items()
      if key in after.costs and cost > 0
    ]
  if not moved:
    return 'task costs at the end against the start: no task in both profiles'
  return (
    f'task costs at the end against the start ({len(moved)} tasks, the profile measured '
    f'again): median change {100 * statistics.median([abs(x) for x in moved]):.1f} % either '
    f'way, largest {100 * max(moved, key=abs):+.1f} %, mean {100 * statistics.mean(moved):+.1f} %'
  )


def without_driver(host):
  """`host` with its driver's figures (idle and loaded) at 0: no simulated driver."""
  import dataclasses

  figures = tuple((k, 0.0 if k.startswith('driver') else v) for k, v in host.figures)
  return dataclasses.replace(host, figures=figures)


def _host_line(path: str, host, args) -> str:
  """The host profile, and the figures the virtual runs take of it (`host.simulated`)."""
  from jaxsgd.scheduler import host as host_lib

  simulated = host_lib.simulated(host, args.lanes)
  every_core = args.lanes >= host.cores  # as `host.simulated` decides
  figures = ', '.join(_figure(k, v) for k, v in host.figures)
  if args.link_latency is None:
    latency, bandwidth, per_array = simulated.link
  else:
    latency, bandwidth, per_array = args.link_latency, args.link_bandwidth, 0.0
  return (
    f'host profile: {path} ({host.executor}, {host.cores} cores, {host.date}): {figures}; '
    f'the virtual runs ({args.lanes} lanes: the figures '
    f'{"with every core busy" if every_core else "with an idle lane"}) add '
    f'{1e6 * simulated.dispatch:.1f} µs per task, a driver of '
    f'{1e6 * simulated.driver:.1f} µs per event + {1e6 * simulated.driver_latency:.1f} µs '
    f"per message's way, links of {1e6 * latency:.0f} µs + {1e6 * per_array:.0f} µs per "
    f'array beyond the first + bytes / {bandwidth / 1e9:.2f} GB/s'
    + ('' if args.link_latency is None else ' (--link_latency, --link_bandwidth)')
    + f', and the lanes {simulated.core_share:.4f} of each core while every placed core computes'
  )


def _figure(name: str, value: float) -> str:
  """A host profile's figure with its unit: bytes/s as GB/s, cores, or seconds as µs."""
  if name.endswith('_bandwidth'):
    return f'{name} {value / 1e9:.2f} GB/s'
  if name == 'upkeep':
    return f'{name} {value:.4f} cores'
  return f'{name} {1e6 * value:.1f} µs'


def _neighbours_label(args) -> str:
  """How the other lanes' cores were while the profile was measured (`--neighbours`)."""
  if args.neighbours == 'idle':
    return 'neighbours idle'
  busy = '1' if args.lanes == 2 else f'1-{args.lanes - 1}'
  return f'core{"s" if args.lanes > 2 else ""} {busy} busy'


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
    'in cpu',
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
        f'{result.get("cpu_slowdown", float("nan")):.2f}',
        f'{result["load"]:.1f}',
        _lanes(result['measured']['utilization']),
        _lanes(result['predicted']['utilization']),
      )
    )
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
  print(
    f'ms/it: median over blocks of {BLOCK} iterations of the steady state (ASGD, DC-ASGD, '
    'LPP-SGD: of whole rounds of M updates, at least 5, for LPP-SGD at least an averaging period; mean: over all of it); measured: '
    'the run of median ms/it among the measured runs (each listed, in the order run); '
    'error: |predicted - measured| / measured of the median'
  )
  print(
    'repriced: the virtual clock with each task kind costing its mean duration in '
    "the family's warm-up run on the lanes (another run, before the measured one), on lanes "
    'placed on no core (their durations hold what sharing a core cost them), as replayed'
  )
  print(
    'replayed: the virtual clock again, with each task kind costing its mean duration '
    'in the measured run (the schedule and host model alone, without the cost profile); '
    "task slowdown: median over the lanes' task kinds of their measured median duration / "
    "their priced cost (the task-cost tables below); in cpu: the same of the lane's CPU "
    'time, which the profile prices (their difference: time its core ran something else); '
    'load: the 1-minute load average '
    'during the measured run (the larger of its start and end)'
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
      "a task's end -> the driver hears of it, ms median / mean (a lane holds the end of a "
      'task run ahead while two calls are queued behind it; the virtual runs: the '
      "host profile's simulated driver), " + ' | '.join(SIDES) + ':'
    )
    for name in heard:
      cells = (_delays(results[name][s], 'hear_delays') for s in SIDES)
      print(f'  {LABELS[name]}: ' + ' | '.join(cells))
  undriven = [n for n in errors if results[n].get('replayed_no_driver')]
  if undriven:
    print(
      "replayed without the simulated driver (the host profile's driver figures at 0), ms/it "
      'and error %: '
      + '; '.join(
        f'{LABELS[n]} {_ms(results[n]["replayed_no_driver"])} '
        f'({_error(results[n], "replayed_no_driver"):.1f})'
        for n in undriven
      )
    )
  cpu_priced = [n for n in errors if results[n].get('cpu_replayed')]
  if cpu_priced:
    print(
      'cpu-replayed (each task kind at its mean CPU time in the measured run, the lanes on '
      "their cores as predicted: predicted to it, the tasks' own work; it to measured, the "
      'rest of the model), ms/it and error %: '
      + '; '.join(
        f'{LABELS[n]} {_ms(results[n]["cpu_replayed"])} ({_error(results[n], "cpu_replayed"):.1f})'
        for n in cpu_priced
      )
    )
  for note in notes:
    print(note)
  for name in errors:
    print_task_costs(name, results[name].get('task_costs', []))
  if errors:
    worst = max(errors, key=errors.get)
    replayed = max(_error(results[n], 'replayed') for n in errors)
    if undriven:
      undriven_worst = max(_error(results[n], 'replayed_no_driver') for n in undriven)
      print(
        f'replayed without the simulated driver, max error across families: {undriven_worst:.1f}%'
      )
    if cpu_priced:
      cpu_worst = max(_error(results[n], 'cpu_replayed') for n in cpu_priced)
      print(f'cpu-replayed, max error across families: {cpu_worst:.1f}%')
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


def print_task_costs(name: str, rows: list[dict]) -> None:
  """Family `name`'s task-cost table (`task_costs`): per lane and task kind, its priced
  cost against its durations in the measured run's steady state."""
  ms = lambda seconds: f'{1e3 * seconds:.2f}'
  print(
    f'{LABELS[name]}: task costs, ms: priced (the virtual clock) against the measured '
    "run's durations over its steady state; cpu: the median CPU time of the lane's process "
    "over each task, less its copy threads' (the profile prices CPU time: cpu/priced near 1 "
    "and median/priced above it is time the lane's core ran something else)"
  )
  header = (
    '  lane',
    'task',
    'tasks',
    'priced',
    'median',
    'mean',
    'p10',
    'p90',
    'median/priced',
    'cpu',
    'cpu/priced',
  )
  table = [
    (
      f'  {row["lane"]}',
      row['task'],
      str(row['tasks']),
      ms(row['priced']) if row['priced'] else '-',
      ms(row['median']),
      ms(row['mean']),
      ms(row['p10']),
      ms(row['p90']),
      f'{row["median"] / row["priced"]:.2f}' if row['priced'] else '-',
      ms(row['cpu']) if row.get('cpu') is not None else '-',
      f'{row["cpu"] / row["priced"]:.2f}' if row['priced'] and row.get('cpu') else '-',
    )
    for row in rows
  ]
  widths = [max(len(r[i]) for r in (header, *table)) for i in range(len(header))]
  for row in (header, *table):
    print(
      '  '.join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    )


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
