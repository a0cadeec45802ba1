r"""DDG (decoupled parallel backprop, Huo et al. 2018): the CNN in 4 stages on MNIST-1D.

    python -m experiments.train --config=experiments/configs/ddg.py --workdir=runs/ddg
    python -m experiments.train --config=experiments/configs/ddg.py:smoke --workdir=/tmp/ddg
    ... --config.algorithm.variant=paper|stale_graph|recompute
        # paper: Jacobian at the forward's weights (default); stale_graph: the public
        # code's (PyTorch autograd through the kept graph after in-place updates: the
        # forward's activations, the current weights); recompute: the forward again

Virtual clock by default: every stage is calibrated once on this machine and the
run is simulated on a 4-device cluster with free links (`sim_time` in
metrics.jsonl, the schedule in trace.json). `--config.clock=real` runs the same
updates on real devices (for several CPU devices set
`XLA_FLAGS=--xla_force_host_platform_device_count=4`).

Measured here (2-core CPU shared with other jobs, jax 0.10.2, seed 0):
  full:  28 s end to end (23 s of training + evaluation after data loading and
         calibration); test accuracy 98.37 % after 4000 steps (fused BP with
         default.py: 98.12 %); simulated time on 4 devices 6.8 s (staged BP,
         `default.py --config.stages=4 --config.clock=virtual`: 22.0 s);
         staleness per stage 3 / 2 / 1 / 0.
  smoke: 8 s end to end, 30.6 % test accuracy after 60 steps (chance: 10 %).

Full size (`ddg.py:full`, GPUs, tfds cifar10 prepared): ResNet-56, CIFAR-10, SGD momentum
0.9, wd 5e-4, lr 0.01 ÷10 at epochs 150 and 225 of 300, batch 128, real clock; K via
--config.stages=2|3|4. Paper (Huo et al. 2018), best test error %, K = 2, BP / DDG:
CIFAR-10 ResNet-56 6.97 / 6.89, ResNet-110 6.41 / 6.59. Not run here (no GPU).
CPU-size comparison: `python -m experiments.compare --suite=ddg` (experiments/results/ddg).
Language model: `ddg.py:lm` / `:lm_smoke` (default.py's `lm`), K via --config.stages=2|3|4.
"""

import ml_collections

from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config()
  config.algorithm = default.algorithm('ddg')
  config.stages = 4
  config.clock = 'virtual'
  return default.apply_variants(
    config, variant, {'smoke': default.smoke, 'full': full, **default.LM_VARIANTS}
  )


def full(config: ml_collections.ConfigDict) -> None:
  """The paper: ResNet-56/110, CIFAR-10/100, K = 2-4 on GPUs."""
  default.full_size(config, model='resnet56', epochs=300, learning_rate=0.01, weight_decay=5e-4)
