r"""Which statistic of repeated timings gives the same task costs twice on a shared machine.

    python -m benchmarks.profile_repeatability [--rounds=4] [--reps=30]

The CNN (MNIST-1D shapes, batch 128, Adam) in 4 stages: its 12 tasks (forward,
backward, update per stage) are timed `--rounds` times, each round as a cost
profile times them (`profiles.measure_times`: 3 warm-up calls, `--reps`
interleaved blocking calls), with a pause of a few seconds between rounds so
that each sees a different moment of the machine's load. For each statistic
(minimum, 10th percentile, median, mean) of a round's calls: the spread of a
task's figure across rounds (largest / smallest − 1), its median and worst
over the tasks. The issue this answers: costs calibrated at the start of two
runs of one config differed by 1.8×. Last line: `min: median spread <x> %`.
"""

import argparse
import os
import time

import numpy as np
import optax

from benchmarks.common import print_table
from jaxsgd import models
from jaxsgd.scheduler import Pipeline, Placement, profiles, sequential_roles

STATISTICS = {'min': np.min, 'p10': lambda t: np.quantile(t, 0.1), 'median': np.median,
              'mean': np.mean}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=4)
  parser.add_argument('--reps', type=int, default=30)
  parser.add_argument('--pause', type=float, default=5.0)
  parser.add_argument('--clock', choices=('wall', 'cpu'), default='wall',
                      help='wall: time.perf_counter; cpu: the process CPU time of the call')
  parser.add_argument('--pin', action='store_true',
                      help='pin this process to core 0 first (profiles.pin_to_core)')
  args = parser.parse_args()
  if args.pin:
    profiles.pin_to_core(0)
  model = models.get_model('cnn', (40, 1), 10)
  roles = sequential_roles(4)
  pipeline = Pipeline(model, 4, optax.adam(1e-3), placement=Placement.create(4),
                      batch_size=128, seed=0)
  rng = np.random.default_rng(0)
  batch = {'image': rng.standard_normal((128, 40, 1)).astype(np.float32),
           'label': rng.integers(0, 10, 128).astype(np.int32)}
  calls = pipeline._calibration_calls(roles, batch)  # pylint: disable=protected-access
  rounds, loads = [], []
  for r in range(args.rounds):
    if r:
      time.sleep(args.pause)
    loads.append(os.getloadavg()[0])
    clock = time.perf_counter if args.clock == 'wall' else time.process_time
    rounds.append(profiles.measure_times(calls, warmup=3, reps=args.reps, clock=clock))
  print(f'{args.rounds} rounds of {args.reps} interleaved calls per task, {args.clock} clock; '
        f'load average at '
        f'each round: {", ".join(f"{l:.2f}" for l in loads)} ({os.cpu_count()} cores)')
  rows, summary = [], {}
  for name, statistic in STATISTICS.items():
    spreads = []
    for key in calls:
      figures = [statistic(np.asarray(times[key])) for times in rounds]
      spreads.append(max(figures) / min(figures) - 1)
    summary[name] = float(np.median(spreads))
    rows.append([name, 100 * float(np.median(spreads)), 100 * float(max(spreads))])
  print_table(['statistic', 'median spread %', 'worst spread %'], rows)
  print(f'min: median spread {100 * summary["min"]:.1f} %')


if __name__ == '__main__':
  main()
