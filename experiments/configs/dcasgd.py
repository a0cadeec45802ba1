r"""DC-ASGD (delay-compensated ASGD, Zheng et al. 2017): the CNN on MNIST-1D, 4 workers.

    python -m experiments.train --config=experiments/configs/dcasgd.py --workdir=runs/dcasgd
    python -m experiments.train --config=experiments/configs/dcasgd.py:smoke --workdir=/tmp/dc
    ... --config.algorithm.adaptive=False --config.algorithm.lambda0=0.04   # DC-ASGD-c
    ... --config.algorithm.lambda0=0.0                                      # = asgd, bit for bit

DC-ASGD-a by default (λ0 = 2, MeanSquare decay 0.95). Same cluster, clocks and
cost fields as experiments/configs/asgd.py; plain SGD, the optimizer of the
update rule in jaxsgd/asynchronous/server.py.

Measured here (2-core shared CPU, mnist1d 40k/10k):
  full: ~25 s wall (4,000 steps, virtual clock),
    97.2 % test accuracy (SGD 0.2, cosine).
  smoke: ~2-4 s, 22 % test accuracy (60 steps of a small MLP on
    mnist1d/5k; the loss falls).
"""

import ml_collections

from experiments.configs import asgd


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = asgd.get_config(variant)
  config.algorithm = ml_collections.ConfigDict({
      'name': 'dcasgd', 'lambda0': 2.0, 'adaptive': True, 'staleness_lr': 'none'})
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.2
  return config
