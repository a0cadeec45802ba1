r"""DDG (decoupled parallel backprop, Huo et al. 2018): the CNN in 4 stages on MNIST-1D.

    python -m experiments.train --config=experiments/configs/ddg.py --workdir=runs/ddg
    python -m experiments.train --config=experiments/configs/ddg.py:smoke --workdir=/tmp/ddg

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
"""

import ml_collections

from experiments.configs import default


def scheduler_fields(config: ml_collections.ConfigDict, stages: int) -> None:
  """The stage count, clock, placement and cost-model settings of scheduler algorithms."""
  config.stages = stages
  config.clock = 'virtual'
  config.placement = ml_collections.ConfigDict({
      'devices': ml_collections.config_dict.placeholder(tuple),          # positions in jax.devices()
      'stage_to_device': ml_collections.config_dict.placeholder(tuple),  # default: round-robin
  })
  config.cost = ml_collections.ConfigDict({
      'calibrate': True,       # time each stage's jitted calls once on this machine
      'compute': ml_collections.ConfigDict({  # seconds (a number, or one per stage) if not
          'forward': ml_collections.config_dict.placeholder(object),
          'backward': ml_collections.config_dict.placeholder(object),
          'update': ml_collections.config_dict.placeholder(object),
      }),
      'device_speeds': (),     # one factor per stage (device); () = all 1
      'link_latency': 0.0,     # seconds per transfer
      'link_bandwidth': 0.0,   # bytes/s; 0 = free links
      'straggler_std': 0.0,    # sigma of the seeded log-normal per-task noise
      'seed': ml_collections.config_dict.placeholder(int),  # None: config.seed
      'reps': 5,               # calibration repetitions (the fastest counts)
  })


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = default.get_config('smoke' if variant == 'smoke' else '')
  config.algorithm = ml_collections.ConfigDict({'name': 'ddg', 'variant': 'paper'})
  scheduler_fields(config, stages=4)
  if variant == 'smoke':
    config.train_steps = 60
    config.eval_every = 20
  elif variant == 'full':  # The paper: ResNet-56/110, CIFAR-10/100, K = 2-4 on GPUs.
    default.full_size(config, model='resnet56', epochs=300, learning_rate=0.01,
                      weight_decay=5e-4)
    config.clock = 'real'
  elif variant:
    raise ValueError(f'config variant {variant!r}: allowed are "", "smoke" and "full".')
  return config
