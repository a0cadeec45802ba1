r"""The price of cutting a model into stages: fused jit step vs stage by stage.

    python -m benchmarks.step_time [--repeats=20]

For a CNN (MNIST-1D input) and ResNet-20 (CIFAR input), batch 128: the median time
of one training step (forward, backward, SGD-momentum update) as one fused
`jax.jit` function, against the same step run stage by stage for K = 1, 2, 4
(a jitted forward per stage returning `jax.vjp` residuals, a jitted backward per
stage, a jitted update per stage; what every layer-wise method pays). Last line:
`staged/fused ratio K=4: <x>` for ResNet-20.
"""

import argparse
import platform

import jax
import numpy as np
import optax

from benchmarks.common import median_time, print_table
from jaxsgd import models
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.algorithms import backprop

BATCH = 128
CASES = (('cnn', (40, 1)), ('resnet20', (32, 32, 3)))


def _batch(shape):
  rng = np.random.default_rng(0)
  return {
    'image': rng.normal(size=(BATCH,) + shape).astype(np.float32),
    'label': rng.integers(0, 10, BATCH).astype(np.int32),
  }


def fused_step_time(model, tx, batch, repeats):
  train_step = backprop.make_train_step(model, tx)
  state = {'vars': model.init(jax.random.key(0))}
  state['opt'] = tx.init(state['vars']['params'])

  def step():
    state['vars'], state['opt'], loss = train_step(state['vars'], state['opt'], batch)
    return loss, state['vars']

  return median_time(step, repeats=repeats)


def staged_step_time(model, tx, batch, num_stages, repeats):
  """Forward all stages, backward all stages (last to first), update each stage."""
  split = models.split(model, num_stages)
  fns = [stages_lib.make_stage_fns(s, input_grad=k > 0) for k, s in enumerate(split)]
  update = stages_lib.make_update(tx)
  variables = models.init_stages(model, split, jax.random.key(0))
  opt_states = [tx.init(v['params']) for v in variables]

  def step():
    vjps, h = [], batch['image']
    for k, f in enumerate(fns):
      if k < num_stages - 1:
        h, new_state, vjp = f.forward(variables[k], h)
      else:
        loss, new_state, vjp = f.loss_forward(variables[k], h, batch['label'])
      vjps.append(vjp)
      variables[k] = {**variables[k], **new_state}
    dy = np.float32(1.0)
    for k in reversed(range(num_stages)):
      grads, dy = fns[k].backward(vjps[k], dy)
      params, opt_states[k] = update(variables[k]['params'], opt_states[k], grads)
      variables[k] = {**variables[k], 'params': params}
    return loss, variables

  return median_time(step, repeats=repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=20)
  args = parser.parse_args()
  tx = optax.sgd(0.01, momentum=0.9)
  rows, ratio_k4 = [], None
  for name, shape in CASES:
    model = models.get_model(name, shape, 10)
    batch = _batch(shape)
    fused = fused_step_time(model, tx, batch, args.repeats)
    rows.append((name, 'fused', 1000 * fused, 1.0))
    for k in (1, 2, 4):
      staged = staged_step_time(model, tx, batch, k, args.repeats)
      rows.append((name, f'staged K={k}', 1000 * staged, staged / fused))
      ratio_k4 = staged / fused
  print(
    f'Training step time, batch {BATCH}, median of {args.repeats} after warm-up; '
    f'{jax.devices()[0].platform} ({platform.processor() or platform.machine()}), '
    f'jax {jax.__version__}'
  )
  print_table(('model', 'step', 'ms/step', 'ratio to fused'), rows)
  print(f'staged/fused ratio K=4: {ratio_k4:.2f}')


if __name__ == '__main__':
  main()
