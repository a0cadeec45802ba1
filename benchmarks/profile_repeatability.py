r"""Which way of timing tasks gives the same costs twice on a shared machine.

    python -m benchmarks.profile_repeatability [--rounds=4] [--reps=100]

The CNN (MNIST-1D shapes, batch 128, Adam) in 4 stages: its 12 tasks (forward,
backward, update per stage) are timed as a cost profile times them
(`task_timing.measure_times`: 3 warm-up calls, `--reps` interleaved blocking
calls) by four methods — wall or process-CPU clock, on both cores or pinned to
core 0 — each in a fresh process (as two `experiments.profile` commands at
different times would be), the methods interleaved within each of `--rounds`
rounds so that all see the same load. For each method and statistic (minimum,
10th percentile, median, mean): the spread of a task's figure across rounds
(largest / smallest − 1), its median and worst over the tasks. The issue this
answers: costs calibrated at the start of two runs of one config differed by
1.8×. Last line: `most repeatable: <statistic> of <method>, median spread <x> %`.
"""

import argparse
import multiprocessing
import os
import time

import numpy as np

from benchmarks.common import print_table

STATISTICS = {
  'min': np.min,
  'p10': lambda t: np.quantile(t, 0.1),
  'median': np.median,
  'mean': np.mean,
}


def one_round(reps: int, clock_name: str, pin: bool) -> dict:
  """`{task: [seconds]}` of one round (imports JAX here: a spawned child starts clean)."""
  import optax  # pylint: disable=import-outside-toplevel
  from jaxsgd import models  # pylint: disable=import-outside-toplevel

  # pylint: disable=import-outside-toplevel
  from jaxsgd.pipeline import PlacedStages, sequential_roles
  from jaxsgd.scheduler import Placement, task_timing  # pylint: disable=import-outside-toplevel

  if pin:
    task_timing.pin_to_core(0)
  model = models.get_model('cnn', (40, 1), 10)
  roles = sequential_roles(4)
  pipeline = _pipeline_cache.get('p') or PlacedStages(
    model, 4, optax.adam(1e-3), placement=Placement.create(4), batch_size=128, seed=0
  )
  _pipeline_cache['p'] = pipeline
  rng = np.random.default_rng(0)
  batch = {
    'image': rng.standard_normal((128, 40, 1)).astype(np.float32),
    'label': rng.integers(0, 10, 128).astype(np.int32),
  }
  calls = pipeline.task_calls(roles, batch)
  return task_timing.measure_times(calls, warmup=3, reps=reps, clock=task_timing.CLOCKS[clock_name])


_pipeline_cache = {}


METHODS = {  # name: (clock, pinned)
  'wall, both cores': ('wall', False),
  'cpu time, both cores': ('cpu', False),
  'wall, pinned': ('wall', True),
  'cpu time, pinned': ('cpu', True),
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=4)
  parser.add_argument('--reps', type=int, default=100)
  parser.add_argument('--pause', type=float, default=2.0)
  args = parser.parse_args()
  context = multiprocessing.get_context('spawn')
  times = {method: [] for method in METHODS}
  loads = []
  for _ in range(args.rounds):
    loads.append(os.getloadavg()[0])
    for method, (clock, pin) in METHODS.items():
      time.sleep(args.pause)
      with context.Pool(1) as pool:  # A fresh process: as a new profile command would be.
        times[method].append(pool.apply(one_round, (args.reps, clock, pin)))
  print(
    f'{args.rounds} rounds; in each, every method in a fresh process, {args.reps} '
    f'interleaved calls per task; load average at each round: '
    f'{", ".join(f"{l:.2f}" for l in loads)} ({os.cpu_count()} cores)'
  )
  rows, summary = [], {}
  for method, rounds in times.items():
    for name, statistic in STATISTICS.items():
      spreads = []
      for key in rounds[0]:
        figures = [statistic(np.asarray(round_[key])) for round_ in rounds]
        spreads.append(max(figures) / min(figures) - 1)
      summary[(method, name)] = float(np.median(spreads))
      rows.append([method, name, 100 * float(np.median(spreads)), 100 * float(max(spreads))])
  print_table(['method', 'statistic', 'median spread %', 'worst spread %'], rows)
  best = min(summary, key=summary.get)
  print(f'most repeatable: {best[1]} of {best[0]}, median spread {100 * summary[best]:.1f} %')


if __name__ == '__main__':
  main()
