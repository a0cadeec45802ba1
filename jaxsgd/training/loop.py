"""`train_and_evaluate(config, workdir)`: the library entry point of every experiment."""

import logging
from typing import Any

from jaxsgd import algorithms
from jaxsgd import data as data_lib
from jaxsgd import models as models_lib
from jaxsgd.training import optimizers
from jaxsgd.training.run import Run

CLOCKS = ('real', 'virtual')


def check_config(config) -> None:
  """Refuses settings shared by every experiment that cannot work; names the field."""
  for field in ('dataset', 'model', 'seed', 'batch_size', 'optimizer', 'train_steps',
                'eval_every', 'algorithm', 'stages', 'workers', 'clock'):
    if field not in config:
      raise ValueError(f'{field}: missing from the config; start from '
                       f'experiments/configs/default.py.')
  _positive_int(config, 'batch_size')
  _positive_int(config, 'train_steps')
  _positive_int(config, 'eval_every')
  _positive_int(config, 'stages')
  _positive_int(config, 'workers')
  if config.clock not in CLOCKS:
    raise ValueError(f'clock: {config.clock!r}; allowed: {", ".join(CLOCKS)}.')
  if config.model.get('name') not in models_lib.MODELS:
    raise ValueError(f'model.name: unknown model {config.model.get("name")!r}; allowed: '
                     f'{", ".join(models_lib.MODELS)}.')
  target = config.get('target_accuracy')
  if target is not None and not 0 < target <= 1:
    raise ValueError(f'target_accuracy: a fraction in (0, 1], got {target}.')
  optimizers.check_optimizer(config.optimizer)
  algorithms.get(config.algorithm.name)  # Unknown names fail here.


def _positive_int(config, field):
  value = config[field]
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{field}: must be a positive integer, got {value!r}.')


def build_model(config, dataset: data_lib.Dataset) -> models_lib.StagedModel:
  kwargs = {k: v for k, v in config.model.items() if k != 'name'}
  return models_lib.get_model(config.model.name, dataset.input_shape, dataset.num_classes,
                              **kwargs)


def train_and_evaluate(config, workdir: str, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.algorithm` on `config.dataset`, writing metrics and plots to `workdir`.

  Everything that can be checked is checked before data is loaded or anything is
  compiled. Writes `metrics.jsonl`, `summary.json` and `curves.png` (plus what the
  algorithm adds, e.g. `trace.json`).

  Returns:
    The summary (also written to `workdir/summary.json`).
  """
  check_config(config)
  algorithm = algorithms.get(config.algorithm.name)
  dataset = data_lib.load(config.dataset, config.get('data_dir'))
  model = build_model(config, dataset)
  models_lib.check_num_stages(model, config.stages)
  if config.workers != 1 and not algorithm.uses_workers:
    raise ValueError(f'workers: {config.algorithm.name} does not read `workers` (got '
                     f'{config.workers}); leave it at 1 (lppsgd: algorithm.devices and '
                     f'workers_per_device; pdasgd: algorithm.n_fwd and n_bwd).')
  algorithm.validate(config, model)
  logging.info('Training %s on %s (%d train / %d test examples), model %s with %d layers.',
               config.algorithm.name, config.dataset, dataset.num_train, dataset.num_test,
               model.name, model.num_layers)
  run = Run(config, workdir, dataset, model, show_progress=show_progress)
  try:
    extra = algorithm.run(run)
  finally:
    run.close()
  return run.finish(extra)
