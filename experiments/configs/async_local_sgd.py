r"""Asynchronous local SGD with Delayed Nesterov outer steps (Liu et al. 2024): M workers
each run H AdamW steps from the server's parameters and push their pseudo-gradient; the
server applies each on arrival, Nesterov momentum every N = M pushes.

    python -m experiments.train --config=experiments/configs/async_local_sgd.py --workdir=runs/alsgd
    python -m experiments.train --config=experiments/configs/async_local_sgd.py:smoke --workdir=/tmp/alsgd
    python -m experiments.train --config=experiments/configs/async_local_sgd.py:lm --workdir=runs/alsgd_lm
    ... --config.workers=8 --config.algorithm.inner_steps=16 --config.cost.speeds='(1,1,1,0.5)'

Virtual clock by default (a worker's forward, backward and inner update calibrated once on
this machine); `--config.clock=real` runs one thread per worker. `train_steps` counts
server updates, each H batches of one worker. Not yet measured at full size.
"""

import ml_collections

from experiments.configs import asgd
from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = asgd.get_config()
  config.algorithm = default.algorithm('async_local_sgd')
  # The paper's inner optimizer; a server update is H inner steps, so fewer of them.
  config.optimizer.name = 'adamw'
  config.train_steps = 500
  config.eval_every = 50
  return default.apply_variants(config, variant, asgd.variants(full_model='resnet20'))
