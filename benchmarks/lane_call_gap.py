r"""A lane's own time between two calls, by what the first call read and made.

    python -m benchmarks.lane_call_gap         # ~15 s on a 2-core CPU

One lane process pinned to core 0 runs, `--reps` times, a 17-layer 128-wide MLP's
forward (35 argument arrays; its loss and VJP), its backward (a 34-array gradient) and
a scalar task (`vjp_chain_tasks`, `lane_timing.dispatch_tasks`), each call sent before
the one ahead of it ended. Between two calls a, b: `b.entered - a.ended` (the lane's
stamps: `LaneRuntime.run`), the lane keeping a's result, replying, and taking b's call.
The scalar-to-scalar gap is what a host profile's `dispatch` prices for every task.
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsgd.scheduler import lane_timing
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe

SCALAR = Task(TaskRecipe.of(lane_timing.dispatch_tasks), 'add_one')


def vjp_chain_tasks(layers: int = 17, width: int = 128) -> dict:
  """A `layers`-deep, `width`-wide tanh MLP as a lane runs a worker's tasks (a
  `TaskRecipe` factory): `init` (its 2·`layers` parameter arrays), `forward` (the loss
  and its VJP), `backward` (the parameters' gradient) — the lane's time between calls
  by what they read and make (this benchmark)."""

  def init(seed):
    keys = jax.random.split(jax.random.key(seed), layers)
    return {
      f'layer{i}': {'w': jax.random.normal(k, (width, width)) / width, 'b': jnp.zeros(width)}
      for i, k in enumerate(keys)
    }

  def loss(params, x):
    for i in range(layers):
      x = jnp.tanh(x @ params[f'layer{i}']['w'] + params[f'layer{i}']['b'])
    return jnp.mean(x**2)

  def forward(params, x):
    return jax.vjp(loss, params, x)

  def backward(vjp, g):
    return vjp(g)[0]

  return {'init': jax.jit(init), 'forward': jax.jit(forward), 'backward': jax.jit(backward)}


def gaps(pool: LanePool, reps: int, warmup: int = 5) -> dict[str, list[float]]:
  """`{'forward -> backward', 'backward -> scalar', 'scalar -> scalar': [seconds]}`."""
  # Recipes name the importable module (under `-m` this one is `__main__`).
  from benchmarks import lane_call_gap as this

  mlp = TaskRecipe.of(this.vjp_chain_tasks)
  params = pool.run('lane', Task(mlp, 'init'), (0,))
  x = np.ones((128, 128), np.float32)
  found = {'forward -> backward': [], 'backward -> scalar': [], 'scalar -> scalar': []}
  for rep in range(warmup + reps):
    forward = pool.start('lane', Task(mlp, 'forward'), (params, x))
    handles = pool.early(forward)  # known from the second round: the calls are queued
    if handles is None:
      pool.wait_any([forward])
      handles = forward.result()
    backward = pool.start('lane', Task(mlp, 'backward'), (handles[1], np.float32(1.0)))
    scalars = [pool.start('lane', SCALAR, (np.float32(i),)) for i in range(2)]
    calls = [forward, backward, *scalars]
    pool.wait_all(calls)
    if rep >= warmup:
      for gap, (a, b) in zip(found.values(), zip(calls, calls[1:])):
        gap.append(b.entered - a.ended)
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--reps', type=int, default=40)
  args = parser.parse_args()
  print(f'machine: {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f} at start')
  with LanePool(LanePlacement.parse('lane@cores=0'), verbose=False) as pool:
    found = gaps(pool, args.reps)
  print(f'{"between":22s}  median µs  p10    p90')
  for name, values in found.items():
    p10, median, p90 = np.percentile(values, [10, 50, 90]) * 1e6
    print(f'{name:22s}  {median:9.0f}  {p10:5.0f}  {p90:5.0f}')
  vjp = float(np.median(found['forward -> backward'])) * 1e6
  print(f'lane time between two queued calls after a VJP forward: {vjp:.0f} µs')


if __name__ == '__main__':
  main()
