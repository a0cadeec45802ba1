"""Loads a dataset through `tfds.data_source` and serves deterministic batches.

Every dataset, offline or from the user's tfds data_dir, is read with
`tfds.data_source` (array_record; no TensorFlow needed) into memory once, then
standardized with the training set's per-channel mean and standard deviation.
Batches are numpy dicts `{'image': float32[B, ...], 'label': int32[B]}`.

A text dataset (a `tokens` feature of `T + 1` token ids, e.g. `pydoc_bytes`) is served
in the same two keys for next-token prediction: `image` = `tokens[:, :-1]` as float32
(exact integers: every model and executor takes float32 inputs; the embedding casts
them back), `label` = `tokens[:, 1:]` as int32 `[B, T]`, one label per position; it is
not standardized, and `num_classes` is the vocabulary size.
"""

import contextlib
import dataclasses
import functools
import glob
import io
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from jaxsgd.data import builders

# Generated or bundled locally, prepared on first use.
OFFLINE_DATASETS = (
  'digits',
  'mnist1d',
  'mnist1d/50k',
  'mnist1d/5k',
  'pydoc_bytes',
  'pydoc_bytes/128',
  'pydoc_bytes/64',
  'pydoc_bytes/32',
)
# Real datasets read from the user's tfds data_dir (prepared beforehand).
TFDS_DATASETS = ('mnist', 'fashion_mnist', 'cifar10', 'cifar100')
KNOWN_DATASETS = OFFLINE_DATASETS + TFDS_DATASETS
SHARDING_MODES = ('stream', 'shard')
_ = builders  # Importing the module registers the offline builders with tfds.


