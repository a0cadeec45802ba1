"""Data: shapes, determinism, worker streams, the tfds paths, and refused inputs."""

import hashlib

from etils import epath
import numpy as np
import pytest
import tensorflow_datasets as tfds

from jaxsgd import data
from jaxsgd.data import builders


@pytest.fixture(scope='module')
def mnist1d(data_dir):
  return data.load('mnist1d/5k', data_dir)


def test_offline_datasets_have_documented_shapes(data_dir, mnist1d):
  digits = data.load('digits', data_dir)
  assert (digits.num_train, digits.num_test, digits.input_shape) == (1438, 359, (8, 8, 1))
  assert (mnist1d.num_train, mnist1d.num_test, mnist1d.input_shape) == (4000, 1000, (40, 1))
  for ds in (digits, mnist1d):
    assert ds.num_classes == 10
    assert ds.train['image'].dtype == np.float32 and ds.train['label'].dtype == np.int32
    assert set(np.unique(ds.train['label'])) == set(range(10))
    # Standardized with the training split's statistics.
    np.testing.assert_allclose(ds.train['image'].mean(), 0.0, atol=1e-4)
    np.testing.assert_allclose(ds.train['image'].std(), 1.0, atol=1e-3)


def test_same_seed_same_batches_other_seed_other_batches(mnist1d):
  first = [next(mnist1d.train_batches(32, seed=3)) for _ in range(2)]
  np.testing.assert_array_equal(first[0]['image'], first[1]['image'])
  other = next(mnist1d.train_batches(32, seed=4))
  assert not np.array_equal(first[0]['label'], other['label'])
  assert first[0]['image'].shape == (32, 40, 1) and first[0]['label'].shape == (32,)


def test_each_worker_streams_its_own_order(mnist1d):
  streams = [mnist1d.train_batches(16, seed=0, worker=m, num_workers=3) for m in range(3)]
  labels = [next(s)['label'] for s in streams]
  assert not np.array_equal(labels[0], labels[1])
  assert not np.array_equal(labels[1], labels[2])


def test_shards_are_disjoint_and_cover_the_training_set(data_dir):
  digits = data.load('digits', data_dir)
  seen = []
  for m in range(4):
    stream = digits.train_batches(1, seed=0, worker=m, num_workers=4, sharding='shard')
    shard = [next(stream)['image'] for _ in range(stream.batches_per_epoch)]
    seen.append({img.tobytes() for img in np.concatenate(shard)})
  assert sum(map(len, seen)) == len(set.union(*seen))  # Disjoint...
  assert sum(map(len, seen)) >= digits.num_train - 8  # ...and (up to duplicates) complete.


def test_epoch_counter_and_reshuffle(data_dir):
  digits = data.load('digits', data_dir)
  stream = digits.train_batches(700, seed=0)  # 1438 examples: 2 full batches per epoch.
  epoch0 = [next(stream)['label'] for _ in range(2)]
  assert stream.epoch == 0
  epoch1 = next(stream)['label']
  assert stream.epoch == 1
  assert not np.array_equal(epoch0[0], epoch1)


def test_test_batches_cover_every_example_once(mnist1d):
  labels, total = [], 0.0
  for batch, mask in mnist1d.test_batches(300):  # 1000 = 3 * 300 + 100 (padded).
    assert batch['image'].shape == (300, 40, 1)
    labels.append(batch['label'][mask > 0])
    total += mask.sum()
  assert total == mnist1d.num_test
  np.testing.assert_array_equal(np.concatenate(labels), mnist1d.test['label'])


def test_unknown_dataset_is_refused_with_the_allowed_names(data_dir):
  with pytest.raises(ValueError, match=r"dataset: unknown dataset 'no_such_set'.*mnist1d.*cifar10"):
    data.load('no_such_set', data_dir)


def test_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"'mnist' is not prepared.*tfds build mnist"):
    data.load('mnist', str(tmp_path))


def test_batch_larger_than_the_dataset_is_refused(data_dir):
  digits = data.load('digits', data_dir)
  with pytest.raises(ValueError, match=r'batch_size: 5000 .* 1 <= batch_size <= 1438'):
    digits.train_batches(5000, seed=0)
  with pytest.raises(ValueError, match=r'batch_size: 400 .*train shard of 360'):
    digits.train_batches(400, seed=0, worker=0, num_workers=4, sharding='shard')


