"""`train_and_evaluate(config, workdir)`: the library entry point of every experiment."""

import logging
import os
from typing import Any

import jax

from jaxsgd import algorithms
from jaxsgd import compilation_cache
from jaxsgd import data as data_lib
from jaxsgd import models as models_lib
from jaxsgd.algorithms.settings import number, refuse_unknown
from jaxsgd.scheduler import hardware
from jaxsgd.training import checkpoints
from jaxsgd.training import limits
from jaxsgd.training import workdir as workdir_lib
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
  'executor',
  'cluster_address',
  'cluster_timeout_s',
  'tolerate_lost_workers',
  'target_accuracy',
  'tensorboard',
  'placement',
  'cost',
  'checkpoint_every',
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
  if not hasattr(config.model, 'get'):
    raise ValueError(
      f"model: a sub-config with a name expected (e.g. {{'name': 'cnn'}}), got {config.model!r}."
    )
  if config.model.get('name') not in models_lib.MODELS:
    raise ValueError(
      f'model.name: unknown model {config.model.get("name")!r}; allowed: '
      f'{", ".join(models_lib.MODELS)}.'
    )
  models_lib.check_model_fields(config.model.name, _model_kwargs(config))
  data_lib.check_dataset_name(config.dataset)
  for field in ('tensorboard',):
    if not isinstance(config.get(field, False), bool):
      raise ValueError(f'{field}: True or False, got {config.get(field)!r}.')
  data_dir = config.get('data_dir')
  if data_dir is not None and (not isinstance(data_dir, str) or not data_dir):
    raise ValueError(
      f'data_dir: a directory path (or None: $TFDS_DATA_DIR or '
      f'~/tensorflow_datasets) expected, got {data_dir!r}.'
    )
  target = config.get('target_accuracy')
  if target is not None:
    number(target, 'target_accuracy', strict=True, maximum=1.0)
  algorithms.get(config.algorithm.get('name'))  # Unknown names fail here.


def _model_kwargs(config) -> dict:
  return {k: v for k, v in config.model.items() if k != 'name'}


def build_model(config, dataset: data_lib.Dataset) -> models_lib.StagedModel:
  return models_lib.get_model(
    config.model.name, dataset.input_shape, dataset.num_classes, **_model_kwargs(config)
  )


def check_batch_size(config, dataset: data_lib.Dataset) -> None:
  """Refuses a batch larger than the training split, before any model is built."""
  batch_size = config.batch_size
  if isinstance(batch_size, int) and batch_size > dataset.num_train:
    raise ValueError(
      f'batch_size: {batch_size} is larger than the {dataset.name} training '
      f'split ({dataset.num_train} examples); use 1 <= batch_size <= '
      f'{dataset.num_train}, or a larger dataset.'
    )


def check_worker_batches(settings, dataset: data_lib.Dataset) -> None:
  """Refuses a per-worker batch larger than the worker's shard (data-parallel methods
  with `algorithm.data_sharding='shard'`: each worker reads 1/workers of the data)."""
  if getattr(settings, 'data_sharding', None) != 'shard':
    return
  shard = dataset.num_train // settings.workers
  if settings.batch_size > shard:
    field = (
      'algorithm.global_batch_size' if settings.global_batch_size is not None else 'batch_size'
    )
    raise ValueError(
      f'{field}: {settings.batch_size} examples per worker, but each of the '
      f'{settings.workers} workers reads a shard of {shard} examples of the '
      f'{dataset.name} training split; use at most {shard} per worker, fewer '
      f'workers, or algorithm.data_sharding=stream.'
    )


def is_primary_process() -> bool:
  """Process 0 (the one that writes files), known before JAX starts its backend."""
  if jax.distributed.is_initialized():
    return jax.process_index() == 0
  return os.environ.get('JAXSGD_PROCESS_ID', '0') == '0'


