"""`streaming_diloco` as a data-parallel algorithm (SPMD trainer, 4 fake devices)."""

import json
import math

import chex
import jax
import numpy as np
import pytest
import spmd_helpers

from experiments.configs import streaming_diloco as streaming_config
from jaxsgd.algorithms import data_parallel
from jaxsgd.spmd import DataParallelTrainer
from jaxsgd.spmd import timing
from jaxsgd.training import train_and_evaluate

M, B, STEPS = 4, 8, 10


@pytest.fixture(scope='module')
def model():
  return spmd_helpers.small_mlp()


@pytest.fixture(scope='module')
def batches():
  """STEPS steps of per-worker batches: `batches[t][m]`."""
  return spmd_helpers.worker_batches(STEPS, M, B)


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
  trainer = DataParallelTrainer(
    model, data_parallel.make_optimizer(s), M, average_grads=False, stacked=s.stacked
  )
  state = trainer.init(config.seed)
  for t in range(STEPS):
    state, _ = trainer.train_step(state, trainer.put_batch(batches[t]))
  return jax.device_get(state.variables['params'])


@pytest.mark.parametrize('overlap', [True, False])
def test_one_fragment_no_delay_alpha0_equals_diloco_on_the_mesh(model, batches, overlap):
  """Bit for bit: the same transform helpers, the same compiled arithmetic."""
  streaming = _train(
    model,
    batches,
    _config('streaming_diloco', period=3, fragments=1, delay=0, mix=0.0, overlap=overlap),
  )
  diloco = _train(
    model, batches, _config('diloco', period=3, delay=0, merge='keep_local', overlap=overlap)
  )
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
  config.cost.link_bandwidth = 0.1e9 / 8  # 0.1 Gbit/s
  summary = train_and_evaluate(config, str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert all(math.isfinite(r['train_loss']) for r in records)
  assert records[-1]['train_loss'] < records[0]['train_loss'] < math.log(10)
  assert records[-1]['test_accuracy'] > 0.8  # Chance is 0.1.
  clock = timing.StepTimeModel(
    **{k: summary['time_model'][k] for k in ('compute', 'comm', 'period', 'delay')}
  )
  assert (clock.period, clock.delay) == (4, 1)  # H / P = 8 / 2; τ = 1.
  for r in records:
    assert r['sim_time'] == pytest.approx(clock.elapsed(r['step']), rel=1e-12)


@pytest.mark.parametrize(
  'fields, match',
  [
    (
      {'algorithm.fragments': 3},
      r'algorithm\.fragments: algorithm\.period=8 must be a '
      r'multiple of fragments=3',
    ),
    ({'algorithm.fragments': 0}, r'algorithm\.fragments: must be an integer >= 1'),
    ({'algorithm.delay': 4}, r'algorithm\.delay: must be < period / fragments = 4'),
    ({'algorithm.merge': 'keep_local'}, r"algorithm\.merge: streaming_diloco .*merge='mix'"),
    ({'algorithm.outer.name': 'nope'}, r'optimizer\.name'),
  ],
)
def test_bad_settings_are_refused(data_dir, tmp_path, fields, match):
  config = streaming_config.get_config('smoke')
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.update_from_flattened_dict(fields)
  with pytest.raises(ValueError, match=match):
    train_and_evaluate(config, str(tmp_path), show_progress=False)


# ------------------------------------------------- a whole cycle as one program.
RTOL, ATOL = 1e-6, 1e-7  # As tests/spmd/test_spmd_period.py (and why: see there).
CYCLES = [(4, 2, 1), (8, 4, 1), (6, 3, 0), (8, 2, 3)]  # (H, P, τ)


@pytest.fixture(scope='module')
def deep_model():
  from jaxsgd import models

  return models.get_model('mlp', (12,), 5, hidden=(16, 16, 16))  # 4 modules


def _streaming_trainer(model, period, fragments, delay, cycle, stacked=False):
  import optax
  from jaxsgd import transforms

  tx = transforms.streaming_diloco(
    optax.sgd(0.3),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    period=period,
    fragments=fragments,
    delay=delay,
    mix=0.5,
    axis_name='data',
  )
  program = dict(period=period, delay=delay, fragments=fragments) if cycle else {}
  return DataParallelTrainer(model, tx, M, average_grads=False, stacked=stacked, **program)


def _run(trainer, batches, steps=STEPS):
  state, losses, done = trainer.init(0), [], 0
  while done < steps:
    n = trainer.program_length(done, steps)
    state, step_losses = trainer.train_steps(state, batches[done : done + n])
    losses += step_losses
    done += n
  return jax.device_get((state.variables, state.opt_state)), np.asarray(jax.device_get(losses))


@pytest.mark.parametrize('stacked', [False, True], ids=['mesh', 'stacked'])
@pytest.mark.parametrize('period, fragments, delay', CYCLES)
def test_cycle_program_equals_per_step_program(
  deep_model, batches, stacked, period, fragments, delay
):
  batches = batches + batches  # 2 × STEPS steps: 2 or more cycles and a remainder.
  per_step = _run(
    _streaming_trainer(deep_model, period, fragments, delay, False, stacked), batches, 2 * STEPS
  )
  cycle = _run(
    _streaming_trainer(deep_model, period, fragments, delay, True, stacked), batches, 2 * STEPS
  )
  chex.assert_trees_all_close(cycle[0], per_step[0], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(cycle[1], per_step[1], rtol=RTOL, atol=ATOL)


def test_cycle_tolerance_can_fail(deep_model, batches):
  """τ = 1 against τ = 0 (a merge one step early) is far outside the tolerance."""
  a = _run(_streaming_trainer(deep_model, 4, 2, 1, True), batches)[0]
  b = _run(_streaming_trainer(deep_model, 4, 2, 0, True), batches)[0]
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('period, fragments, delay', CYCLES)
def test_one_allreduce_per_fragment_per_cycle(deep_model, batches, period, fragments, delay):
  from jaxsgd.spmd import hlo

  trainer = _streaming_trainer(deep_model, period, fragments, delay, True)
  state = trainer.init(0)
  text = (
    trainer.period_step.lower(
      state.variables, state.opt_state, trainer.put_batches(batches[:period])
    )
    .compile()
    .as_text()
  )
  assert hlo.collective_count(text) == {'top_level': fragments, 'in_loops': 0, 'in_conditionals': 0}
  sites = hlo.collective_inputs(text)
  if delay:  # Fragment 0's, issued first, reads only the snapshot the state holds.
    assert all(d.startswith('opt_state') and 'snapshot' in d for d in sites[0]), sites[0]
  # Together they carry every parameter once: each fragment only its own leaves.
  sizes = [_allreduced_elements(line) for line in text.splitlines() if ' all-reduce(' in line]
  n_params = sum(x.size for x in jax.tree.leaves(deep_model.init(jax.random.key(0))['params']))
  assert len(sizes) == fragments and sum(sizes) == n_params, (sizes, n_params)
  assert fragments == 1 or max(sizes) < n_params


def _allreduced_elements(line):
  """Elements of an all-reduce's result, e.g. `(f32[16]{0}, f32[12,16]{1,0}) all-reduce(`."""
  import re

  result_type = line.split('=', 1)[1].split(' all-reduce(')[0]
  return sum(
    int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
    for dims in re.findall(r'f32\[([\d,]*)\]', result_type)
  )
