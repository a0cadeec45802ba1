r"""SSGD: synchronous data-parallel SGD over 4 workers (devices), CNN on MNIST-1D.

    python -m experiments.train --config=experiments/configs/ssgd.py --workdir=runs/ssgd
    # 2 processes x 2 devices, one JAX cluster (gloo on loopback):
    python -m jaxsgd.launch --processes 2 --devices_per_process 2 -- \
        --config=experiments/configs/ssgd.py --workdir=runs/ssgd_mp

Every step each worker takes `batch_size` (per worker) examples; gradients are
all-reduce-averaged (`lax.pmean`) and one update is applied to the replicated
weights: the global batch is batch_size × workers = 128, as in the default BP
run. Needs `workers` devices (the CPU fakes them: XLA_FLAGS=
--xla_force_host_platform_device_count=4) or `algorithm.stacked=True`.
Virtual clock: `sim_time` = steps × (compute + ring all-reduce of the gradients
at cost.link_bandwidth, bytes/s). Accuracy: benchmarks/results/ad_hoc_measurements.md.
Smoke variant: `ssgd.py:smoke`.

Reference: Goyal et al., Accurate, Large Minibatch SGD (2017), arXiv:1706.02677.
"""

import ml_collections

from experiments.configs import default


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config()
  config.algorithm = default.algorithm('ssgd')
  config.workers = 4
  config.batch_size = 32  # per worker; global 128
  config.train_steps = 3000
  config.eval_every = 500
  config.clock = 'virtual'
  config.cost.link_bandwidth = 1.25e9  # 10 Gbit/s, in bytes/s
  config.cost.link_latency = 1e-5
  return default.apply_variants(config, variant, variants())


def variants(names: tuple[str, ...] = ()) -> dict:
  """`smoke`, `full`, `lm`, `lm_smoke` and one variant per algorithm name in `names` (the
  data-parallel methods share this config)."""
  result = {
    'smoke': smoke,
    'full': lambda c: default.full_size(c, model='resnet20'),
    'lm': default.lm,
    'lm_smoke': lm_smoke,
  }
  for name in names:
    result[name] = lambda c, name=name: c.algorithm.update({'name': name})
  return result


def smoke(config: ml_collections.ConfigDict) -> None:
  default.smoke(config)
  config.batch_size = 16
  config.train_steps = 40
  config.cost.calibrate = False  # No calibration in smoke runs.
  config.cost.compute.step = 0.002


def lm_smoke(config: ml_collections.ConfigDict) -> None:
  """default.py's `lm_smoke`, 16 windows per worker, given costs as in `smoke`."""
  default.lm_smoke(config)
  config.cost.calibrate = False
  config.cost.compute.step = 0.002
