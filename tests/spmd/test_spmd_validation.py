"""Bad settings are refused before anything compiles, with a message naming the field."""

import socket
import time

import jax
import pytest

from experiments.configs import dasgd as dasgd_config
from jaxsgd.spmd import distributed
from jaxsgd.training import train_and_evaluate


@pytest.fixture
def config(data_dir):
  config = dasgd_config.get_config('smoke')
  config.dataset, config.data_dir = 'digits', data_dir
  config.model.name = 'mlp'
  return config


@pytest.fixture
def compiles():
  """The number of XLA compilations while the test runs."""
  events = []
  listener = lambda event, *_, **__: events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  yield events
  jax.monitoring.unregister_event_duration_listener(listener)


def _compiled(events):  # a compilation, or one the persistent cache served
  served = '/jax/compilation_cache/cache_retrieval_time_sec'
  return [e for e in events if e in ('/jax/core/compile/backend_compile_duration', served)]


@pytest.mark.parametrize(
  'fields, match',
  [
    (
      {'algorithm.delay': 4, 'algorithm.period': 4},
      r'algorithm\.delay: must be < algorithm\.period',
    ),
    ({'algorithm.period': 0, 'algorithm.delay': 0}, r'algorithm\.period: must be an integer >= 1'),
    ({'workers': 9}, r'workers: 9 workers need 9 devices, but 8 are visible'),
    ({'algorithm.global_batch_size': 30}, r'algorithm\.global_batch_size: 30 .* workers=4'),
    ({'algorithm.name': 'local_sgd', 'algorithm.delay': 1}, r'algorithm\.delay: local_sgd'),
    ({'algorithm.merge': 'avg'}, r'algorithm\.merge: .*keep_local, mix'),
    ({'algorithm.data_sharding': 'x'}, r'algorithm\.data_sharding'),
    ({'algorithm.name': 'diloco', 'algorithm.outer.name': 'nope'}, r'optimizer\.name'),
    ({'cost.link_bandwidth': -1.0}, r'cost\.link_bandwidth'),
    ({'stages': 2}, r'stages: the data-parallel methods .* use stages=1'),
  ],
)
def test_bad_settings_are_refused_before_compiling(config, compiles, tmp_path, fields, match):
  config.update_from_flattened_dict(fields)
  with pytest.raises(ValueError, match=match):
    train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert not _compiled(compiles)
  assert not list(tmp_path.iterdir())  # Nothing written either.


def test_more_workers_than_devices_is_fine_when_stacked(config, tmp_path):
  config.workers, config.algorithm.stacked = 9, True
  config.train_steps = config.eval_every = 2
  summary = train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert summary['workers'] == 9 and summary['stacked']


def _closed_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.alone  # bounds the time to fail (5 s)
def test_unreachable_coordinator_fails_fast_and_names_it():
  env = {
    distributed.ADDRESS_VAR: f'127.0.0.1:{_closed_port()}',
    distributed.NUM_PROCESSES_VAR: '2',
    distributed.PROCESS_ID_VAR: '1',
    distributed.TIMEOUT_VAR: '1',
  }
  start = time.monotonic()
  with pytest.raises(
    distributed.CoordinatorUnreachableError,
    match=r'coordinator \(JAXSGD_COORDINATOR_ADDRESS.*within 1 s',
  ):
    distributed.initialize_from_env(env)
  assert time.monotonic() - start < 5
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
  'env, match',
  [
    ({distributed.ADDRESS_VAR: 'nohostport'}, 'expected host:port'),
    ({distributed.ADDRESS_VAR: 'h:1', distributed.NUM_PROCESSES_VAR: 'x'}, 'JAXSGD_NUM_PROCESSES'),
    (
      {
        distributed.ADDRESS_VAR: 'h:1',
        distributed.NUM_PROCESSES_VAR: '2',
        distributed.PROCESS_ID_VAR: '2',
      },
      'JAXSGD_PROCESS_ID: 2 is not <',
    ),
  ],
)
def test_bad_cluster_variables_are_named(env, match):
  with pytest.raises(ValueError, match=match):
    distributed.cluster_from_env(env)
