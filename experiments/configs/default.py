r"""Default: a small CNN trained with backprop on MNIST-1D (40,000 generated examples).

    python -m experiments.train --config=experiments/configs/default.py --workdir=runs/demo
    make demo                                       # the same

Runtime on a 2-core CPU: see README (measured). Reaches >= 95 % test accuracy.
Smoke variant (seconds, for tests): `--config=experiments/configs/default.py:smoke`.
"""

import ml_collections


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = 'mnist1d'          # 'mnist1d/50k': 40k train / 10k test, generated offline
  config.data_dir = ml_collections.config_dict.placeholder(str)  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets
  config.model = ml_collections.ConfigDict({'name': 'cnn'})
  config.seed = 0
  config.batch_size = 128
  config.optimizer = ml_collections.ConfigDict({
      'name': 'adam', 'learning_rate': 3e-3, 'schedule': 'cosine', 'weight_decay': 0.0,
      'kwargs': ml_collections.ConfigDict(),
  })
  config.train_steps = 4000
  config.eval_every = 500
  config.eval_batch_size = 1000
  config.algorithm = ml_collections.ConfigDict({'name': 'bp'})
  config.stages = 1
  config.workers = 1
  config.clock = 'real'
  config.target_accuracy = ml_collections.config_dict.placeholder(float)
  config.tensorboard = False
  if variant == 'smoke':
    config.dataset = 'mnist1d/5k'
    config.batch_size = 32
    config.train_steps = 60
    config.eval_every = 20
  elif variant:
    raise ValueError(f'config variant {variant!r}: allowed are "" and "smoke".')
  return config
