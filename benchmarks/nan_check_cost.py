r"""What catching a NaN loss at the step it appears costs: `Run.report`'s loss checks.

    python -m benchmarks.nan_check_cost [--steps=400] [--rounds=5]

Fused BP (`bp`, one jitted step; the CNN on mnist1d/5k, batch 32: ~0.85 ms a step here),
reporting every step to a `Run` whose test evaluation happens only at the end. Three
ways to check the losses:

* `eval points only`: as before, the losses are pulled to the host at evaluation points
  only (a NaN at step 2 is seen at the first evaluation);
* `every 16 steps` (the default): the losses already computed are checked every 16
  steps without waiting (`jax.Array.is_ready`), all of them once 128 are pending;
* `every step, waiting`: each loss is pulled to the host at once (a device sync per
  step, what the default avoids).

The variants run in turn, `--rounds` times (so all see the same background load); the
table has the median seconds per step and the ratio to `eval points only`. Last line:
`every 16 steps / eval points only: <ratio>`.

Measured on the 2-core CPU (benchmarks/results/nan_check_cost.txt, three runs under a
background load of 5-7): the default's checks cost 0.5-3.4 % (within the noise); a sync
per step cost 42 % in one run and nothing measurable in two others: on this CPU, XLA
runs a step about as fast as Python dispatches it, so there is little to overlap. On an
accelerator, where dispatch runs ahead of the device, a sync per step stalls the
pipeline each step; the default never waits for a loss that is not computed yet.
"""

import argparse
import math
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import print_table
from experiments.configs import default
from jaxsgd import data as data_lib
from jaxsgd import optimizers
from jaxsgd.algorithms import backprop
from jaxsgd.algorithms.settings import optimizer_settings
from jaxsgd.training import build_model
from jaxsgd.training import run as run_lib

VARIANTS = {  # name -> (CHECK_EVERY_STEPS, CHECK_EVERY_S, WAIT_AFTER_STEPS)
  'eval points only': (10**12, math.inf, 10**12),
  'every 16 steps': (run_lib.CHECK_EVERY_STEPS, run_lib.CHECK_EVERY_S, run_lib.WAIT_AFTER_STEPS),
  'every step, waiting': (1, math.inf, 0),
}


def seconds_per_step(config, dataset, model, steps: int, checks: tuple) -> float:
  run_lib.CHECK_EVERY_STEPS, run_lib.CHECK_EVERY_S, run_lib.WAIT_AFTER_STEPS = checks
  config.train_steps = config.eval_every = steps
  with tempfile.TemporaryDirectory() as workdir:
    run = run_lib.Run(config, workdir, dataset, model, show_progress=False)
    tx = optimizers.make_optimizer(optimizer_settings(config.optimizer), steps)
    variables = model.init(jax.random.key(0))
    opt_state = tx.init(variables['params'])
    train_step = backprop.make_train_step(model, tx)
    batches = run.train_batches()
    batch_list = [next(batches) for _ in range(steps)]
    variables, opt_state, loss = train_step(variables, opt_state, batch_list[0])  # Compiled.
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for step, batch in enumerate(batch_list[:-1], 1):
      variables, opt_state, loss = train_step(variables, opt_state, batch)
      run.report(step, loss=loss, variables=variables, samples=step)
    jax.block_until_ready(loss)
    elapsed = time.perf_counter() - start
    run.abort()
  return elapsed / (steps - 1)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=400)
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args(argv)
  config = default.get_config('smoke')
  dataset = data_lib.load(config.dataset)
  model = build_model(config, dataset)
  saved = (run_lib.CHECK_EVERY_STEPS, run_lib.CHECK_EVERY_S, run_lib.WAIT_AFTER_STEPS)
  times = {name: [] for name in VARIANTS}
  try:
    for _ in range(args.rounds):
      for name, checks in VARIANTS.items():
        times[name].append(seconds_per_step(config, dataset, model, args.steps, checks))
  finally:
    run_lib.CHECK_EVERY_STEPS, run_lib.CHECK_EVERY_S, run_lib.WAIT_AFTER_STEPS = saved
  base = np.median(times['eval points only'])
  rows = [
    [name, 1e3 * float(np.median(t)), float(np.median(t) / base), len(t)]
    for name, t in times.items()
  ]
  print(f'fused bp, cnn on {config.dataset}, batch {config.batch_size}, {args.steps} steps a run')
  print_table(['losses checked', 'ms per step (median)', 'ratio', 'runs'], rows)
  ratio = np.median(times['every 16 steps']) / base
  print(f'every 16 steps / eval points only: {ratio:.3f}')


if __name__ == '__main__':
  main()
