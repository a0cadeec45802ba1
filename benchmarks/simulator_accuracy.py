r"""The simulator's error: each scheduler family on lane processes and on the virtual clock.

    python -m benchmarks.simulator_accuracy                 # ~5 min on a loaded 2-core CPU
    python -m benchmarks.simulator_accuracy --steps=40 --families=ddg,asgd
    python -m benchmarks.simulator_accuracy --profile=/tmp/acc.json   # reuse a profile

Each family runs the same config twice, through `experiments.train`'s own path
(`training.train_and_evaluate`):
  measured   `clock='real', executor='processes'`: every lane an OS process pinned to
             a core (`--placement`, below), the run's trace as the lanes timed it;
  predicted  `clock='virtual'` with `cost.profile` = one profile measured at the start
             for this executor (`cost.dispatch='processes'`: its host overhead per task
             is added to every task) and the same `placement.lanes` (lanes placed on one
             core share it on the virtual clock, as they do on the machine).
The profile (`--profile` reuses one) is measured as the lanes run: in a process pinned
to core 0 with XLA's intra-op threads off (`--xla_cpu_multi_thread_eigen=false`, one
OpenMP thread), every task of every family's table (`experiments.profile`), the fastest
of `--reps` interleaved wall-clock calls; plus the process executor's dispatch overhead,
timed through one pinned lane (`profiles.measure_process_dispatch`).

Per family: time per iteration (an iteration is one applied update of the whole model:
a batch whose every stage has updated, or one server update), from the end of iteration
`--warmup` to the end of the last one (the lanes compile during the first ones);
utilization of each compute lane over the same window; and for the asynchronous methods
the staleness histogram of every applied update. Error = |predicted - measured| /
measured of the time per iteration; the last line is the largest over the families that
ran. The model is an MLP on MNIST-1D wide enough that a task (a few ms) is well above a
dispatch (~0.5 ms). The machine's load average is printed: other jobs on this 2-core
machine take cores from the lanes, which the simulator cannot know.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

FAMILIES = ('bp', 'ddg', 'local', 'asgd', 'dcasgd', 'pdasgd', 'lppsgd')
LABELS = {
  'bp': 'staged BP K=2',
  'ddg': 'DDG K=2',
  'local': 'local K=2',
  'asgd': 'ASGD M=2',
  'dcasgd': 'DC-ASGD M=2',
  'pdasgd': 'PD-ASGD 1:1',
  'lppsgd': 'LPP-SGD 2x1',
}
ASYNCHRONOUS = ('asgd', 'dcasgd', 'pdasgd', 'lppsgd')
# The profile's tables: DDG and PD-ASGD (2 stages, sequential roles) compute what staged
# BP computes (`profiles.roles_signature`), so BP's table serves all three.
MEASURED = ('bp', 'local', 'asgd', 'dcasgd', 'lppsgd')
# Lanes pinned to cores 0 and 1 (names: `placement.lane_name` of the cluster's lanes).
PLACEMENT = {
  'bp': 'stage0@cores=0; stage1@cores=1',
  'ddg': 'stage0@cores=0; stage1@cores=1',
  'local': 'stage0@cores=0; stage1@cores=1',
  'asgd': 'server@cores=0; worker0@cores=0; worker1@cores=1',
  'dcasgd': 'server@cores=0; worker0@cores=0; worker1@cores=1',
  'pdasgd': 'sharedmodel@cores=0; forwardworker0@cores=0; backwardworker0@cores=1',
  'lppsgd': 'worker0.0@cores=0; worker1.0@cores=1; allreduce@cores=0',
}
# What a lane process runs with (`lanes.placement.LaneSpec.environment`, one core).
LANE_ENV = {
  'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false',
  'OMP_NUM_THREADS': '1',
  'MKL_NUM_THREADS': '1',
  'OPENBLAS_NUM_THREADS': '1',
}


def family_config(name: str, args, side: str, profile: str | None = None):
  """The config of family `name` for `side`: 'measured' (lane processes), 'predicted'
  (the virtual clock with `profile`) or 'tables' (what the profile measures)."""
  import ml_collections

  from experiments.configs import default

  config = default.get_config()
  config.dataset = 'mnist1d/5k'
  config.model = ml_collections.ConfigDict({'name': 'mlp', 'hidden': (args.hidden,) * 4})
  config.batch_size = args.batch
  config.train_steps = args.steps
  config.eval_every = args.steps
  config.eval_batch_size = 500
  config.optimizer.name = 'sgd'
  config.optimizer.schedule = 'constant'
  config.optimizer.learning_rate = 0.05
  config.algorithm = default.algorithm(name)
  if name in ('bp', 'ddg', 'local'):
    config.stages = 2
  if name in ('asgd', 'dcasgd'):
    config.workers = 2
  if name == 'pdasgd':
    config.stages = 2
    config.algorithm.update({'n_fwd': 1, 'n_bwd': 1})
  if name == 'lppsgd':
    config.algorithm.update({'devices': 2, 'workers_per_device': 1})
  config.placement.lanes = PLACEMENT[name]
  if side == 'measured':
    config.clock, config.executor = 'real', 'processes'
  else:
    config.clock = 'virtual'
  if side == 'predicted':
    config.cost.profile = profile
    config.cost.dispatch = 'processes'
  return config


# --- the profile: measured in a process set up as a lane ---------------------------------------
def measure_profile(path: str, args) -> None:
  """Runs this module in a process pinned to core 0 with the lanes' flags; it writes the
  tables of every family to `path` (`_write_tables`)."""
  env = {**os.environ, **LANE_ENV}
  command = [sys.executable, '-m', 'benchmarks.simulator_accuracy', '--_tables', path]
  command += [f'--{k}={v}' for k, v in _shape_args(args).items()]
  subprocess.run(command, env=env, check=True)


def _shape_args(args) -> dict:
  return {'hidden': args.hidden, 'batch': args.batch, 'steps': args.steps, 'reps': args.reps}


def _write_tables(path: str, args) -> None:
  from experiments import profile as profile_command
  from jaxsgd import data as data_lib
  from jaxsgd.scheduler import profiles
  from jaxsgd.training.loop import build_model

  profiles.pin_to_core(0)  # before JAX's first computation
  merged = None
  for name in MEASURED:
    config = family_config(name, args, 'tables')
    dataset = data_lib.load(config.dataset, config.get('data_dir'))
    model = build_model(config, dataset)

    def batch_for(size, dataset=dataset, config=config):
      return next(dataset.train_batches(size, seed=config.seed))

    table, batch = profile_command.measure_table(
      config, model, batch_for, warmup=3, reps=args.reps, clock='cpu'
    )
    profile = profiles.make_profile(
      model,
      batch,
      profiles.optimizer_id(dict(config.optimizer)),
      [table],
      warmup=3,
      reps=args.reps,
      clock='cpu',
      pinned=True,
      dispatch=profiles.measure_dispatch() if merged is None else {},
    )
    merged = profile if merged is None else profiles.merge(merged, profile)
  profiles.save(merged, path)


# --- reading a run's trace ---------------------------------------------------------------------
def read_trace(workdir: str):
  """`(lane names, [(lane, kind, start, end, batch)])` of the run's trace.json, in seconds."""
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
  tasks = [
    (e['tid'], e['cat'], e['ts'] / 1e6, (e['ts'] + e['dur']) / 1e6, e['args'].get('batch'))
    for e in events
    if e.get('ph') == 'X'
  ]
  return names, tasks


