r"""What the jaxsgd update rules cost on top of plain SGD.

    python -m benchmarks.transform_cost [--repeats=50]

For 1M and 10M float32 parameters (one leaf): the median time of one jitted
optimizer step, update AND apply fused in one `jax.jit`, params and optimizer
state donated, for `optax.sgd`, `dc_asgd` (constant and adaptive λ; the stale
params are an extra input) and `delayed_averaging` chained after SGD on
stacked params (4 workers × N/4, period 4, delay 1; with the average computed
every step, `overlap=True`, and only on merge steps, `overlap=False`). After
3 warm-up steps, the variants are timed in turn, one step each, `--repeats`
times (so all see the same background load); the median is reported, with
its ratio to `optax.sgd`. Last line: `dc_asgd_a/sgd ratio 10M: <x>`.

Memory traffic sets the floor (10M is memory-bound here): SGD reads g, w and
writes w (3 array passes); DC-ASGD-c also reads w_bak (4, floor 1.33x);
DC-ASGD-a also reads and writes MeanSquare (6, floor 2x). XLA:CPU emits the
two outputs of DC-ASGD-a (w and MeanSquare) as two loop fusions, the second
re-reading MeanSquare and g: 8 passes, 2.67x. The sqrt/divide is not the cost
(replacing it by a multiply changes the time by < 5%).
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import print_table
import jaxsgd.transforms as T

WORKERS = 4


def _variants():
  """name -> (optimizer, stacked params?, needs stale params?)."""
  return {
    'sgd': (optax.sgd(0.01), False, False),
    'dc_asgd_c': (T.dc_asgd(0.01), False, True),
    'dc_asgd_a': (T.dc_asgd(0.01, adaptive=True), False, True),
    'delayed_avg (overlap)': (
      optax.chain(optax.sgd(0.01), T.delayed_averaging(period=4, delay=1)),
      True,
      False,
    ),
    'delayed_avg (cond)': (
      optax.chain(optax.sgd(0.01), T.delayed_averaging(period=4, delay=1, overlap=False)),
      True,
      False,
    ),
  }


def _stepper(tx, n, stacked, stale):
  """A closure running one donated, fused update+apply step (not waited for)."""
  shape = (WORKERS, n // WORKERS) if stacked else (n,)
  key_w, key_g = jax.random.split(jax.random.key(0))
  params = jax.random.normal(key_w, shape, jnp.float32)
  grads = jax.random.normal(key_g, shape, jnp.float32)
  extra = {'stale_params': params + 0.01} if stale else {}

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads, extra):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  carry = [params, tx.init(params)]

  def one_step():
    carry[:] = step(carry[0], carry[1], grads, extra)
    return carry

  return one_step


def _interleaved_medians(steppers, repeats, warmup=3):
  """Median seconds per step, timing the variants in turn, one step each.

  The machine is shared; interleaving single steps exposes every variant to
  the same background load, which keeps the ratios stable.
  """
  for one_step in steppers.values():
    for _ in range(warmup):
      jax.block_until_ready(one_step())
  times = {name: [] for name in steppers}
  for _ in range(repeats):
    for name, one_step in steppers.items():
      start = time.perf_counter()
      jax.block_until_ready(one_step())
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=50)
  args = parser.parse_args()
  print(
    f'device: {jax.devices()[0].device_kind}, {jax.device_count()} '
    f'device(s); median of {args.repeats} interleaved steps per variant'
  )
  rows, ratio_10m = [], None
  for n, label in [(1_000_000, '1M'), (10_000_000, '10M')]:
    steppers = {
      name: _stepper(tx, n, stacked, stale) for name, (tx, stacked, stale) in _variants().items()
    }
    medians = _interleaved_medians(steppers, args.repeats)
    for name, seconds in medians.items():
      rows.append((label, name, seconds * 1e3, seconds / medians['sgd']))
    ratio_10m = medians['dc_asgd_a'] / medians['sgd']
  print_table(('params', 'transform', 'ms/step', 'ratio to sgd'), rows)
  print(f'dc_asgd_a/sgd ratio 10M: {ratio_10m:.2f}')


if __name__ == '__main__':
  main()
