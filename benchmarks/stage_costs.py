r"""Each task of `real_speedup`'s model alone, stage by stage: where DDG's ceiling comes from.

    python -m benchmarks.stage_costs                            # --features=1472,1536
    python -m benchmarks.stage_costs --features=1024,1408,1472,1536,2048 --rounds=3

For each `--features` value (the MLP's inputs, as `real_speedup --features`; its
`--depth` hidden layers of 1024, batch `--batch`), a process pinned to one core with one
XLA thread (a lane's environment: `simulator_accuracy.LANE_ENV`) builds BP's one stage
and DDG K=`--lanes`' K stages (`neighbour_contention.stage_calls`: the calls a lane
makes) and times each task alone — forward, backward, update — `--reps` calls after
`--warmup`, their median. `--rounds` rounds, the values interleaved in each; the table
shows the median over rounds.

Per part (BP, then stage k of DDG K), its tasks' times, their total and its
multiply-adds (XLA's cost analysis of the three tasks, per example); then per value the
stage ceiling: BP's total over the heaviest stage's total — the speed-up DDG K could
reach if its stages ran at once with nothing else in the way, sharing nothing (what
neighbour cores take from each other: `neighbour_contention --stages`) — beside the
same ratio in multiply-adds, which `split` balances. Where the two differ, a kernel runs
slower per multiply-add in one stage than in the others. And PD-ASGD 1:1's ceiling, from
BP's own tasks: its forward worker runs BP's forward and the update, its backward worker
BP's backward, so BP's total over the larger of the two (`pd_ceiling`). Not a test:
speed is measured, not asserted. The last lines: `PD-ASGD 1:1's ceiling over BP: <F>
inputs <x>x, ...`, then `DDG K=<K>'s stage ceiling over BP: <F> inputs <x>x, ...`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

KINDS = ('forward', 'backward', 'update')
SHAPE_FLAGS = ('lanes', 'batch', 'depth', 'warmup', 'reps')  # passed on to `worker`


def parts(lanes: int) -> list[str]:
  """The parts timed: BP's one stage, then DDG K's stages (`neighbour_contention.stage_calls`)."""
  return ['ddg:1:0'] + [f'ddg:{lanes}:{k}' for k in range(lanes)]


def part_name(part: str) -> str:
  _, count, k = part.split(':')
  return 'bp' if count == '1' else f'stage {k}'


def multiply_adds(fn, fn_args, batch: int) -> float:
  """XLA's count of a task's multiply-adds (half its FLOPs) per example."""
  import jax  # pylint: disable=g-import-not-at-top

  compiled = jax.jit(fn).lower(*fn_args).compile()  # (`fn`: a lane's named task)
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list):  # (a list of one dict in some jax versions)
    analysis = analysis[0]
  return analysis.get('flops', 0.0) / 2 / batch


def worker(args) -> None:
  """One process: pinned to its first allowed core before JAX starts its threads; prints
  `{part: {'ms': [forward, backward, update], 'macs': [the same, per example]}}` as JSON."""
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  import time  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import neighbour_contention  # pylint: disable=g-import-not-at-top

  shape = argparse.Namespace(features=args._worker, batch=args.batch, depth=args.depth)
  measured = {}
  for part in parts(args.lanes):
    calls = neighbour_contention.stage_calls(part, shape)
    medians = []
    for fn, fn_args in calls:
      for _ in range(args.warmup):
        jax.block_until_ready(fn(*fn_args))
      times = []
      for _ in range(args.reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        times.append(time.perf_counter() - start)
      medians.append(1e3 * statistics.median(times))
    macs = [multiply_adds(fn, fn_args, args.batch) for fn, fn_args in calls]
    measured[part] = {'ms': medians, 'macs': macs}
  print(json.dumps(measured), flush=True)


def measure(features: int, args) -> dict:
  """`worker`'s figures for `features` inputs, from a process of its own."""
  from benchmarks.simulator_accuracy import LANE_ENV  # pylint: disable=g-import-not-at-top

  command = [sys.executable, '-m', 'benchmarks.stage_costs', f'--_worker={features}']
  command += [f'--{name}={getattr(args, name)}' for name in SHAPE_FLAGS]
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', **LANE_ENV}
  done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def ceiling(totals: dict[str, float], lanes: int) -> float:
  """BP's total over the heaviest of DDG K's stages' totals (`parts`' keys)."""
  stages = parts(lanes)[1:]
  return totals['ddg:1:0'] / max(totals[part] for part in stages)


