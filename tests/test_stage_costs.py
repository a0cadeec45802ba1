"""benchmarks.stage_costs: its ceiling, its rounds' medians, its multiply-adds, its refusals."""

import argparse

import pytest

from benchmarks import stage_costs


def test_ceiling_is_bp_over_the_heaviest_stage():
  totals = {'ddg:1:0': 180.0, 'ddg:2:0': 100.0, 'ddg:2:1': 90.0}
  assert stage_costs.ceiling(totals, 2) == pytest.approx(1.8)
  assert stage_costs.parts(3) == ['ddg:1:0', 'ddg:3:0', 'ddg:3:1', 'ddg:3:2']
  assert [stage_costs.part_name(p) for p in stage_costs.parts(2)] == ['bp', 'stage 0', 'stage 1']


def test_median_rounds_takes_each_task_s_median():
  rounds = [
    {'ddg:1:0': {'ms': [1.0, 5.0, 0.1], 'macs': [2.0, 4.0, 1.0]}},
    {'ddg:1:0': {'ms': [3.0, 4.0, 0.3], 'macs': [2.0, 4.0, 1.0]}},
    {'ddg:1:0': {'ms': [2.0, 9.0, 0.2], 'macs': [2.0, 4.0, 1.0]}},
  ]
  median = {'ddg:1:0': {'ms': [2.0, 5.0, 0.2], 'macs': [2.0, 4.0, 1.0]}}
  assert stage_costs.median_rounds(rounds) == median


def test_pd_ceiling_is_bp_over_the_slower_worker():
  # forward 60 + update 2 on one worker, backward 110 on the other: 172 / 110
  assert stage_costs.pd_ceiling([60.0, 110.0, 2.0]) == pytest.approx(172.0 / 110.0)
  # a backward lighter than forward and update: the forward worker sets the pace
  assert stage_costs.pd_ceiling([60.0, 50.0, 20.0]) == pytest.approx(130.0 / 80.0)


def test_multiply_adds_count_a_first_stage_without_its_input_gradient(monkeypatch):
  """MLP 64-1024-1024-10, batch 64, K=2: `split` cuts it after the first layer, so stage 0
  is one 64x1024 layer — forward x·W and backward xᵀ·g only (a first stage computes no
  input gradient): 2 · 64 · 1024 multiply-adds an example; the tanh, the bias and the
  update add ~3 % (4k of 131k), a wrong count (its input gradient: +50 %; FLOPs: 2x;
  per batch: 64x) far more. Stage 1 (1024x1024 and 1024x10, its input gradient too): 3 ·
  (1024² + 10240)."""
  from benchmarks import neighbour_contention, real_speedup

  for name in ('FEATURES', 'BATCH', 'HIDDEN'):  # (`stage_calls` sets them, in a worker)
    monkeypatch.setattr(real_speedup, name, getattr(real_speedup, name))
  shape = argparse.Namespace(features=64, batch=64, depth=2)

  def macs(part):
    calls = neighbour_contention.stage_calls(part, shape)
    return sum(stage_costs.multiply_adds(fn, fn_args, shape.batch) for fn, fn_args in calls)

  assert macs('ddg:2:0') == pytest.approx(2 * 64 * 1024, rel=0.04)
  assert macs('ddg:2:1') == pytest.approx(3 * (1024**2 + 10240), rel=0.04)


@pytest.mark.parametrize(
  ('argv', 'line'),
  [
    (['--features=0'], "--features: comma-separated positive input counts; got '0'"),
    (['--features=a,2'], "--features: comma-separated positive input counts; got 'a,2'"),
    (['--lanes=1'], '--lanes: DDG stages, at least 2; got 1'),
    (['--lanes=4', '--depth=2'], '--depth: 4 stages need at least 3; got 2'),
    (['--reps=0'], '--reps: a positive integer; got 0'),
  ],
)
def test_bad_input_is_refused_in_one_line(argv, line, capsys):
  with pytest.raises(SystemExit):
    stage_costs.main(argv)
  assert line in capsys.readouterr().err


def test_table_shows_each_part_and_both_ceilings():
  figures = {
    'ddg:1:0': {'ms': [60.0, 110.0, 2.0], 'macs': [4e6, 8e6, 0.5e6]},
    'ddg:2:0': {'ms': [30.0, 50.0, 1.0], 'macs': [2e6, 3.75e6, 0.25e6]},
    'ddg:2:1': {'ms': [30.0, 55.0, 1.0], 'macs': [2e6, 4e6, 0.25e6]},
  }
  rows, ceilings, pd_ceilings = stage_costs.table({1472: [figures]}, 2)
  assert ceilings == {1472: pytest.approx(172.0 / 86.0)}
  assert pd_ceilings == {1472: pytest.approx(172.0 / 110.0)}
  assert rows[0] == (1472, 'bp', '60.00', '110.00', '2.00', '172.00', '12.50', '')
  assert rows[2] == (1472, 'stage 1', '30.00', '55.00', '1.00', '86.00', '6.25', '')
  assert rows[3] == (1472, 'ddg K=2 ceiling', '', '', '', '2.00', '', '2.00')
  assert rows[4] == (1472, 'pd 1:1 ceiling', '', '', '', '1.56', '', '1.56')
