r"""Do two pinned lane processes really run at once? Two CPU-heavy tasks, 2 lanes vs 1.

    python -m benchmarks.lane_parallelism          # ~40 s on a loaded 2-core CPU

One jitted task: 600 steps of `x <- tanh(x @ W)` on 384 x 384 float32 (about 68
GFLOP). Three lanes of one `LanePool`, each its own process with XLA's intra-op threads
off (`--xla_cpu_multi_thread_eigen=false`, `OMP_NUM_THREADS=1`):
  one lane   `solo`, pinned to core 0, runs both tasks one after the other
  two lanes  `left` on core 0 and `right` on core 1 run one task each, at once
Wall time from the first start to the last result, median of interleaved repeats, and
the CPU time the lane processes used meanwhile (CPU / wall near 2 for two lanes means
both cores worked at once). The limit on 2 cores is 2x; other jobs on the machine take
their share of the cores. Not a test: speed is measured, not asserted.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe

SIZE, STEPS = 384, 600


def build_heavy_tasks(size: int, steps: int):
  """`heavy(x, w)`: `steps` dense tanh layers with the same weights; CPU-bound."""

  def heavy(x, w):
    return jax.lax.fori_loop(0, steps, lambda _, h: jnp.tanh(h @ w), x)

  return {'heavy': jax.jit(heavy)}


def _both(pool: LanePool, lanes: tuple[str, str], task: Task, inputs) -> tuple[float, float]:
  """Wall time of the two tasks, and the CPU time their lane processes used meanwhile."""
  processes = [psutil.Process(pool.pids()[lane]) for lane in set(lanes)]
  cpu = sum(sum(p.cpu_times()[:2]) for p in processes)
  start = time.perf_counter()
  pending = [pool.start(lane, task, inputs[lane]) for lane in lanes]
  while pending:
    pending.remove(pool.wait_any(pending))
  wall = time.perf_counter() - start
  return wall, sum(sum(p.cpu_times()[:2]) for p in processes) - cpu


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--address', default=None, help='a Ray cluster to join')
  args = parser.parse_args()
  # Recipes name the importable module (under `-m` this one is `__main__`).
  from benchmarks import lane_parallelism as this

  placement = LanePlacement.parse('solo@cores=0; left@cores=0; right@cores=1')
  task = Task(TaskRecipe.of(this.build_heavy_tasks, size=SIZE, steps=STEPS), 'heavy')
  put = Task(TaskRecipe.of(this.identity_tasks), 'put')
  rng = np.random.default_rng(0)
  x = rng.standard_normal((SIZE, SIZE), np.float32)
  w = (rng.standard_normal((SIZE, SIZE)) / np.sqrt(SIZE)).astype(np.float32)
  with LanePool(placement, address=args.address) as pool:
    inputs = {
      lane: (pool.run(lane, put, (x,)), pool.run(lane, put, (w,))) for lane in placement.names
    }
    for lane in placement.names:  # compile everywhere first
      pool.run(lane, task, inputs[lane])
    one, two = [], []
    for _ in range(args.repeats):
      one.append(_both(pool, ('solo', 'solo'), task, inputs))
      two.append(_both(pool, ('left', 'right'), task, inputs))
  print(
    f'two heavy tasks ({STEPS} x tanh({SIZE}x{SIZE} @ W)), median of {args.repeats} '
    f'interleaved; load average before: {os.getloadavg()[0]:.1f}'
  )
  print(
    f'{"lanes":>10}  {"wall (s)":>9}  {"lane CPU (s)":>12}  {"CPU / wall":>10}  {"speed-up":>8}'
  )
  t1 = statistics.median(w for w, _ in one)
  for label, runs in (('1 (core 0)', one), ('2 (0, 1)', two)):
    wall = statistics.median(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    print(f'{label:>10}  {wall:9.3f}  {cpu:12.3f}  {cpu / wall:10.2f}  {t1 / wall:8.2f}')
  t2 = statistics.median(w for w, _ in two)
  print(f'lane parallelism: 2 pinned lanes vs 1: {t1 / t2:.2f}x (limit 2)')


def identity_tasks():
  """`put(x)`: keeps an input in the lane (on its device), to reuse it."""
  return {'put': jax.jit(lambda x: x)}


if __name__ == '__main__':
  main()
