"""DDG and staged BP as experiments: smoke runs, determinism, bad input, NaN."""

import json

import pytest

from experiments.configs import ddg as ddg_config
from experiments.configs import default
from jaxsgd import training

EXPLICIT_COSTS = {
  'calibrate': False,
  'straggler_std': 0.3,
  'link_latency': 1e-5,
  'link_bandwidth': 1e9,
  'compute': {'forward': [1e-3, 2e-3, 1e-3], 'backward': 3e-3, 'update': 5e-4},
}


def smoke(data_dir, **overrides):
  config = ddg_config.get_config('smoke')
  config.data_dir = data_dir
  for field, value in overrides.items():
    parent, _, leaf = field.rpartition('.')
    (config[parent] if parent else config)[leaf] = value
  return config


def records(workdir):
  return [json.loads(line) for line in open(workdir / 'metrics.jsonl')]


def test_virtual_smoke_run_learns_and_is_bit_identical_run_to_run(data_dir, tmp_path):
  config = smoke(data_dir, stages=3)
  config.cost.update({k: v for k, v in EXPLICIT_COSTS.items() if k != 'compute'})
  config.cost.compute.update(EXPLICIT_COSTS['compute'])
  summaries = [
    training.train_and_evaluate(config, str(tmp_path / run), show_progress=False)
    for run in ('a', 'b')
  ]
  first, second = records(tmp_path / 'a'), records(tmp_path / 'b')
  drop_wall = lambda rs: [{k: v for k, v in r.items() if k != 'wall_time'} for r in rs]
  assert drop_wall(first) == drop_wall(second)  # Parameters, metrics and simulated times.
  assert summaries[0]['utilization'] == summaries[1]['utilization']
  assert [r['step'] for r in first] == [20, 40, 60]
  assert first[-1]['train_loss'] < first[0]['train_loss'] and first[-1]['test_loss'] < 2.3
  assert 0 < first[0]['sim_time'] < first[-1]['sim_time'] == summaries[0]['makespan']
  # Module k (1-indexed) has delay K − k: stage 0 of 3 applies gradients 2 writes old.
  assert [first[-1][f'staleness_max/stage{k}'] for k in range(3)] == [2, 1, 0]
  trace = json.load(open(tmp_path / 'a' / 'trace.json'))['traceEvents']
  rows = {e['args']['name'] for e in trace if e['name'] == 'thread_name'}
  assert {f'stage {k}' for k in range(3)} <= {name.split(' (')[0] for name in rows}
  assert (tmp_path / 'a' / 'staleness.png').stat().st_size > 5_000


@pytest.mark.parametrize('variant', ['stale_graph', 'recompute'])
def test_current_weight_forms_learn_and_report_both_delays(data_dir, tmp_path, variant):
  """The CNN's conv and dense stages through the public code's backward (stale graph) and
  the recompute form: the update's delay is the paper form's; its weights' age is 0."""
  summary = training.train_and_evaluate(
    smoke(data_dir, stages=3, **{'algorithm.variant': variant}), str(tmp_path), show_progress=False
  )
  got = records(tmp_path)
  assert got[-1]['train_loss'] < got[0]['train_loss'] and got[-1]['test_loss'] < 2.3
  assert [got[-1][f'staleness_max/stage{k}'] for k in range(3)] == [2, 1, 0]
  assert [got[-1].get(f'weight_staleness_mean/stage{k}') for k in range(3)] == [0.0, 0.0, None]
  assert summary['staleness']['stage 0']['max'] == 2


def test_real_clock_smoke_run_learns(data_dir, tmp_path):
  summary = training.train_and_evaluate(
    smoke(data_dir, clock='real', stages=2), str(tmp_path), show_progress=False
  )
  got = records(tmp_path)
  assert got[-1]['train_loss'] < got[0]['train_loss'] and got[-1]['test_loss'] < 2.3
  assert 'sim_time' not in got[-1] and summary['clock'] == 'real'
  assert (tmp_path / 'trace.json').exists() and (tmp_path / 'staleness.png').exists()


def test_staged_bp_on_the_virtual_clock_matches_fused_bp(data_dir, tmp_path):
  """default.py with --config.stages=4 --config.clock=virtual: the same numbers as fused BP."""

  def config(**overrides):
    c = default.get_config('smoke')
    c.data_dir, c.train_steps, c.eval_every = data_dir, 30, 30
    c.update(overrides)
    return c

  fused = training.train_and_evaluate(config(), str(tmp_path / 'fused'), show_progress=False)
  staged = training.train_and_evaluate(
    config(stages=4, clock='virtual'), str(tmp_path / 'staged'), show_progress=False
  )
  for key in ('train_loss', 'test_loss', 'test_accuracy'):
    assert staged['final'][key] == fused['final'][key], key
  assert staged['final']['sim_time'] > 0 and staged['cost_model_ms']['stage 3 backward'] > 0
  assert (tmp_path / 'staged' / 'trace.json').exists()


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'stages': 9}, r"stages: 9 stages asked for, but model 'cnn' has only 4 layers"),
    (
      {'algorithm.variant': 'eager'},
      r"algorithm.variant: 'eager' is not a DDG variant; "
      r'allowed: paper, stale_graph, recompute',
    ),
    ({'placement.devices': (0,)}, r'placement.devices: 1 devices listed for 4 stages'),
    ({'placement.stage_to_device': (0, 1, 0)}, r'placement.stage_to_device: 3 entries'),
    ({'cost.calibrate': False}, r'cost.compute.forward: missing'),
    (
      {
        'cost.calibrate': False,
        'cost.compute.forward': -1.0,
        'cost.compute.backward': 1.0,
        'cost.compute.update': 1.0,
      },
      r'cost.compute.forward: stage 0 cost must be .* >= 0',
    ),
    ({'cost.speeds': (1.0, 2.0)}, r'cost.speeds: 2 values for 4 stages'),
  ],
)
def test_bad_input_is_refused_before_anything_runs(data_dir, tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    training.train_and_evaluate(smoke(data_dir, **overrides), str(tmp_path), show_progress=False)
  assert not (tmp_path / 'metrics.jsonl').exists()


def test_unknown_local_variant_is_refused(data_dir, tmp_path):
  config = smoke(data_dir)
  config.algorithm = {'name': 'local', 'variant': 'lazy'}
  with pytest.raises(ValueError, match=r"algorithm.variant: 'lazy' is not a local-parallelism"):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)


def test_nan_loss_stops_the_run_naming_step_and_stage(data_dir, tmp_path):
  config = smoke(
    data_dir, **{'optimizer.name': 'sgd', 'optimizer.learning_rate': 1e12, 'stages': 2}
  )
  with pytest.raises(
    training.NonFiniteLossError,
    match=r'training loss became (nan|inf) at step \d+ at stage/worker stage 1',
  ):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
