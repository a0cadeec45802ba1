"""`streaming_diloco` as a data-parallel algorithm (SPMD trainer, 4 fake devices)."""

import json
import math

import chex
import jax
import numpy as np
import pytest

from experiments.configs import streaming_diloco as streaming_config
from jaxsgd.algorithms import data_parallel
from jaxsgd.spmd import DataParallelTrainer
from jaxsgd.spmd import timing
from jaxsgd.training import train_and_evaluate

M, B, STEPS = 4, 8, 10


@pytest.fixture(scope='module')
def model():
  from jaxsgd import models
  return models.get_model('mlp', (12,), 5, hidden=(16,))


@pytest.fixture(scope='module')
def batches():
  rng = np.random.default_rng(0)
  return [[{'image': rng.normal(size=(B, 12)).astype(np.float32),
            'label': rng.integers(0, 5, size=B).astype(np.int32)} for _ in range(M)]
          for _ in range(STEPS)]


def _config(name, **algorithm):
  config = streaming_config.get_config('smoke')
  config.algorithm.name = name
  config.optimizer.name, config.optimizer.schedule = 'sgd', 'constant'
  config.optimizer.learning_rate = 0.3
  config.workers, config.batch_size = M, B
  for key, value in algorithm.items():
    config.algorithm[key] = value
  return config


def _train(model, batches, config):
  s = data_parallel.settings(config)
  trainer = DataParallelTrainer(model, data_parallel.make_optimizer(config, s), M,
                                average_grads=False, stacked=s.stacked)
  state = trainer.init(config.seed)
  for t in range(STEPS):
    state, _ = trainer.train_step(state, trainer.put_batch(batches[t]))
  return jax.device_get(state.variables['params'])


@pytest.mark.parametrize('overlap', [True, False])
def test_one_fragment_no_delay_alpha0_equals_diloco_on_the_mesh(model, batches, overlap):
  """Bit for bit: the same transform helpers, the same compiled arithmetic."""
  streaming = _train(model, batches, _config('streaming_diloco', period=3, fragments=1,
                                             delay=0, mix=0.0, overlap=overlap))
  diloco = _train(model, batches, _config('diloco', period=3, delay=0, merge='keep_local',
                                          overlap=overlap))
  chex.assert_trees_all_equal(streaming, diloco)


def test_two_fragments_differ_from_diloco_and_stacked_equals_mesh(model, batches):
  fields = dict(period=4, fragments=2, delay=1, mix=0.5)
  mesh = _train(model, batches, _config('streaming_diloco', **fields))
  stacked = _train(model, batches, _config('streaming_diloco', stacked=True, **fields))
  chex.assert_trees_all_close(stacked, mesh, rtol=1e-6, atol=1e-7)
  diloco = _train(model, batches, _config('diloco', period=4, delay=1, merge='mix', mix=0.5))
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(mesh, diloco, rtol=1e-6, atol=1e-7)


def test_smoke_run_learns_and_the_clock_charges_one_fragment(data_dir, tmp_path):
  config = streaming_config.get_config('smoke')
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.optimizer.learning_rate = 1e-2
  config.cost.bandwidth_gbps = 0.1
  summary = train_and_evaluate(config, str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert all(math.isfinite(r['train_loss']) for r in records)
  assert records[-1]['train_loss'] < records[0]['train_loss'] < math.log(10)
  assert records[-1]['test_accuracy'] > 0.8  # Chance is 0.1.
  clock = timing.StepTimeModel(**{k: summary['time_model'][k]
                                  for k in ('compute', 'comm', 'period', 'delay')})
  assert (clock.period, clock.delay) == (4, 1)  # H / P = 8 / 2; τ = 1.
  for r in records:
    assert r['sim_time'] == pytest.approx(clock.elapsed(r['step']), rel=1e-12)


@pytest.mark.parametrize('fields, match', [
    ({'algorithm.fragments': 3}, r'algorithm\.fragments: algorithm\.period=8 must be a '
                                 r'multiple of fragments=3'),
    ({'algorithm.fragments': 0}, r'algorithm\.fragments: must be an integer >= 1'),
    ({'algorithm.delay': 4}, r'algorithm\.delay: must be < period / fragments = 4'),
    ({'algorithm.merge': 'keep_local'}, r"algorithm\.merge: streaming_diloco .*merge='mix'"),
    ({'algorithm.outer.name': 'nope'}, r'optimizer\.name'),
])
def test_bad_settings_are_refused(data_dir, tmp_path, fields, match):
  config = streaming_config.get_config('smoke')
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.update_from_flattened_dict(fields)
  with pytest.raises(ValueError, match=match):
    train_and_evaluate(config, str(tmp_path), show_progress=False)