def iteration_ends(tasks) -> list[float]:
  """When each iteration ended: per batch, the last end of its update tasks (every stage
  updated); without update tasks (updates applied in the driver), its backward tasks."""
  for kind in ('update', 'backward'):
    ends = {}
    for _, task_kind, _, end, batch in tasks:
      if task_kind == kind and batch is not None:
        ends[batch] = max(ends.get(batch, 0.0), end)
    if ends:
      return [ends[b] for b in sorted(ends)]
  raise ValueError('the trace has no update or backward tasks')


def window_stats(workdir: str, warmup: int) -> dict:
  """Seconds per iteration after `warmup` iterations, and each compute lane's
  utilization over that window."""
  names, tasks = read_trace(workdir)
  ends = sorted(iteration_ends(tasks))
  warmup = min(warmup, len(ends) - 2)
  start, stop = ends[warmup], ends[-1]
  per_iteration = (stop - start) / (len(ends) - 1 - warmup)
  busy = {}
  for lane, _, begin, end, _ in tasks:
    name = names[lane]
    if name.startswith('link '):
      continue
    overlap = max(0.0, min(end, stop) - max(begin, start))
    key = _short(name)
    busy[key] = busy.get(key, 0.0) + overlap
  utilization = {lane: seconds / (stop - start) for lane, seconds in sorted(busy.items())}
  return {'per_iteration': per_iteration, 'utilization': utilization}


def _short(name: str) -> str:
  from jaxsgd.scheduler.placement import lane_name

  return lane_name(name)


