r"""ASGD / Hogwild! (parameter server, M asynchronous workers): the CNN on MNIST-1D.

    python -m experiments.train --config=experiments/configs/asgd.py --workdir=runs/asgd
    python -m experiments.train --config=experiments/configs/asgd.py:smoke --workdir=/tmp/asgd
    ... --config.workers=8 --config.algorithm.staleness_lr=inverse_sqrt
    ... --config.cost.speeds='(1,1,1,0.25)' --config.cost.straggler_std=0.3
    ... --config.cost.failures='((3, 2.0),)'     # worker 3 stops at simulated second 2

Virtual clock by default: a worker's forward/backward and the server's update
are calibrated once on this machine and the cluster (server + `workers` lanes,
free links unless `cost.link_latency`/`cost.link_bandwidth`) is simulated;
`--config.clock=real` runs one thread per worker on the fake CPU devices
(set `XLA_FLAGS=--xla_force_host_platform_device_count=8`).

Measured here (2-core shared CPU, mnist1d 40k/10k):
  full: ~27 s wall (4,000 steps, virtual clock,
    calibrated), 98.1 % test accuracy, 3.8 simulated s.
  smoke: ~2-4 s, 24 % test accuracy (60 steps of a small MLP on
    mnist1d/5k; the loss falls).
"""

import ml_collections

from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config()
  config.algorithm = default.algorithm('asgd')
  config.workers = 4
  config.clock = 'virtual'
  return default.apply_variants(config, variant, variants(full_model='resnet20'))


def variants(*, full_model: str) -> dict:
  """`smoke` (a small MLP: seconds on either clock, for tests), `full` (CIFAR-10 with
  `full_model` on GPUs: the papers' setting with our schedule), and the language model's
  `lm` and `lm_smoke` (default.py's), for the asynchronous configs."""
  return {
    'smoke': smoke,
    'full': lambda c: default.full_size(c, model=full_model),
    'lm': default.lm,
    'lm_smoke': lm_smoke,
  }


def smoke(config: ml_collections.ConfigDict) -> None:
  default.smoke(config)
  config.model = ml_collections.ConfigDict({'name': 'mlp', 'hidden': (64, 64, 64)})
  config.cost.reps = 2


def lm_smoke(config: ml_collections.ConfigDict) -> None:
  default.lm_smoke(config)
  config.cost.reps = 2
