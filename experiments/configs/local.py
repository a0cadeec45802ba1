r"""Local parallelism (Laskin et al. 2020): the CNN in 4 blocks with local losses, MNIST-1D.

    python -m experiments.train --config=experiments/configs/local.py --workdir=runs/local
    python -m experiments.train --config=experiments/configs/local.py:smoke --workdir=/tmp/local
    ... --config.algorithm.variant=greedy|overlapping|chunked --config.algorithm.chunks=2
    ... --config.algorithm.pipelined=False      # the idealized lock-step
    ... --config.algorithm.agreement_every=100  # cos(local, backprop gradient) per block

Virtual clock by default (stages calibrated on this machine, free links); see
experiments/configs/ddg.py for the cost-model and placement fields.

Measured here (2-core CPU shared with other jobs, jax 0.10.2, seed 0):
  full (overlapping, pipelined): 45 s end to end; test accuracy 97.36 % after 4000
         steps (greedy: 96.13 %, 58 s; fused BP: 98.12 %); simulated time on 4
         devices 16.5 s, bounded by stage 2 (utilization 1.0: its own-loss and
         delayed backward both run there); staleness 1 / 1 / 1 / 0.
  smoke: 11 s end to end, 28.8 % test accuracy after 60 steps (chance: 10 %).

Full size (`local.py:full`, GPUs, tfds cifar10 prepared): CIFAR-10 ResNet-56, SGD momentum,
step schedule, 160 epochs, K = 4, real clock. Paper (Laskin et al. 2020): local methods
trade some accuracy at low compute for parallelism; overlapping beats greedy. Not run here.
CPU-size comparison: `python -m experiments.compare --suite=local` (experiments/results/local).
Language model: `local.py:lm` / `:lm_smoke` (per-position auxiliary heads: LayerNorm + linear).
"""

import ml_collections

from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config()
  config.algorithm = default.algorithm('local', variant='overlapping')
  config.stages = 4
  config.clock = 'virtual'
  return default.apply_variants(
    config,
    variant,
    {
      'smoke': default.smoke,
      'full': lambda c: default.full_size(c, model='resnet56'),
      **default.LM_VARIANTS,
    },
  )  # One block group per device.
