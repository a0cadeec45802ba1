"""`train_and_evaluate(config, workdir)`: the library entry point of every experiment."""

import logging
from typing import Any

from jaxsgd import algorithms
from jaxsgd import data as data_lib
from jaxsgd import models as models_lib
from jaxsgd.algorithms.settings import number, refuse_unknown
from jaxsgd.training.run import Run

# The top-level fields of a config (every algorithm's); sub-configs are checked by the
# algorithm's `validate`.
FIELDS = (
  'dataset',
  'data_dir',
  'model',
  'seed',
  'batch_size',
  'optimizer',
  'train_steps',
  'eval_every',
  'eval_batch_size',
  'algorithm',
  'stages',
  'workers',
  'clock',
  'target_accuracy',
  'tensorboard',
  'placement',
  'cost',
)
REQUIRED = (
  'dataset',
  'model',
  'seed',
  'batch_size',
  'optimizer',
  'train_steps',
  'eval_every',
  'algorithm',
  'stages',
  'workers',
  'clock',
)


def check_config(config) -> None:
  """Refuses top-level settings that cannot work, naming the field (the algorithm's
  `validate` checks the rest)."""
  for field in REQUIRED:
    if field not in config:
      raise ValueError(
        f'{field}: missing from the config; start from experiments/configs/default.py.'
      )
  refuse_unknown(list(config.keys()), FIELDS, '')
  for field in ('eval_every', 'eval_batch_size'):
    value = config.get(field, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{field}: must be an integer >= 1, got {value!r}.')
  if config.model.get('name') not in models_lib.MODELS:
    raise ValueError(
      f'model.name: unknown model {config.model.get("name")!r}; allowed: '
      f'{", ".join(models_lib.MODELS)}.'
    )
  target = config.get('target_accuracy')
  if target is not None:
    number(target, 'target_accuracy', strict=True, maximum=1.0)
  algorithms.get(config.algorithm.get('name'))  # Unknown names fail here.


def build_model(config, dataset: data_lib.Dataset) -> models_lib.StagedModel:
  kwargs = {k: v for k, v in config.model.items() if k != 'name'}
  return models_lib.get_model(config.model.name, dataset.input_shape, dataset.num_classes, **kwargs)


def train_and_evaluate(config, workdir: str, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.algorithm` on `config.dataset`, writing metrics and plots to `workdir`.

  Everything that can be checked is checked before data is loaded or anything is
  compiled: the top-level fields here, the rest by the algorithm's `validate`, which
  parses the config once into the settings its `train` runs with. Writes
  `metrics.jsonl`, `summary.json` and `curves.png` (plus what the algorithm adds,
  e.g. `trace.json`).

  Returns:
    The summary (also written to `workdir/summary.json`).
  """
  check_config(config)
  algorithm = algorithms.get(config.algorithm.name)
  dataset = data_lib.load(config.dataset, config.get('data_dir'))
  model = build_model(config, dataset)
  settings = algorithm.validate(config, model)
  logging.info(
    'Training %s on %s (%d train / %d test examples), model %s with %d layers.',
    config.algorithm.name,
    config.dataset,
    dataset.num_train,
    dataset.num_test,
    model.name,
    model.num_layers,
  )
  run = Run(config, workdir, dataset, model, show_progress=show_progress)
  try:
    extra = algorithm.train(run, settings)
  finally:
    run.close()
  return run.finish(extra)
