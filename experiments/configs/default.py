r"""Default: a small CNN trained with backprop on MNIST-1D (40,000 generated examples).

    python -m experiments.train --config=experiments/configs/default.py --workdir=runs/demo
    make demo                                       # the same

Measured on the project's 2-core CPU: 98.12 % test accuracy; 38 s including generating
the 50k dataset on first use (training alone 14.4 s, ~280 steps/s).
Smoke variant (seconds, for tests): `--config=experiments/configs/default.py:smoke`.

Language model (`:lm`, `:lm_smoke`, on every config of this folder): a byte-level
transformer on CPython's documentation text (`pydoc_bytes`, docs/language_models.md);
`test_loss` is in nats per byte, perplexity its exp, `test_accuracy` per byte. With
seed 0, `default.py:lm` ends at test loss 1.333 nats/byte (perplexity 3.79), 62.1 % of
bytes right (a uniform guess: ln 256 = 5.55).
"""

import dataclasses
import typing
from collections.abc import Callable

import ml_collections

from jaxsgd import algorithms
from jaxsgd.algorithms.settings import CostSettings, PlacementSettings
from jaxsgd.optimizers import OptimizerSettings

placeholder = ml_collections.config_dict.placeholder


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = 'mnist1d'  # 'mnist1d/50k': 40k train / 10k test, generated offline
  config.data_dir = placeholder(str)  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets
  config.model = ml_collections.ConfigDict({'name': 'cnn'})
  config.seed = 0
  config.batch_size = 128
  config.optimizer = from_settings(OptimizerSettings('adam', 3e-3, schedule='cosine'))
  config.train_steps = 4000
  config.eval_every = 500
  config.eval_batch_size = 1000
  config.algorithm = algorithm('bp')
  config.stages = 1
  config.workers = 1
  config.clock = 'real'
  # 'processes': each lane an OS process; 'emulated': those, each task waiting its priced
  # duration instead of computing (docs/engine.md)
  config.executor = 'in_process'
  config.cluster_address = placeholder(str)  # processes: a Ray cluster's 'host:port', or 'auto'
  config.cluster_timeout_s = 30.0  # how long cluster_address may take to answer
  config.tolerate_lost_workers = False  # processes, asgd/dcasgd: replace a lost worker's lane
  config.target_accuracy = placeholder(float)
  config.tensorboard = False
  config.placement = from_settings(PlacementSettings())
  config.cost = cost()
  config.checkpoint_every = 0  # steps between checkpoints in WORKDIR/checkpoints (0: none)
  return apply_variants(config, variant, {'smoke': smoke, **LM_VARIANTS})


def smoke(config: ml_collections.ConfigDict) -> None:
  """Seconds-long: the small MNIST-1D, small batches, 60 steps."""
  config.update_from_flattened_dict(
    {'dataset': 'mnist1d/5k', 'batch_size': 32, 'train_steps': 60, 'eval_every': 20}
  )


def lm(config: ml_collections.ConfigDict) -> None:
  """A language model at CPU size: a 4-block transformer (width 64, ~0.2M parameters)
  on 64-byte windows of `pydoc_bytes`, Adam 1e-3 with a cosine schedule, 2,000 steps of
  32 windows (2,048 predicted bytes a step). The stages of the split methods are cut
  between blocks (6 layers: embedding, 4 blocks, head)."""
  config.update_from_flattened_dict(
    {'dataset': 'pydoc_bytes/64', 'batch_size': 32, 'train_steps': 2000, 'eval_every': 250}
  )
  config.eval_batch_size = 256  # 256 windows of 64 bytes: logits of 4M floats.
  config.model = ml_collections.ConfigDict(
    {'name': 'transformer', 'width': 64, 'blocks': 4, 'heads': 4}
  )
  config.optimizer = from_settings(OptimizerSettings('adam', 1e-3, schedule='cosine'))