def train_and_evaluate(
  config, workdir: str, *, show_progress: bool = True, overwrite: bool = False
) -> dict[str, Any]:
  """Trains `config.algorithm` on `config.dataset`, writing metrics and plots to `workdir`.

  In order, before anything compiles: the top-level fields are checked
  (`check_config`); the workdir is claimed (`training.workdir.claim`: locked, and
  refused if it holds another run's results unless `overwrite`); the data is loaded
  and the batch size checked against it; the model is described (not initialized);
  the algorithm's `validate` parses the config into the settings its `train` runs
  with; and `training.limits.check` refuses runs that cannot fit in memory or
  threads. A refusal leaves the workdir as it was (with `overwrite`, an earlier run's
  files are removed only after all of this passed). Writes `metrics.jsonl`,
  `summary.json` and `curves.png` (plus what the algorithm adds, e.g. `trace.json`).

  Returns:
    The summary (also written to `workdir/summary.json`).
  """
  compilation_cache.enable()  # before anything compiles: the model's init, op by op
  check_config(config)
  claim = workdir_lib.claim(config, workdir, primary=is_primary_process(), overwrite=overwrite)
  cluster = None  # lanes' Ray cluster, begun early (`_start_lane_cluster`)
  try:
    algorithm = algorithms.get(config.algorithm.name)
    dataset = data_lib.load(config.dataset, config.get('data_dir'))
    check_batch_size(config, dataset)
    model = build_model(config, dataset)
    settings = algorithm.validate(config, model)
    check_worker_batches(settings, dataset)
    limits.check(config.algorithm.name, settings, model, dataset)
    checkpointer = _checkpointer(config, settings, workdir)
    claim.clear()  # The input is valid: an earlier run's files (overwrite) go now.
    cluster = _start_lane_cluster(settings)
    logging.info(
      'Training %s on %s (%d train / %d test examples), model %s with %d layers.',
      config.algorithm.name,
      config.dataset,
      dataset.num_train,
      dataset.num_test,
      model.name,
      model.num_layers,
    )
    _say_what_prices(settings.shared)
    run = Run(
      config,
      workdir,
      dataset,
      model,
      show_progress=show_progress,
      lock=claim.lock,
      checkpointer=checkpointer,
      resume=claim.resume if checkpointer is not None else None,
      # A data-parallel period runs as one program: its weights are known at its end.
      program_period=getattr(settings, 'period', 1),
    )
    if checkpointer is not None and claim.resume is not None and run.is_primary:
      logging.info(
        'resuming from step %d (the checkpoint in %s).',
        claim.resume['step'],
        checkpoints.directory(workdir),
      )
  except BaseException:
    claim.release()
    if cluster is not None:
      cluster.abandon()
    raise
  try:
    with checkpoints.PreemptionWatch() as run.preemption:
      extra = algorithm.train(run, settings)
  except BaseException as error:
    run.abort(refused=isinstance(error, ValueError))
    raise
  finally:
    if cluster is not None:
      cluster.abandon()  # a cluster begun for lanes that never started
  return run.finish(extra)


def _say_what_prices(shared) -> None:
  """One line naming the hardware preset that prices the run's tasks (`cost.device`)."""
  device = shared.cost.device
  if device is None:
    return
  spec = hardware.preset(device)
  lanes = (
    f'every lane is a simulated {device}'
    if shared.clock == 'virtual'
    else f"every lane waits each task's {device} price (emulated)"
  )
  logging.info(
    "cost: tasks priced by the %s preset (roofline of XLA's operation counts: %g TFLOP/s, "
    '%g GB/s, %s); %s.',
    device,
    spec.peak_flops / 1e12,
    spec.memory_bandwidth / 1e9,
    spec.precision,
    lanes,
  )


def _start_lane_cluster(settings):
  """On lane processes: begins connecting to the run's Ray cluster (starting one here, or
  joining `cluster_address`) and starting its lanes' processes in the background, so that
  their seconds overlap building the model; returns the `lanes.cluster` module (None on
  other executors)."""
  shared = getattr(settings, 'shared', None)
  if shared is None or not shared.on_lane_processes:
    return None
  from jaxsgd.scheduler.lanes import LanePlacement, cluster  # Ray is imported only when used.

  if shared.emulated:  # its driver may time its tasks first: the lanes wait for that
    early = ()
  elif shared.placement.lanes is not None:  # as `clocks.make_executor` places them
    early = LanePlacement.parse(shared.placement.lanes).lanes
  else:  # as `ProcessExecutor` spreads the run's lanes
    early = LanePlacement.spread(shared.lanes).lanes if shared.lanes else ()
  cluster.connect_soon(shared.cluster_address, early)
  return cluster


def _checkpointer(config, settings, workdir: str) -> checkpoints.Checkpointer | None:
  """The run's checkpoints, if its algorithm writes them (`Settings.resumable`); refuses
  `checkpoint_every > 0` for one that does not."""
  every = settings.shared.checkpoint_every
  if not getattr(settings, 'resumable', False):
    if every:
      raise ValueError(
        f'checkpoint_every: {config.algorithm.name} writes no checkpoints (its '
        'Settings.resumable is False); use checkpoint_every=0.'
      )
    return None
  return checkpoints.Checkpointer(workdir, every=every, last=settings.shared.train_steps)
