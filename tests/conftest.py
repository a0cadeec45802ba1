"""Test set-up: 8 fake CPU devices (set before JAX starts) and a shared tfds data_dir."""

import os

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory) -> str:
  """One tfds data_dir per test session: offline datasets are generated once."""
  return str(tmp_path_factory.mktemp('tensorflow_datasets'))