def lm_smoke(config: ml_collections.ConfigDict) -> None:
  """Seconds-long `lm`: 2 blocks of width 32 (4 layers: up to 4 stages), 32-byte
  windows, 16 a batch, 30 steps."""
  lm(config)
  config.update_from_flattened_dict(
    {'dataset': 'pydoc_bytes/32', 'batch_size': 16, 'train_steps': 30, 'eval_every': 10}
  )
  config.model.update({'width': 32, 'blocks': 2})
  config.optimizer.learning_rate = 3e-3


LM_VARIANTS = {'lm': lm, 'lm_smoke': lm_smoke}


# --- building configs: one variant parser, defaults from the settings dataclasses --------------
def apply_variants(
  config: ml_collections.ConfigDict,
  variants: str,
  handlers: dict[str, Callable[[ml_collections.ConfigDict], None]],
) -> ml_collections.ConfigDict:
  """Applies comma-separated variants (`'smoke'`, `'full,smoke'`) in order; one parser
  for every config file (`--config=path.py:variant`)."""
  for variant in filter(None, variants.split(',')):
    if variant not in handlers:
      raise ValueError(
        f'config variant {variant!r}: allowed are "", '
        + ', '.join(f'"{name}"' for name in handlers)
        + ' (comma-separated).'
      )
    handlers[variant](config)
  return config


def from_settings(settings) -> ml_collections.ConfigDict:
  """A sub-config with the fields and defaults of a settings dataclass instance (nested
  settings become sub-configs; `None` becomes a typed placeholder)."""
  config = ml_collections.ConfigDict()
  hints = typing.get_type_hints(type(settings))
  for field in dataclasses.fields(settings):
    if not field.init or not field.metadata.get('config', True):
      continue
    value = getattr(settings, field.name)
    if dataclasses.is_dataclass(value):
      config[field.name] = from_settings(value)
    elif value is None:
      config[field.name] = placeholder(_optional_type(hints[field.name]))
    elif field.name == 'kwargs':
      config[field.name] = ml_collections.ConfigDict(dict(value))
    else:
      config[field.name] = value
  return config


def _optional_type(hint):
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return typing.get_origin(args[0]) or args[0] if args else object


def algorithm(name: str, **overrides) -> ml_collections.ConfigDict:
  """`config.algorithm` of algorithm `name`: its `Settings` defaults, then `overrides`."""
  config = from_settings(algorithms.get(name).Settings())
  config.name = name
  config.update(overrides)
  return config


def cost(**overrides) -> ml_collections.ConfigDict:
  """`config.cost`: the one cost schema of every family (`CostSettings`)."""
  config = from_settings(CostSettings())
  del config['compute']  # A tuple of pairs in the settings; per kind here.
  config.compute = ml_collections.ConfigDict(
    {kind: placeholder(object) for kind in ('forward', 'backward', 'update', 'step')}
  )
  config.update(overrides)
  return config


def full_size(
  config: ml_collections.ConfigDict,
  *,
  model: str,
  dataset: str = 'cifar10',
  epochs: int = 160,
  batch_size: int = 128,
  learning_rate: float = 0.1,
  weight_decay: float = 1e-4,
  examples: int = 50_000,
) -> ml_collections.ConfigDict:
  """The paper-size setting: a CIFAR ResNet with SGD momentum 0.9 and a step schedule.

  The `step` schedule divides the learning rate by 10 at 50 % and 75 % of training
  (He et al. 2016; epochs 150 and 225 of 300 in the DDG paper). Needs the tfds
  dataset prepared in `data_dir` and, to be useful, GPUs: no CPU-size runtime.
  """
  config.dataset = dataset
  config.model = ml_collections.ConfigDict({'name': model})
  config.batch_size = batch_size
  config.optimizer = from_settings(
    OptimizerSettings(
      'sgd', learning_rate, schedule='step', weight_decay=weight_decay, kwargs=(('momentum', 0.9),)
    )
  )
  steps_per_epoch = examples // batch_size
  config.train_steps = epochs * steps_per_epoch
  config.eval_every = steps_per_epoch
  config.clock = 'real'
  return config
