r"""Time per iteration of `ddg` and `local` relative to `bp`, for K = 1, 2, 4, 8 stages.

    python -m benchmarks.pipeline_speedup            # a few minutes on a 2-core CPU

Virtual clock: each stage's forward, backward and update are timed once on this
machine (`PlacedStages.time_tasks`), links are free, and the schedule is simulated
on K devices; the tasks still run their real computations on synthetic batches.
Time per iteration is the steady-state period of the last stage's updates (the
pipeline fill excluded). The ideal speed-up over BP is K.

Real clock: the same runs on K fake CPU devices of this machine. They share its
cores (see docs/jax_on_cpu.md), so the real speed-up is capped near 1.
"""

import os

if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()

import time  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxsgd import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.algorithms import ddg, local  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.scheduler import CostModel, Placement, RealExecutor, VirtualExecutor  # pylint: disable=g-import-not-at-top,wrong-import-position

STAGES = (1, 2, 4, 8)


def synthetic_batches(shape, classes, batch_size, seed=0):
  rng = np.random.default_rng(seed)
  while True:
    yield {
      'image': rng.standard_normal((batch_size,) + shape).astype(np.float32),
      'label': rng.integers(0, classes, batch_size).astype(np.int32),
    }


def policies(num_stages):
  return {
    'bp': sequential_roles(num_stages),
    'ddg': ddg.roles(num_stages),
    'local': local.roles(num_stages, 'greedy'),
  }


def period(timeline, num_stages, steps) -> float:
  """Steady-state seconds per iteration: spacing of the last stage's updates, 2nd half."""
  ends = [r.end for r in timeline.tasks(lane=num_stages - 1, kind='update')]
  half = steps // 2
  return (ends[-1] - ends[half - 1]) / (steps - half)


def run_once(pipeline, roles, executor, batches, steps) -> float:
  feed = BatchFeed(batches, 1 + sum(r.loss != 'none' for r in roles))
  session = pipeline.session(roles, feed, steps)
  timeline = executor.run(session.cluster, session.processes())
  return period(timeline, pipeline.num_stages, steps)


def measure(model, num_stages, batch_size, steps, clocks=('virtual', 'real')):
  """{clock: {policy: seconds per iteration}} for one model cut into `num_stages`.

  `bp` and `ddg` share one pipeline (the same jitted calls, so the same timed
  costs); `local` has its own, with auxiliary heads (its costs include them).
  """
  placement = Placement.create(num_stages, jax.devices()[:num_stages])
  batches = synthetic_batches(model.input_shape, model.num_classes, batch_size)
  make = lambda aux: PlacedStages(
    model, num_stages, optax.sgd(0.01), placement=placement, batch_size=batch_size, aux_heads=aux
  )
  plain = make(False)
  with_heads = make(True) if num_stages > 1 else plain
  result = {clock: {} for clock in clocks}
  timed = {}
  for name, roles in policies(num_stages).items():
    pipeline = with_heads if name == 'local' else plain
    if id(pipeline) not in timed:  # Times (and compiles) every call once.
      timed[id(pipeline)] = CostModel(pipeline.time_tasks(roles, next(batches), reps=5))
    executors = {'virtual': VirtualExecutor(timed[id(pipeline)]), 'real': RealExecutor()}
    for clock in clocks:
      result[clock][name] = run_once(pipeline, roles, executors[clock], batches, steps)
  return result


def simulate_many_stages(num_stages=64, steps=8):
  """A 64-stage MLP on 64 simulated devices (all computed on this CPU)."""
  model = models.get_model('mlp', (64,), 10, hidden=(64,) * (num_stages - 1))
  placement = Placement.create(num_stages, jax.devices()[:1])
  pipeline = PlacedStages(model, num_stages, optax.sgd(0.01), placement=placement, batch_size=32)
  batches = synthetic_batches(model.input_shape, model.num_classes, 32)
  start = time.perf_counter()
  executor = VirtualExecutor(
    CostModel(pipeline.time_tasks(sequential_roles(num_stages), next(batches), reps=3))
  )
  compiled = time.perf_counter()
  bp = run_once(pipeline, sequential_roles(num_stages), executor, batches, steps)
  ddg_period = run_once(pipeline, ddg.roles(num_stages), executor, batches, 2 * num_stages + 8)
  return bp, ddg_period, compiled - start, time.perf_counter() - compiled


def table(rows, clock):
  lines = [
    f'{clock} clock'
    + (
      ' (timed here, free links)' if clock == 'virtual' else ' (fake CPU devices sharing 2 cores)'
    ),
    f'{"model":<10} {"K":>2} {"bp ms/it":>9} {"ddg ms/it":>10} {"ddg x":>6} '
    f'{"local ms/it":>12} {"local x":>8} {"ideal x":>8}',
  ]
  for model_name, num_stages, times in rows:
    t = times[clock]
    lines.append(
      f'{model_name:<10} {num_stages:>2} {1e3 * t["bp"]:>9.2f} {1e3 * t["ddg"]:>10.2f} '
      f'{t["bp"] / t["ddg"]:>6.2f} {1e3 * t["local"]:>12.2f} '
      f'{t["bp"] / t["local"]:>8.2f} {num_stages:>8.0f}'
    )
  return '\n'.join(lines)


def main():
  start = time.perf_counter()
  benchmarks = [
    ('resnet20', models.get_model('resnet20', (32, 32, 3), 10), 32),
    ('mlp', models.get_model('mlp', (784,), 10, hidden=(1024,) * 7), 128),
  ]
  rows = []
  for model_name, model, batch_size in benchmarks:
    for num_stages in STAGES:
      rows.append(
        (model_name, num_stages, measure(model, num_stages, batch_size, steps=2 * num_stages + 8))
      )
      print(
        f'  measured {model_name} K={num_stages} ({time.perf_counter() - start:.0f} s)', flush=True
      )
  print()
  print(table(rows, 'virtual'))
  print()
  print(table(rows, 'real'))
  bp64, ddg64, compile64, simulate64 = simulate_many_stages()
  print(
    f'\nmlp, K=64 simulated stages (virtual): bp {1e3 * bp64:.2f} ms/it, ddg '
    f'{1e3 * ddg64:.2f} ms/it, ddg x {bp64 / ddg64:.1f} (ideal 64); timing and '
    f'compiles {compile64:.0f} s, simulation of {2 * 64 + 8 + 8} iterations {simulate64:.0f} s'
  )
  resnet = {k: times for name, k, times in rows if name == 'resnet20'}
  print(f'\ntotal {time.perf_counter() - start:.0f} s')
  print(
    f'ddg speedup K=4 (virtual): {resnet[4]["virtual"]["bp"] / resnet[4]["virtual"]["ddg"]:.2f}'
  )


if __name__ == '__main__':
  main()
