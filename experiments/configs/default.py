r"""Default: a small CNN trained with backprop on MNIST-1D (40,000 generated examples).

    python -m experiments.train --config=experiments/configs/default.py --workdir=runs/demo
    make demo                                       # the same

Measured on the project's 2-core CPU: 98.12 % test accuracy; 38 s including generating
the 50k dataset on first use (training alone 14.4 s, ~280 steps/s).
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


def full_size(config: ml_collections.ConfigDict, *, model: str, dataset: str = 'cifar10',
              epochs: int = 160, batch_size: int = 128, learning_rate: float = 0.1,
              weight_decay: float = 1e-4, examples: int = 50_000) -> ml_collections.ConfigDict:
  """The paper-size setting: a CIFAR ResNet with SGD momentum 0.9 and a step schedule.

  The `step` schedule divides the learning rate by 10 at 50 % and 75 % of training
  (He et al. 2016; epochs 150 and 225 of 300 in the DDG paper). Needs the tfds
  dataset prepared in `data_dir` and, to be useful, GPUs: no CPU-size runtime.
  """
  config.dataset = dataset
  config.model = ml_collections.ConfigDict({'name': model})
  config.batch_size = batch_size
  config.optimizer = ml_collections.ConfigDict({
      'name': 'sgd', 'learning_rate': learning_rate, 'schedule': 'step',
      'weight_decay': weight_decay, 'kwargs': ml_collections.ConfigDict({'momentum': 0.9})})
  steps_per_epoch = examples // batch_size
  config.train_steps = epochs * steps_per_epoch
  config.eval_every = steps_per_epoch
  return config
