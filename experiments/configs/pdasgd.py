r"""PD-ASGD (forward/backward workers, layer-wise updates): the CNN on MNIST-1D in 4 layers.

    python -m experiments.train --config=experiments/configs/pdasgd.py --workdir=runs/pdasgd
    python -m experiments.train --config=experiments/configs/pdasgd.py:smoke --workdir=/tmp/pd
    ... --config.algorithm.n_fwd=2 --config.algorithm.n_bwd=3
    ... --config.algorithm.updates=block       # the paper's ablation: whole-model updates
    ... --config.algorithm.max_inflight=1      # the token bound (default n_fwd + n_bwd)

`stages` = the layer groups with their own versioned store. 1 forward and 2
backward workers by default (backward ≈ 2 × forward, as calibrated here: the
ratio is in summary.json as `backward_forward_ratio`). `cost.speeds` and
`cost.failures` index the workers forward first, then backward.

Measured here (2-core shared CPU, mnist1d 40k/10k):
  full: ~26 s wall (4,000 steps, virtual clock),
    98.3 % test accuracy, mean staleness 1.25.
  smoke: ~2-4 s, 23 % test accuracy (60 steps of a small MLP on
    mnist1d/5k; the loss falls).

Full size (`pdasgd.py:full`, 3 GPUs, tfds cifar10 prepared): ResNet-18, CIFAR-10, 1:2
forward:backward workers, SGD momentum, step schedule, 160 epochs, real clock. Paper
(Teguemne Fokam et al. 2024): close to state-of-the-art accuracy, up to 2.97x faster than
LPP-SGD. Not run here (no GPU).
CPU-size comparison: `python -m experiments.compare --suite=pdasgd` (experiments/results/pdasgd).
"""

import ml_collections

from experiments.configs import asgd
from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = asgd.get_config()
  config.workers = 1  # Workers come from algorithm.n_fwd + n_bwd.
  config.algorithm = default.algorithm('pdasgd')
  config.stages = 4
  return default.apply_variants(config, variant, asgd.variants(full_model='resnet18'))