def pd_ceiling(bp_tasks: list[float]) -> float:
  """PD-ASGD 1:1's ceiling over BP from BP's (forward, backward, update): the forward
  worker's forward and the update at once with the backward worker's backward."""
  forward, backward, update = bp_tasks
  return (forward + backward + update) / max(forward + update, backward)


def median_rounds(rounds: list[dict]) -> dict:
  """`worker`'s figures, each the median over rounds."""
  return {
    part: {
      'ms': [statistics.median(r[part]['ms'][i] for r in rounds) for i in range(len(KINDS))],
      'macs': rounds[0][part]['macs'],
    }
    for part in rounds[0]
  }


def features_or_error(parser, text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(',')]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    parser.error(f'--features: comma-separated positive input counts; got {text!r}')
  return values


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--features', default='1472,1536', help='MLP inputs, comma-separated')
  parser.add_argument('--lanes', type=int, default=2, help="K: DDG's stages")
  parser.add_argument('--batch', type=int, default=512, help='rows of the batch')
  parser.add_argument('--depth', type=int, default=4, help='hidden layers of 1024')
  parser.add_argument('--warmup', type=int, default=3, help='untimed calls of each task first')
  parser.add_argument('--reps', type=int, default=15, help='timed calls of each task')
  parser.add_argument('--rounds', type=int, default=2, help='rounds, the values interleaved')
  parser.add_argument('--_worker', type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for name in (*SHAPE_FLAGS, 'rounds'):
    if getattr(args, name) < 1:
      parser.error(f'--{name}: a positive integer; got {getattr(args, name)}')
  if args.lanes < 2:
    parser.error(f'--lanes: DDG stages, at least 2; got {args.lanes}')
  if args.depth + 1 < args.lanes:
    parser.error(f'--depth: {args.lanes} stages need at least {args.lanes - 1}; got {args.depth}')
  if args._worker is not None:
    return worker(args)
  features = features_or_error(parser, args.features)
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'MLP <inputs>-1024x{args.depth}-10, batch {args.batch}, each task alone on one core, '
    f'{args.reps} calls, {args.rounds} rounds'
  )
  rounds = {value: [] for value in features}
  for _ in range(args.rounds):
    for value in features:
      rounds[value].append(measure(value, args))
  rows, ceilings, pd_ceilings = table(rounds, args.lanes)
  from benchmarks import common  # pylint: disable=g-import-not-at-top

  header = ('inputs', 'part', 'forward ms', 'backward ms', 'update ms', 'total ms')
  common.print_table((*header, 'M mult-adds', 'in mult-adds'), rows)
  print(
    "ceiling: bp's total over DDG's heaviest stage's, or over PD-ASGD 1:1's slower worker's "
    "(bp's forward and update against its backward); in mult-adds: the same ratio of "
    "multiply-adds (XLA's count, per example)"
  )
  shown = lambda figures: ', '.join(f'{value} inputs {c:.2f}x' for value, c in figures.items())
  print(f"PD-ASGD 1:1's ceiling over BP: {shown(pd_ceilings)}")
  print(f"DDG K={args.lanes}'s stage ceiling over BP: {shown(ceilings)}")


def table(rounds: dict[int, list[dict]], lanes: int) -> tuple[list, dict, dict]:
  """The table's rows (per inputs value: each part, then DDG's and PD-ASGD's ceilings)
  and each value's DDG and PD-ASGD ceilings in time, from `worker`'s figures of every
  round."""
  rows, ceilings, pd_ceilings = [], {}, {}
  for value, measured in rounds.items():
    figures = median_rounds(measured)
    totals = {part: sum(f['ms']) for part, f in figures.items()}
    macs = {part: sum(f['macs']) for part, f in figures.items()}
    for part, f in figures.items():
      times = [f'{ms:.2f}' for ms in (*f['ms'], totals[part])]
      rows.append((value, part_name(part), *times, f'{macs[part] / 1e6:.2f}', ''))
    ceilings[value] = ceiling(totals, lanes)
    pd_ceilings[value] = pd_ceiling(figures['ddg:1:0']['ms'])
    for name, in_time, in_macs in (
      (f'ddg K={lanes} ceiling', ceilings[value], ceiling(macs, lanes)),
      ('pd 1:1 ceiling', pd_ceilings[value], pd_ceiling(figures['ddg:1:0']['macs'])),
    ):
      rows.append((value, name, '', '', '', f'{in_time:.2f}', '', f'{in_macs:.2f}'))
  return rows, ceilings, pd_ceilings


if __name__ == '__main__':
  main()