def default_data_dir() -> str:
  return os.environ.get('TFDS_DATA_DIR') or os.path.expanduser('~/tensorflow_datasets')


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Both splits of a dataset in memory, standardized, with batch iterators."""

  name: str
  train: dict[str, np.ndarray]
  test: dict[str, np.ndarray]
  num_classes: int
  # What the builder recorded of its source (`pydoc_bytes`: source, num_bytes, sha256).
  metadata: dict = dataclasses.field(default_factory=dict, compare=False)

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.train['image'].shape[1:])

  @property
  def num_train(self) -> int:
    return len(self.train['label'])

  @property
  def num_test(self) -> int:
    return len(self.test['label'])

  def train_batches(
    self,
    batch_size: int,
    *,
    seed: int,
    worker: int = 0,
    num_workers: int = 1,
    sharding: str = 'stream',
  ) -> 'BatchIterator':
    """An endless, deterministic stream of training batches for one worker.

    Args:
      batch_size: examples per batch.
      seed: the run's seed; with `worker` and the epoch it fixes every shuffle.
      worker: this worker's index `m` in `[0, num_workers)`.
      num_workers: `M`, the number of workers reading the dataset.
      sharding: `'stream'` gives each worker the whole training set in its own
        shuffled order; `'shard'` gives worker `m` the disjoint shard of examples
        `m, m + M, m + 2M, ...`, reshuffled every epoch.
    """
    _check_worker(worker, num_workers, sharding)
    indices = np.arange(self.num_train)
    if sharding == 'shard':
      indices = indices[worker::num_workers]
    _check_batch_size(
      batch_size,
      len(indices),
      f'{self.name} train shard' if sharding == 'shard' else f'{self.name} train split',
    )
    return BatchIterator(self.train, indices, batch_size, seed=seed, worker=worker)

  def test_batches(self, batch_size: int) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """The test split in order, as `(batch, mask)` with the last batch padded.

    Padding keeps every batch the same shape (one compile); `mask` is 1.0 for real
    examples and 0.0 for padding, so nothing is dropped and nothing counted twice.
    """
    for start in range(0, self.num_test, batch_size):
      idx = np.arange(start, start + batch_size)
      mask = (idx < self.num_test).astype(np.float32)
      idx = np.minimum(idx, self.num_test - 1)
      yield {k: v[idx] for k, v in self.test.items()}, mask


class BatchIterator:
  """Endless batches from a fixed index set; reshuffled at each epoch.

  The order of epoch `e` is `default_rng([seed, worker, e]).permutation(indices)`,
  so a stream is reproducible from its seed alone. Incomplete final batches of an
  epoch are dropped (the next epoch starts fresh).
  """

  def __init__(self, arrays, indices, batch_size, *, seed, worker):
    self._arrays = arrays
    self._indices = indices
    self._batch_size = batch_size
    self._seed = seed
    self._worker = worker
    self.epoch = 0
    self._position = 0
    self._order = self._shuffled(0)

  def _shuffled(self, epoch):
    rng = np.random.default_rng([self._seed, self._worker, epoch])
    return rng.permutation(self._indices)

  @property
  def position(self) -> dict[str, int]:
    """Where the stream is: `{'epoch', 'offset'}` (JSON; `seek` returns to it exactly)."""
    return {'epoch': self.epoch, 'offset': self._position}

  def seek(self, position: dict[str, int]) -> None:
    """Continues from `position` (from `position` of a stream of the same arguments)."""
    epoch, offset = int(position['epoch']), int(position['offset'])
    if epoch < 0 or not 0 <= offset <= len(self._indices):
      raise ValueError(f'batch stream position: {position!r} is not a position of this stream.')
    self.epoch, self._position = epoch, offset
    self._order = self._shuffled(epoch)

  @property
  def batches_per_epoch(self) -> int:
    return len(self._indices) // self._batch_size

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._position + self._batch_size > len(self._order):
      self.epoch += 1
      self._position = 0
      self._order = self._shuffled(self.epoch)
    idx = np.sort(self._order[self._position : self._position + self._batch_size])
    self._position += self._batch_size
    return {k: v[idx] for k, v in self._arrays.items()}


def load(name: str, data_dir: str | None = None) -> Dataset:
  """Loads dataset `name` (see `KNOWN_DATASETS`) into memory, standardized.

  Offline datasets are generated into `data_dir` on first use. Real tfds datasets
  must already be prepared there in the array_record format.
  """
  data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
  try:
    return _load_cached(name, data_dir)
  except PermissionError as error:  # a data_dir this user may not write or read
    raise ValueError(
      f'data_dir: {error.filename or data_dir}: {error.strerror}; choose a data_dir you can '
      'write (--config.data_dir=PATH).'
    ) from None


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, data_dir: str) -> Dataset:
  _check_name(name)
  builder_kwargs = {'file_format': 'array_record'}
  is_offline = name in OFFLINE_DATASETS
  try:
    with _generated_quietly(name, data_dir) if is_offline else contextlib.nullcontext():
      sources = tfds.data_source(
        name,
        split=['train', 'test'],
        data_dir=data_dir,
        download=is_offline,
        builder_kwargs=builder_kwargs,
      )
  except (
    AssertionError,
    KeyError,
    FileNotFoundError,
    tfds.core.registered.DatasetNotFoundError,
  ) as e:
    if is_offline:
      raise
    raise FileNotFoundError(_not_prepared_message(name, data_dir)) from e
  train, test = (_read_all(source) for source in sources)
  info = sources[0].dataset_info
  metadata = dict(info.metadata or {})
  if 'tokens' in info.features:
    return Dataset(name, train, test, info.features['tokens'].feature.num_classes, metadata)
  train, test = _standardize(train, test)
  return Dataset(name, train, test, info.features['label'].num_classes, metadata)


def _read_all(source) -> dict[str, np.ndarray]:
  examples = _read_examples(source)
  if examples and 'tokens' in examples[0]:
    return _next_token_pairs(np.asarray([ex['tokens'] for ex in examples], np.int32))
  images = np.stack([np.asarray(ex['image']) for ex in examples])
  labels = np.asarray([ex['label'] for ex in examples], np.int32)
  if images.dtype == np.uint8:
    images = images.astype(np.float32) / 255.0
  return {'image': images.astype(np.float32), 'label': labels}


def _next_token_pairs(tokens_NxT1: np.ndarray) -> dict[str, np.ndarray]:
  """Next-token prediction: input `tokens[:, :-1]` (float32), labels `tokens[:, 1:]`."""
  return {'image': tokens_NxT1[:, :-1].astype(np.float32), 'label': tokens_NxT1[:, 1:]}


def _read_examples(source) -> list:
  """Every example of `source`; batched reads are ~3x faster than one by one."""
  try:
    return source.__getitems__(range(len(source)))
  except TypeError:
    # tfds.testing.mock_data's source binds only `__getitem__` correctly.
    return [source[i] for i in range(len(source))]


def _standardize(train, test):
  """Per-channel standardization with the *training* split's statistics."""
  axes = tuple(range(train['image'].ndim - 1))
  mean = train['image'].mean(axis=axes)
  std = train['image'].std(axis=axes) + 1e-6
  scale = lambda split: {**split, 'image': ((split['image'] - mean) / std).astype(np.float32)}
  return scale(train), scale(test)


