r"""DaSGD: local SGD with delayed averaging over 4 workers, CNN on MNIST-1D.

    python -m experiments.train --config=experiments/configs/dasgd.py --workdir=runs/dasgd
    python -m experiments.train --config=experiments/configs/dasgd.py:local_sgd ...
    python -m experiments.train --config=experiments/configs/dasgd.py:diloco ...
    python -m jaxsgd.launch --processes 2 --devices_per_process 2 -- \
        --config=experiments/configs/dasgd.py --workdir=runs/dasgd_mp

Each worker takes local steps on its own batches; every `algorithm.period` = 4
steps it snapshots its weights, and `algorithm.delay` = 1 step later merges the
average of the snapshots: w ← w̄ + (w − s) (`merge='keep_local'`, the paper).
Each period runs as one program with one all-reduce (of the snapshot, issued
before the period's compute), so it can overlap the `delay` steps before the merge;
the virtual clock hides up to `delay` steps of compute of it. Variants: `local_sgd`
(delay 0, Lin et al. 2018) and `diloco` (outer Nesterov SGD 0.7/0.9 on the
averaged pseudo-gradient, Douillard et al. 2023), `smoke`; combine with commas
(`dasgd.py:diloco,smoke`). Accuracy: benchmarks/results/ad_hoc_measurements.md.

Reference: Zhou et al., DaSGD (2020), arXiv:2006.00441.

Full size (`dasgd.py:full`, GPUs, tfds cifar10 prepared): ResNet-20, CIFAR-10, 4 workers of
128, SGD momentum, step schedule, 160 epochs, real clock. Paper (Zhou et al. 2020): converges
like SGD, 100 % of communication hidden, linear scale-up (analytic simulator, 256 V100s).
Not run here (no GPU).
CPU-size comparison: `python -m experiments.compare --suite=dasgd` (experiments/results/dasgd).
"""

import ml_collections

from experiments.configs import default
from experiments.configs import ssgd

ALGORITHMS = ('local_sgd', 'dasgd', 'diloco')


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = ssgd.get_config()
  config.algorithm = default.algorithm('dasgd')
  return default.apply_variants(config, variant, ssgd.variants(ALGORITHMS))
