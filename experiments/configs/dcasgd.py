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

Full size (`dcasgd.py:full`, GPUs, tfds cifar10 prepared): ResNet-20, CIFAR-10, 4 workers
(--config.workers=8), SGD momentum 0.9, wd 1e-4, lr 0.1 ÷10 at 50 % and 75 % of 160 epochs,
batch 128 per worker, real clock. Paper (Zheng et al. 2017), test error %: 4 workers -
sequential SGD 8.65, ASGD 9.27, SSGD 9.17, DC-ASGD-c 8.67, DC-ASGD-a 8.19; 8 workers -
ASGD 10.26, SSGD 10.10, DC-ASGD-c 9.27, DC-ASGD-a 8.57. Not run here (no GPU).
CPU-size comparison: `python -m experiments.compare --suite=dcasgd` (experiments/results/dcasgd).
"""

import ml_collections

from experiments.configs import asgd
from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = asgd.get_config()
  config.algorithm = default.algorithm('dcasgd', lambda0=2.0, adaptive=True)
  # CPU size: plain SGD (full size: SGD momentum, step schedule).
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.2
  return default.apply_variants(config, variant, asgd.variants(full_model='resnet20'))
