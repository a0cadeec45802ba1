"""Time to target is measured to 1 % of the run, and measuring it changes nothing else."""

import json

import pytest

from experiments import suites
from jaxsgd import training
from jaxsgd.training import run as run_lib


@pytest.mark.parametrize(
  'steps,period,every',
  [
    (2000, 1, 20),  # ceil(1 % of 2000)
    (667, 1, 7),  # ceil(6.67)
    (60, 1, 1),  # under 100 steps: every step
    (2000, 4, 20),  # 20 is a multiple of DaSGD's period already
    (2000, 8, 16),  # made a multiple of the period, still within 1 %
    (100, 4, 4),  # 1 step is less than a period: the period's end is the first known
  ],
)
def test_checks_are_one_percent_of_the_run_at_period_ends(steps, period, every):
  assert run_lib.target_check_every(steps, period) == every


def _config(path, data_dir, **overrides):
  config = suites.load_config(path, 'smoke')
  config.data_dir = data_dir
  config.update_from_flattened_dict(overrides)
  return config


def _records(workdir):
  """The metrics records without their wall times (the one thing a check may change)."""
  lines = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  return [{k: v for k, v in r.items() if k != 'wall_time'} for r in lines]


def test_checking_the_target_leaves_a_virtual_clock_run_bit_identical(data_dir, tmp_path):
  """DDG K = 2 on the virtual clock, with no target and with one never reached (a check
  every step): every loss, accuracy, simulated time and staleness is the same."""
  # Given costs, not measured ones: the same schedule, the test seconds faster.
  base = {
    'train_steps': 20,
    'eval_every': 10,
    'stages': 2,
    'cost.calibrate': False,
    'cost.compute.forward': 1e-3,
    'cost.compute.backward': 2e-3,
    'cost.compute.update': 1e-4,
  }
  plain = training.train_and_evaluate(
    _config('experiments/configs/ddg.py', data_dir, **base),
    str(tmp_path / 'plain'),
    show_progress=False,
  )
  checked = training.train_and_evaluate(
    _config('experiments/configs/ddg.py', data_dir, target_accuracy=0.999, **base),
    str(tmp_path / 'checked'),
    show_progress=False,
  )
  assert plain['target_checks'] == 0
  assert checked['target_checks'] == 20 - 2 and checked['time_to_target'] is None
  assert _records(tmp_path / 'checked') == _records(tmp_path / 'plain')
  assert [r['sim_time'] for r in _records(tmp_path / 'plain')][-1] > 0
  for key in ('mean_staleness', 'staleness_histogram'):
    assert checked[key] == plain[key]


def _first_at_target(records, target):
  return next(r for r in records if r['test_accuracy'] >= target)


@pytest.mark.parametrize(
  'path,overrides',
  [
    ('experiments/configs/default.py', {}),  # fused BP: a check every step (60 steps)
    # DaSGD's 4-step programs: a check every 4 steps (its first program's end).
    ('experiments/configs/dasgd.py', {'train_steps': 100, 'workers': 2, 'algorithm.stacked': True}),
  ],
)
def test_time_to_target_is_the_first_check_at_the_target(data_dir, tmp_path, path, overrides):
  """The crossing a run finds with checks is the one it would find evaluating at every
  check step: same step, same accuracy (the weights of that very step)."""
  every = run_lib.target_check_every(overrides.get('train_steps', 60), 4 if 'dasgd' in path else 1)
  dense = training.train_and_evaluate(
    _config(path, data_dir, eval_every=every, **overrides),
    str(tmp_path / 'dense'),
    show_progress=False,
  )
  dense_records = _records(tmp_path / 'dense')
  assert dense['target_checks'] == 0 and dense_records[0]['step'] == every
  target = dense_records[len(dense_records) // 2]['test_accuracy']  # reached by mid-run
  checked = training.train_and_evaluate(
    _config(path, data_dir, target_accuracy=target, **overrides),
    str(tmp_path / 'checked'),
    show_progress=False,
  )
  first = _first_at_target(dense_records, target)
  hit = checked['time_to_target']
  assert hit['step'] == first['step'] and hit['test_accuracy'] == first['test_accuracy']
  assert checked['target_resolution_steps'] == every