def test_bad_worker_settings_are_refused(data_dir):
  digits = data.load('digits', data_dir)
  with pytest.raises(ValueError, match=r'worker: must be in \[0, 2\)'):
    digits.train_batches(8, seed=0, worker=2, num_workers=2)
  with pytest.raises(ValueError, match=r'sharding: must be one of'):
    digits.train_batches(8, seed=0, sharding='round_robin')


def test_real_tfds_dataset_path_with_tfds_mock_data(tmp_path):
  """The `cifar10` path (uint8 images -> float, standardized) under tfds's own mocks."""
  with tfds.testing.mock_data(num_examples=48, policy=tfds.testing.MockPolicy.USE_CODE):
    ds = data.load('cifar10', str(tmp_path))
  assert ds.input_shape == (32, 32, 3) and ds.num_classes == 10
  assert ds.num_train == 48 and ds.num_test == 48
  batch = next(ds.train_batches(16, seed=0))
  assert batch['image'].dtype == np.float32 and batch['image'].shape == (16, 32, 32, 3)
  assert np.all((batch['label'] >= 0) & (batch['label'] < 10))


class TinyImages(tfds.core.GeneratorBasedBuilder):
  """A tiny MNIST-shaped dataset (uint8 images) that the test prepares itself."""

  VERSION = tfds.core.Version('1.0.0')
  # tfds looks for metadata next to the builder's package; tests are no package.
  pkg_dir_path = epath.Path(__file__).parent

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          'image': tfds.features.Tensor(shape=(6, 6, 1), dtype=np.uint8),
          'label': tfds.features.ClassLabel(num_classes=3),
        }
      )
    )

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(12), 'test': self._generate_examples(6)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {'image': np.full((6, 6, 1), 20 * i, np.uint8), 'label': i % 3}


def test_a_prepared_tfds_dataset_is_read_from_the_data_dir(tmp_path):
  TinyImages(data_dir=str(tmp_path), file_format='array_record').download_and_prepare()
  ds = data.load('tiny_images', str(tmp_path))
  assert (ds.num_train, ds.num_test, ds.input_shape, ds.num_classes) == (12, 6, (6, 6, 1), 3)
  # uint8 -> [0, 1] -> standardized: the ordering of the constant images is kept.
  means = ds.train['image'].reshape(12, -1).mean(axis=1)
  order = np.argsort(means)
  assert np.all(np.diff(means[order]) > 0)


def test_pydoc_bytes_is_next_byte_windows_of_the_recorded_text(data_dir):
  ds = data.load('pydoc_bytes/32', data_dir)
  text = builders.pydoc_text()
  assert ds.metadata['sha256'] == hashlib.sha256(text).hexdigest()
  assert ds.metadata['num_bytes'] == len(text)
  assert (ds.input_shape, ds.num_classes) == ((32,), 256)
  assert ds.train['image'].dtype == np.float32 and ds.train['label'].dtype == np.int32
  # The label of a position is the next position's input: next-byte prediction.
  np.testing.assert_array_equal(ds.train['image'][:, 1:], ds.train['label'][:, :-1])
  # The split by hand: 8,192-byte blocks, every 10th is test; 33-byte windows at stride 32.
  blocks = [text[i : i + 8192] for i in range(0, len(text), 8192)]
  for split, chosen in (
    (ds.train, [b for i, b in enumerate(blocks) if i % 10 != 9]),
    (ds.test, blocks[9::10]),
  ):
    windows = [b[32 * j : 32 * j + 33] for b in chosen for j in range((len(b) - 1) // 32)]
    tokens = np.concatenate([split['image'][:, :1], split['label']], axis=1).astype(np.uint8)
    assert sorted(map(bytes, tokens)) == sorted(windows)
  batch = next(ds.train_batches(8, seed=0))
  assert batch['image'].shape == (8, 32) and batch['label'].shape == (8, 32)


def test_an_offline_dataset_generated_on_first_use_says_so_in_one_line(tmp_path, capfd):
  """Nothing is downloaded, so none of tfds' words for a download reach the terminal
  ("Downloading and preparing dataset ...", its progress bars, its warning about a folder
  without dataset_info.json): one line says the dataset was generated; loading it again
  from the same data_dir says nothing."""
  capfd.readouterr()
  data.load('digits', str(tmp_path))
  out, err = capfd.readouterr()
  assert out == '' and 'Download' not in err and 'dataset_info' not in err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f'dataset: generated digits into {tmp_path}')
  data.pipeline._load_cached.cache_clear()  # pylint: disable=protected-access
  data.load('digits', str(tmp_path))
  assert capfd.readouterr() == ('', '')
