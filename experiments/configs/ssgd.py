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
at cost.bandwidth_gbps). Runtime and accuracy on the 2-core CPU: see README.
Smoke variant: `ssgd.py:smoke`.

Reference: Goyal et al., Accurate, Large Minibatch SGD (2017), arXiv:1706.02677.
"""

import ml_collections

from experiments.configs import default


def data_parallel_fields(name: str) -> ml_collections.ConfigDict:
  """The `algorithm` sub-config shared by ssgd, local_sgd, dasgd and diloco."""
  return ml_collections.ConfigDict({
      'name': name,
      'period': 4,            # τ / H: local steps between averages (not ssgd)
      'delay': 1 if name == 'dasgd' else 0,  # d < τ: steps the average runs behind
      'merge': 'keep_local',  # DaSGD paper: w ← w̄ + (w − s); 'mix': p·w + (1 − p)·w̄
      'mix': 0.25,            # p for merge='mix' (DaSGD public code: 8/32)
      'overlap': True,        # the average is a top-level op XLA can overlap
      'stacked': False,       # True: all workers vmapped on one device
      'global_batch_size': ml_collections.config_dict.placeholder(int),  # else batch_size × workers
      'data_sharding': 'shard',  # 'shard': disjoint examples per worker; 'stream'
      'save_params': False,   # write params.npz (the evaluated model) at the end
      'outer': ml_collections.ConfigDict({  # DiLoCo's outer optimizer
          'name': 'sgd', 'learning_rate': 0.7, 'schedule': 'constant',
          'weight_decay': 0.0,
          'kwargs': ml_collections.ConfigDict({'momentum': 0.9, 'nesterov': True}),
      }),
  })


def cost_fields() -> ml_collections.ConfigDict:
  """The virtual clock's cost model (`jaxsgd.spmd.timing`)."""
  return ml_collections.ConfigDict({
      'step_time': ml_collections.config_dict.placeholder(float),  # None: measured once
      'bandwidth_gbps': 10.0,  # per link, Gbit/s
      'latency': 1e-5,         # per message, seconds
      'calibration_steps': 5,
  })


def apply_variants(config, variants: str, allowed: tuple[str, ...]):
  """Applies comma-separated variants (`smoke`, algorithm names) to `config`."""
  for variant in filter(None, variants.split(',')):
    if variant == 'smoke':
      config.dataset = 'mnist1d/5k'
      config.batch_size = 16
      config.train_steps = 40
      config.eval_every = 20
      config.cost.step_time = 0.002  # No calibration in smoke runs.
    elif variant == 'full':  # CIFAR-10 ResNet-20 on real devices, 128 per worker.
      default.full_size(config, model='resnet20')
      config.clock = 'real'
    elif variant in allowed:
      config.algorithm.name = variant
      config.algorithm.delay = 1 if variant == 'dasgd' else 0
    else:
      raise ValueError(f'config variant {variant!r}: allowed are "", "smoke", "full"'
                       + ''.join(f', "{a}"' for a in allowed) + ' (comma-separated).')
  return config


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config()
  config.algorithm = data_parallel_fields('ssgd')
  config.workers = 4
  config.batch_size = 32          # per worker; global 128
  config.train_steps = 3000
  config.eval_every = 500
  config.clock = 'virtual'
  config.cost = cost_fields()
  return apply_variants(config, variant, ())