def check_dataset_name(name) -> None:
  """Refuses a dataset name that cannot be loaded, listing what is allowed (no data read).

  A name is `builder` or `builder/config`; for a builder with configs (e.g.
  `mnist1d/5k`), an unknown config is refused with the builder's configs.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(
      f'dataset: a dataset name expected, got {name!r}. Allowed: offline '
      f'{", ".join(OFFLINE_DATASETS)}, or a tfds dataset prepared in your '
      f'data_dir, e.g. {", ".join(TFDS_DATASETS)}.'
    )
  if name in KNOWN_DATASETS:
    return
  base, _, config = name.partition('/')
  base = base.split(':')[0]
  try:
    builder = tfds.builder_cls(base)
  except Exception:  # tfds raises several types for unknown names.
    builder = None
  if builder is None:
    raise ValueError(
      f'dataset: unknown dataset {name!r}. Allowed: offline '
      f'{", ".join(OFFLINE_DATASETS)} (generated locally), or a tfds '
      f'dataset prepared in your data_dir, e.g. {", ".join(TFDS_DATASETS)}.'
    )
  configs = [c.name for c in (getattr(builder, 'BUILDER_CONFIGS', None) or [])]
  if config and config.split(':')[0] not in configs:
    allowed = ', '.join(f'{base}/{c}' for c in configs) if configs else f'{base} (no configs)'
    raise ValueError(f'dataset: {name!r}: {base} has no config {config!r}; allowed: {allowed}.')


_check_name = check_dataset_name


@contextlib.contextmanager
def _generated_quietly(name: str, data_dir: str):
  """Loads an offline dataset without tfds' words for a download ("Downloading and
  preparing dataset ...", progress bars, a warning that a folder has no
  dataset_info.json): nothing is downloaded. Where it was generated (first use), one line
  of its own on stderr says so."""
  folder = os.path.join(data_dir, name.split('/')[0])
  prepared = lambda: set(glob.glob(os.path.join(folder, '**', 'dataset_info.json'), recursive=True))  # noqa: E731
  before, started = prepared(), time.perf_counter()
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  tfds.display_progress_bar(False)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  finally:
    tfds.display_progress_bar(True)  # (tfds' default; jaxsgd turns it off nowhere else)
    absl_logging.set_verbosity(verbosity)
  if prepared() - before:
    print(
      f'dataset: generated {name} into {folder} on first use, offline '
      f'({time.perf_counter() - started:.1f} s)',
      file=sys.stderr,
    )


def _not_prepared_message(name, data_dir):
  return (
    f'dataset: {name!r} is not prepared in the tfds data_dir {data_dir!r}. '
    f'jaxsgd reads it with tfds.data_source and never downloads at run time. '
    f'Prepare it once on a machine with network (TensorFlow installed), e.g. '
    f'`tfds build {name} --data_dir={data_dir} --file_format=array_record`, '
    f'copy the folder here, or set config.data_dir / TFDS_DATA_DIR to where it '
    f'is. Offline alternatives: {", ".join(OFFLINE_DATASETS)}.'
  )


def _check_worker(worker, num_workers, sharding):
  if num_workers < 1:
    raise ValueError(f'workers: must be >= 1, got {num_workers}.')
  if not 0 <= worker < num_workers:
    raise ValueError(f'worker: must be in [0, {num_workers}), got {worker}.')
  if sharding not in SHARDING_MODES:
    raise ValueError(f'sharding: must be one of {SHARDING_MODES}, got {sharding!r}.')


def _check_batch_size(batch_size, available, what):
  if not 1 <= batch_size <= available:
    raise ValueError(
      f'batch_size: {batch_size} is not allowed for the {what} of '
      f'{available} examples; use 1 <= batch_size <= {available} '
      f'(or fewer workers, or a larger dataset).'
    )
