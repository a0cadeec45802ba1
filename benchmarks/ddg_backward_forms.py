r"""What each DDG form's delayed backward costs: stored vjp, stale graph, recompute.

    python -m benchmarks.ddg_backward_forms [--rounds=5] [--repeats=5]

For a CNN (MNIST-1D input) and ResNet-20 (CIFAR input), batch 128, K = 2: the median
time of stage 0's forward and of its delayed backward in each form
(`algorithm.variant`): `paper` (the forward's `jax.vjp` residuals), `stale_graph`
(the public code's: every operation's vjp at the kept activations and the current
weights) and `recompute` (the forward again, then its vjp). The forms are timed in
turn, round after round, so they share the machine's load. Last line:
`stale_graph/paper backward ratio resnet20: <x>`.
"""

import argparse
import platform

import jax
import numpy as np
import optax

from benchmarks.common import median_time, print_table
from jaxsgd import models
from jaxsgd.algorithms import ddg
from jaxsgd.pipeline import PlacedStages
from jaxsgd.scheduler import Placement

BATCH = 128
CASES = (('cnn', (40, 1)), ('resnet20', (32, 32, 3)))
FORMS = ('paper', 'stale_graph', 'recompute')


def _calls(model, form):
  """Stage 0's jitted forward and delayed backward in `form`, with their arguments."""
  roles = ddg.roles(2, form)
  device = jax.devices()[0]
  stages = PlacedStages(
    model, 2, optax.sgd(0.1), placement=Placement.create(2, [device] * 2), batch_size=BATCH
  )
  ops = stages.ops(0, roles[0])
  variables = stages.initial_variables(0, roles[0])
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(BATCH,) + model.input_shape).astype(np.float32), device)
  dy = jax.device_put(np.ones(stages.outputs[0].shape, np.float32), device)
  _, _, _, residuals = ops.forward(variables, x, None)
  backward = {
    'paper': lambda: ops.backward(residuals, dy),
    'stale_graph': lambda: ops.stale_backward(residuals, variables, x, None, dy),
    'recompute': lambda: ops.recompute(variables, x, None, dy),
  }[form]
  return (lambda: ops.forward(variables, x, None)[:3]), backward


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  print(
    f'jax {jax.__version__}, {jax.devices()[0].platform}, {platform.processor() or "?"}; '
    f'batch {BATCH}, K = 2, stage 0; median ms over {args.rounds} interleaved rounds'
  )
  rows, ratio = [], None
  for name, shape in CASES:
    model = models.get_model(name, shape, 10)
    calls = {form: _calls(model, form) for form in FORMS}
    times = {(form, part): [] for form in FORMS for part in (0, 1)}
    for _ in range(args.rounds):
      for form in FORMS:
        for part in (0, 1):
          times[(form, part)].append(median_time(calls[form][part], repeats=args.repeats))
    median = {key: 1e3 * float(np.median(values)) for key, values in times.items()}
    for form in FORMS:
      rows.append(
        (name, form, median[(form, 0)], median[(form, 1)], median[(form, 1)] / median[('paper', 1)])
      )
    ratio = median[('stale_graph', 1)] / median[('paper', 1)]
  print_table(('model', 'form', 'forward ms', 'backward ms', 'backward / paper'), rows)
  print(f'stale_graph/paper backward ratio resnet20: {ratio:.2f}')


if __name__ == '__main__':
  main()
