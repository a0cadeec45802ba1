r"""LPP-SGD (Hogwild! per device, replicas averaged): the CNN on MNIST-1D, 3 devices × 2.

    python -m experiments.train --config=experiments/configs/lppsgd.py --workdir=runs/lppsgd
    python -m experiments.train --config=experiments/configs/lppsgd.py:smoke --workdir=/tmp/lpp
    ... --config.algorithm.devices=8 --config.algorithm.workers_per_device=2

`algorithm.devices` replicas, `workers_per_device` Hogwild! workers sharing each
(they time-share the device: each runs at 1/W of its speed), full and
partitioned steps alternating after `warmup_steps`, replicas averaged every
`averaging_freq` updates (every update during the first and last `warmup_steps`
steps); see jaxsgd/asynchronous/lppsgd.py. `cost.speeds` has one factor
per worker (devices × workers_per_device). `workers` is not used.

Measured here (2-core shared CPU, mnist1d 40k/10k):
  full: ~20 s wall (4,000 steps, virtual clock),
    97.2 % test accuracy (mean of the replicas).
  smoke: ~2-4 s, 20 % test accuracy (60 steps of a small MLP on
    mnist1d/5k; the loss falls).
"""

import ml_collections

from experiments.configs import asgd
from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = asgd.get_config()
  config.workers = 1  # Workers come from algorithm.devices x workers_per_device.
  config.algorithm = default.algorithm('lppsgd', devices=3, warmup_steps=200)
  return default.apply_variants(
    config, variant, {**asgd.variants(full_model='resnet18'), 'smoke': smoke}
  )


def smoke(config: ml_collections.ConfigDict) -> None:
  asgd.smoke(config)
  config.algorithm.warmup_steps = 10
