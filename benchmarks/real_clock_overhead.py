r"""What the in-process real clock costs on top of the work: DDG K=4 of the CNN, one device.

    python -m benchmarks.real_clock_overhead              # ~1 min on a 2-core CPU
    python -m benchmarks.real_clock_overhead --steps=1000 --rounds=3

The CNN of the default config (MNIST-1D shapes, batch 128, Adam) cut into K = 4
stages, every stage on the same CPU device, trained with DDG on `RealExecutor()`
(asynchronous dispatch from one thread) on synthetic batches. Its cost is held
against the work it dispatches: each stage's forward, backward and update timed
alone (`PlacedStages.time_tasks`, the fastest of 5 waited-for calls), summed over the
tasks the run really executes (stage k skips its first d_k = K − 1 − k backwards
and updates). With every stage on one device the tasks run one after another, so
the ideal ratio wall / Σ task costs is 1; what is above 1 is the scheduler's
host time and what it makes the device wait for.

For scale, each round also runs the same jitted calls with no scheduler at all
(`bare`: a plain Python loop in staged-BP order, dispatched asynchronously, one
wait at the end): the floor this machine gives at that moment. Rounds interleave
the tasks' timing, bare loop and run, so load from other jobs hits all alike; each timed
section starts after a full garbage collection. Reported per round: the wall
ratios, and the host CPU per task — of the whole process (XLA's threads included),
of the main thread (dispatch: the policy, the executor, the jitted calls), and of
the real clock's timing threads (`RealExecutor.timing_cpu_seconds`) — for the run
and the bare loop. Then the medians, and the figure: the *fastest* run against the
*fastest* timing of each task over all rounds, the two estimates least
disturbed by other jobs (load only ever adds time). The last line:
`real clock overhead DDG K=4 (one device): <fastest run wall / compute>`, after
`in-process real clock host time per task: <x> µs` (the main thread's CPU per task plus
the timing threads', medians of rounds: `real_speedup`'s line for the process executor
is its counterpart), where
compute = Σ over the tasks the run executes of each task's fastest solo, waited-for
call.

What earlier runs measured, and what they were read to mean:
benchmarks/results/real_clock_overhead.md ("Moved from the benchmark's docstring").
"""

import argparse
import dataclasses
import gc
import os
import time

import jax
import numpy as np
import optax

from benchmarks import common
from jaxsgd import models
from jaxsgd.algorithms import ddg
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.pipeline import BatchFeed, PlacedStages
from jaxsgd.scheduler import Placement, RealExecutor, transfer

NUM_STAGES, BATCH = 4, 128


def synthetic_batches(shape, classes, batch_size, seed=0):
  rng = np.random.default_rng(seed)
  while True:
    yield {
      'image': rng.standard_normal((batch_size,) + shape).astype(np.float32),
      'label': rng.integers(0, classes, batch_size).astype(np.int32),
    }


def task_seconds(costs: dict, roles, steps: int) -> float:
  """Σ over the tasks a run of `steps` iterations executes of their timed cost."""
  total = 0.0
  for k, role in enumerate(roles):
    total += steps * costs[(k, 'forward')]
    total += (steps - role.delay) * (costs[(k, 'backward')] + costs[(k, 'update')])
  return total


def process_cpu() -> float:
  """CPU seconds of this process so far, every thread (XLA's included)."""
  times = os.times()
  return times.user + times.system


def run_once(pipeline, roles, batches, steps) -> dict:
  """One real-clock run: wall and CPU seconds (process, main thread, timing threads)."""
  feed = BatchFeed(batches, 1 + sum(r.loss != 'none' for r in roles))
  session = pipeline.session(roles, feed, steps)
  executor = RealExecutor()
  gc.collect()
  cpu, main, start = process_cpu(), time.thread_time(), time.perf_counter()
  timeline = executor.run(session.cluster, session.processes())
  jax.block_until_ready([store.read().value for store in session.stores])
  wall = time.perf_counter() - start
  return {
    'wall': wall,
    'cpu': process_cpu() - cpu,
    'main': time.thread_time() - main,
    'timing': executor.timing_cpu_seconds,
    'tasks': len(timeline.records),
  }