def run_family(name: str, args, profile: str, root: str) -> dict:
  """Both runs of family `name`: their statistics, or why the measured one could not run."""
  from jaxsgd import training

  result = {}
  for side in ('measured', 'predicted'):
    config = family_config(name, args, side, profile)
    workdir = os.path.join(root, f'{name}-{side}')
    try:
      summary = training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
    except Exception as error:  # noqa: BLE001 - reported, the other families go on
      line = ' '.join(str(error).split())[:160]
      if side == 'measured' and name in ('pdasgd', 'lppsgd'):
        return {'skipped': f'not on processes yet ({type(error).__name__}: {line})'}
      return {'skipped': f'{side} run failed ({type(error).__name__}: {line})'}
    stats = window_stats(workdir, args.warmup)
    stats['staleness'] = summary.get('staleness_histogram', {})
    result[side] = stats
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=40, help='iterations of each run')
  parser.add_argument('--warmup', type=int, default=8, help='iterations left out (compiling)')
  parser.add_argument('--hidden', type=int, default=512, help='width of the MLP')
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--reps', type=int, default=20, help='timed calls per task (profile)')
  parser.add_argument('--families', default=','.join(FAMILIES))
  parser.add_argument('--profile', default=None, help='a profile to use (default: measure)')
  parser.add_argument('--_tables', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._tables:
    _write_tables(args._tables, args)
    return
  families = [f for f in args.families.split(',') if f]
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown:
    parser.error(f'--families: unknown {unknown}; allowed: {", ".join(FAMILIES)}')
  started = time.time()
  print(
    f'machine: {os.cpu_count()} CPU cores, load average '
    f'{"/".join(f"{x:.1f}" for x in os.getloadavg())} at start; MLP 40-'
    f'{"-".join([str(args.hidden)] * 4)}-10 on MNIST-1D, batch {args.batch}, SGD; '
    f'{args.steps} iterations per run, the first {args.warmup} left out',
    flush=True,
  )
  root = tempfile.mkdtemp(prefix='simacc-')
  import jax

  from jaxsgd.scheduler import profiles
  from jaxsgd.scheduler.lanes import cluster

  profile = args.profile
  if profile is None:
    profile = os.path.join(root, 'profile.json')
    measure_profile(profile, args)
  cluster.connect(None)  # one Ray cluster for every run (each run starts its own lanes)
  try:
    loaded = profiles.load(profile)
    if 'processes' not in loaded.dispatch:
      dispatch = profiles.measure_process_dispatch(cores=(0,))
      loaded = profiles.merge(loaded, _with_dispatch(loaded, {'processes': dispatch}))
      profiles.save(loaded, profile)
    print(
      f'profile: {profile} ({loaded.date}, pinned to core 0, lane flags; fastest of '
      f'{loaded.reps}); dispatch per task (µs): '
      + ', '.join(f'{k} {1e6 * v:.1f}' for k, v in loaded.dispatch.items()),
      flush=True,
    )
    results = {}
    for name in families:
      results[name] = run_family(name, args, profile, root)
      print(f'  {LABELS[name]}: {_one_line(results[name])}', flush=True)
  finally:
    cluster.shutdown()
  print(
    f'load average {"/".join(f"{x:.1f}" for x in os.getloadavg())} at end; '
    f'jax {jax.__version__}; {time.time() - started:.0f} s'
  )
  print_table(results)


def _with_dispatch(profile, dispatch: dict):
  import dataclasses

  return dataclasses.replace(profile, tables=(), dispatch=dispatch)


def _one_line(result: dict) -> str:
  if 'skipped' in result:
    return result['skipped']
  measured, predicted = result['measured'], result['predicted']
  return (
    f'measured {1e3 * measured["per_iteration"]:.2f} ms/iteration, predicted '
    f'{1e3 * predicted["per_iteration"]:.2f}'
  )


def print_table(results: dict) -> None:
  header = (
    'family',
    'measured ms/it',
    'predicted ms/it',
    'error %',
    'utilization measured',
    'utilization predicted',
  )
  rows, errors, notes = [], {}, []
  for name, result in results.items():
    if 'skipped' in result:
      notes.append(f'{LABELS[name]}: {result["skipped"]}')
      continue
    measured, predicted = result['measured'], result['predicted']
    error = abs(predicted['per_iteration'] - measured['per_iteration'])
    errors[name] = 100 * error / measured['per_iteration']
    rows.append(
      (
        LABELS[name],
        f'{1e3 * measured["per_iteration"]:.2f}',
        f'{1e3 * predicted["per_iteration"]:.2f}',
        f'{errors[name]:.1f}',
        _lanes(measured['utilization']),
        _lanes(predicted['utilization']),
      )
    )
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
  staleness = [n for n in results if n in ASYNCHRONOUS and 'skipped' not in results[n]]
  if staleness:
    print('staleness histogram (staleness: updates), measured | predicted:')
    for name in staleness:
      measured, predicted = (results[name][s]['staleness'] for s in ('measured', 'predicted'))
      print(f'  {LABELS[name]}: {_histogram(measured)} | {_histogram(predicted)}')
  for note in notes:
    print(note)
  if errors:
    worst = max(errors, key=errors.get)
    print(
      f'(largest: {LABELS[worst]}; median over families {np.median(list(errors.values())):.1f} %)'
    )
    print(f'simulator max error across families: {errors[worst]:.1f}%')
  else:
    print('simulator max error across families: n/a (no family ran)')


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
