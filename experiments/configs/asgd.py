r"""ASGD / Hogwild! (parameter server, M asynchronous workers): the CNN on MNIST-1D.

    python -m experiments.train --config=experiments/configs/asgd.py --workdir=runs/asgd
    python -m experiments.train --config=experiments/configs/asgd.py:smoke --workdir=/tmp/asgd
    ... --config.workers=8 --config.algorithm.staleness_lr=inverse_sqrt
    ... --config.cost.worker_speeds='(1,1,1,0.25)' --config.cost.straggler_std=0.3
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

from experiments.configs import ddg
from experiments.configs import default


def async_fields(config: ml_collections.ConfigDict, stages: int = 1) -> None:
  """Clock and cost-model settings of the asynchronous algorithms.

  The `cost` sub-config of `ddg.scheduler_fields`, plus one speed factor per
  worker and failure injection; lanes are placed on devices by the algorithm
  (round-robin), so there is no `placement`.
  """
  ddg.scheduler_fields(config, stages)
  del config['placement']
  del config.cost['device_speeds']
  config.cost.worker_speeds = ()   # one factor per worker; () = all 1
  config.cost.failures = ()        # ((worker, seconds), ...): the worker stops then


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config('smoke' if variant == 'smoke' else '')
  config.algorithm = ml_collections.ConfigDict({'name': 'asgd', 'staleness_lr': 'none'})
  config.workers = 4
  async_fields(config)
  return apply_variant(config, variant, full_model='resnet20')


def apply_variant(config, variant: str, *, full_model: str) -> ml_collections.ConfigDict:
  """`smoke` (a small MLP: seconds on either clock, for tests) or `full` (CIFAR-10
  with `full_model` on GPUs: the papers' setting with our schedule)."""
  if variant == 'smoke':
    config.model = ml_collections.ConfigDict({'name': 'mlp', 'hidden': (64, 64, 64)})
    config.cost.reps = 2
    config.train_steps = 60
    config.eval_every = 20
  elif variant == 'full':
    default.full_size(config, model=full_model)
    config.clock = 'real'
  elif variant:
    raise ValueError(f'config variant {variant!r}: allowed are "", "smoke" and "full".')
  return config