class Bare:
  """The same jitted calls as the run, in staged-BP order, without a scheduler."""

  def __init__(self, pipeline, roles, batches):
    self.pipeline, self.batches = pipeline, batches
    self.ops = [pipeline.ops(k, role) for k, role in enumerate(roles)]
    self.params = [
      stages_lib.split_variables(pipeline.initial_variables(k, role))[0]
      for k, role in enumerate(roles)
    ]
    self.opt_states = [pipeline.tx.init(p) for p in self.params]

  def run(self, steps: int) -> dict:
    """Wall and CPU seconds (process, main thread) of `steps` iterations."""
    last, device = len(self.ops) - 1, self.pipeline.device(0)
    gc.collect()
    cpu, main, start = process_cpu(), time.thread_time(), time.perf_counter()
    for _ in range(steps):
      batch = next(self.batches)
      x, labels = (transfer.to_device(batch[key], device) for key in ('image', 'label'))
      vjps = []
      for k, ops in enumerate(self.ops):
        x, _, _, vjp = ops.forward({'params': self.params[k]}, x, labels if k == last else None)
        vjps.append(vjp)
      dy = None
      for k in reversed(range(len(self.ops))):
        grads, dy = self.ops[k].backward(vjps[k], dy)
        self.params[k], self.opt_states[k] = self.ops[k].update(
          self.params[k], self.opt_states[k], grads
        )
    jax.block_until_ready(self.params)
    wall = time.perf_counter() - start
    return {'wall': wall, 'cpu': process_cpu() - cpu, 'main': time.thread_time() - main}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--rounds', type=int, default=7)
  args = parser.parse_args()
  model = models.get_model('cnn', (40, 1), 10)
  roles = ddg.roles(NUM_STAGES)
  device = jax.devices()[0]
  pipeline = PlacedStages(
    model,
    NUM_STAGES,
    optax.adam(3e-3),
    placement=Placement.create(NUM_STAGES, [device]),
    batch_size=BATCH,
  )
  batches = synthetic_batches(model.input_shape, model.num_classes, BATCH)
  bare_runner = Bare(pipeline, roles, batches)
  run_once(pipeline, roles, batches, 2 * NUM_STAGES)  # Compiles every call.
  bare_runner.run(2)
  rows, fastest, loads = [], {}, [os.getloadavg()[0]]
  bare_roles = [dataclasses.replace(role, delay=0) for role in roles]
  for r in range(args.rounds):  # Interleaved: timing, bare loop, run, every round.
    costs = pipeline.time_tasks(roles, next(batches), reps=5)
    for key, seconds in costs.items():
      fastest[key] = min(seconds, fastest.get(key, seconds))
    bare = bare_runner.run(args.steps)
    run = run_once(pipeline, roles, batches, args.steps)
    loads.append(os.getloadavg()[0])
    work, bare_work = (
      task_seconds(costs, roles, args.steps),
      task_seconds(costs, bare_roles, args.steps),
    )
    tasks = run['tasks']
    rows.append(
      {
        'round': r,
        'tasks': tasks,
        'Σ task costs s': work,
        'bare s': bare['wall'],
        'run s': run['wall'],
        'bare / Σ costs': bare['wall'] / bare_work,
        'run / Σ costs': run['wall'] / work,
        'run / bare': (run['wall'] / work) / (bare['wall'] / bare_work),
        'CPU µs/task bare': 1e6 * bare['cpu'] / tasks,
        'run': 1e6 * run['cpu'] / tasks,
        'main thread bare': 1e6 * bare['main'] / tasks,
        'run ': 1e6 * run['main'] / tasks,
        'timing threads': 1e6 * run['timing'] / tasks,
        '_bare_work': bare_work,
      }
    )
  print(f'DDG K={NUM_STAGES}, CNN, batch {BATCH}, every stage on {device}; RealExecutor()')
  print(
    f'{args.rounds} interleaved rounds of {args.steps} steps; load average '
    f'{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPU cores'
  )
  header = [key for key in rows[0] if not key.startswith('_')]
  common.print_table(header, [[row[key] for key in header] for row in rows])
  median = lambda key: float(np.median([row[key] for row in rows]))
  best_work = task_seconds(fastest, roles, args.steps)
  best_bare_work = task_seconds(fastest, bare_roles, args.steps)
  best_run, best_bare = min(row['run s'] for row in rows), min(row['bare s'] for row in rows)
  print(
    f'host CPU per task (medians): process {median("run"):.0f} µs (bare loop '
    f'{median("CPU µs/task bare"):.0f}), main thread {median("run "):.0f} µs (bare loop '
    f'{median("main thread bare"):.0f}), timing threads {median("timing threads"):.0f} µs'
  )
  print(
    f'median of rounds: run / Σ costs {median("run / Σ costs"):.2f}, bare / Σ costs '
    f'{median("bare / Σ costs"):.2f}, run / bare {median("run / bare"):.2f}'
  )
  print(
    f'fastest of rounds (least disturbed by other jobs): run {best_run:.3f} s, bare loop '
    f'{best_bare:.3f} s, Σ fastest task costs {best_work:.3f} s (bare order '
    f'{best_bare_work:.3f} s): bare / Σ costs {best_bare / best_bare_work:.2f}'
  )
  # The executor's own host time per task, beside `real_speedup`'s line for the process
  # executor: the main thread (policy, executor, jitted dispatch) and the timing threads.
  host = median('run ') + median('timing threads')
  print(f'in-process real clock host time per task: {host:.0f} µs')
  print(
    f'real clock overhead DDG K={NUM_STAGES} (one device): {best_run / best_work:.2f} '
    f'(fastest run wall / compute; compute = Σ over the tasks the run executes of each '
    f"task's fastest solo, waited-for call)"
  )


if __name__ == '__main__':
  main()
