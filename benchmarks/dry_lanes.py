r"""Lanes that wait for the driver: BP and DDG K=2 on lane processes whose tasks are emulated.

    python -m benchmarks.dry_lanes                      # ~1 min on 2 cores
    python -m benchmarks.dry_lanes --forward=2 --backward=4 --update=0.5 --rounds=4

`real_speedup`'s model at 256 inputs, batch 32 (`real_speedup.set_shape`), its BP and DDG
K=2 cases on their lanes (`stage0` and `stage1`, on the first two cores this process may
use: `real_speedup.lane_placement`), with every task
emulated (`ProcessExecutor(emulate=...)`): a lane waits exactly `--forward`,
`--backward` or `--update` milliseconds instead of computing, and returns zeros of the
result's shapes. The lanes then leave the cores to the driver, as lanes whose tasks run
on GPUs do, and a lane's time per iteration beyond its tasks' own is what the executor
costs it: the hand-overs between its calls, and the waits for a call the driver had not
sent yet (dry: `real_speedup.lane_gaps`). Both cases' lanes run the same tasks, so the
time per iteration they would take with a free executor is forward + backward + update.

Per case, medians over `--rounds` interleaved rounds (`--steps` each, the first
`--warmup` batches left out, as `real_speedup` times them): ms per iteration, against the
tasks' own; the busiest lane's gaps between its tasks and their dry part, ms per
iteration; the driver's CPU per task (every thread of it). Not a test: speed is measured,
not asserted. The last line: `DDG K=2 with emulated tasks: <x> ms an iteration, <y> ms
of its tasks' own`.
"""

import argparse
import math
import statistics

from benchmarks import real_speedup
from jaxsgd.algorithms import ddg
from jaxsgd.pipeline import sequential_roles
from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.lanes import LanePool

CASES = {'bp (1 lane)': sequential_roles(1), 'ddg K=2': ddg.roles(2)}


def busiest_gaps(timeline, warmup: int) -> tuple[float, float]:
  """(gaps, of them dry) in seconds per iteration of the lane with the most tasks' time
  over `real_speedup.steady_window` (`real_speedup.lane_gaps`)."""
  busy = real_speedup.lane_times(timeline, warmup)[0]
  name = timeline.lane_names[max(busy, key=busy.get)]
  gaps, iterations = real_speedup.lane_gaps(timeline, warmup)
  found = [gap for pairs in gaps.get(name, {}).values() for gap in pairs]
  total = sum(gap.seconds for gap in found)
  dry = sum(gap.seconds for gap in found if gap.dry)
  return total / iterations, dry / iterations


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--forward', type=float, default=2.0, help='ms per forward task')
  parser.add_argument('--backward', type=float, default=4.0, help='ms per backward task')
  parser.add_argument('--update', type=float, default=0.5, help='ms per update task')
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--warmup', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=4)
  args = parser.parse_args()
  for field in ('forward', 'backward', 'update'):
    value = getattr(args, field)
    if not (value > 0 and math.isfinite(value)):
      parser.error(f'--{field}: milliseconds, a finite number above 0; got {value}')
  if args.steps < args.warmup + 2 or args.warmup < 1 or args.rounds < 1:
    parser.error(
      f'--steps at least --warmup + 2, --warmup and --rounds at least 1; got '
      f'{args.steps}, {args.warmup}, {args.rounds}'
    )
  ms = {'forward': args.forward, 'backward': args.backward, 'update': args.update}
  real_speedup.set_shape(256, 32, 4)
  real_speedup.EXECUTOR['emulate'] = CostModel({k: v / 1e3 for k, v in ms.items()})
  own = sum(ms.values())
  rows = {name: [] for name in CASES}
  with LanePool(real_speedup.lane_placement(2, ('ddg',))) as pool:
    for roles in CASES.values():  # each lane builds and compiles its tasks once
      real_speedup.run(pool, roles, args.warmup + 2, args.warmup)
    for _ in range(args.rounds):
      for name, roles in CASES.items():
        figures = real_speedup.run(pool, roles, args.steps, args.warmup)
        gaps = busiest_gaps(real_speedup.LAST_RUN['timeline'], args.warmup)
        rows[name].append((figures[0], *gaps, figures[-1]))
  header = (
    'case',
    'ms / iteration',
    "tasks' own",
    'gaps ms / it',
    'of them dry',
    'driver µs / task',
  )
  table = [header]
  for name, runs in rows.items():
    median = [statistics.median(run[i] for run in runs) for i in range(4)]
    table.append(
      (
        name,
        f'{1e3 * median[0]:.2f}',
        f'{own:.2f}',
        f'{1e3 * median[1]:.2f}',
        f'{1e3 * median[2]:.2f}',
        f'{1e6 * median[3]:.0f}',
      )
    )
  real_speedup.print_cases(table[0], table[1:])
  ddg_ms = 1e3 * statistics.median(run[0] for run in rows['ddg K=2'])
  print(
    f"DDG K=2 with emulated tasks: {ddg_ms:.2f} ms an iteration, {own:.2f} ms of its tasks' own"
  )


if __name__ == '__main__':
  main()
