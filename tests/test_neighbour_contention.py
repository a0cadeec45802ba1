"""benchmarks.neighbour_contention's core lists and placements, by hand."""

import argparse
import os

import numpy as np
import pytest

from benchmarks import neighbour_contention as nc


def test_parse_core_list_reads_the_kernels_format():
  assert nc.parse_core_list('0-3,8\n') == {0, 1, 2, 3, 8}
  assert nc.parse_core_list('5') == {5}


def test_physical_order_puts_one_core_per_physical_core_first(monkeypatch):
  # Four physical cores, hardware threads k and k + 4 siblings (a common numbering).
  monkeypatch.setattr(nc, 'thread_siblings', lambda core: {core % 4, core % 4 + 4})
  assert nc.physical_order([0, 1, 2, 3, 4, 5, 6, 7]) == [0, 1, 2, 3, 4, 5, 6, 7]
  # Siblings adjacent (k, k + 1): the first four lanes go to cores 0, 2, 4, 6.
  monkeypatch.setattr(nc, 'thread_siblings', lambda core: {core - core % 2, core - core % 2 + 1})
  assert nc.physical_order(list(range(8))) == [0, 2, 4, 6, 1, 3, 5, 7]
  assert nc.placements(list(range(8)), 4) == {'first': [0, 1, 2, 3], 'spread': [0, 2, 4, 6]}
  assert nc.placements(list(range(8)), 8) == {'first': list(range(8))}  # the same cores


def test_physical_order_keeps_the_order_where_sysfs_is_silent(monkeypatch):
  monkeypatch.setattr(nc, 'thread_siblings', lambda core: None)
  assert nc.physical_order([3, 1, 2]) == [3, 1, 2]


def test_per_core_marks_the_slowest():
  assert nc.per_core({1: 0.030, 0: 0.020}, 0.020) == '0:20.0(1.00) 1:30.0(1.50)*'


@pytest.mark.parametrize('text', ['0,1', '3', '', 'a'])
def test_counts_outside_the_cores_are_refused_in_one_line(text, capsys):
  parser = argparse.ArgumentParser()
  with pytest.raises(SystemExit):
    nc.counts_or_error(parser, text, 2)
  assert '--counts: comma-separated process counts in 1..2' in capsys.readouterr().err


def test_counts_are_sorted_and_deduplicated():
  assert nc.counts_or_error(argparse.ArgumentParser(), '2,1,2', 2) == [1, 2]


@pytest.mark.parametrize('family', ['--stages', '--pdasgd'])
def test_stages_need_bp_alone_as_their_reference(family, capsys):
  with pytest.raises(SystemExit):
    nc.main([family, '--counts=2'])
  assert f'--counts: with {family}, 1 (BP alone, the reference) and process counts' in (
    capsys.readouterr().err
  )


def test_one_family_at_a_time(capsys):
  with pytest.raises(SystemExit):
    nc.main(['--stages', '--pdasgd', '--counts=1'])
  assert '--stages, --pdasgd: one of them (DDG or PD-ASGD), not both' in capsys.readouterr().err


def test_a_pipeline_moves_at_its_slowest_stage_and_pdasgd_shares_its_backward_batches():
  # DDG: stages of 10, 30 and 20 ms: a batch every 30 ms.
  assert nc.pace('ddg', [0.010, 0.030, 0.020]) == 0.030
  # PD-ASGD 1:1: forward and update 10 ms, backward 30 ms: a batch every 30 ms.
  assert nc.pace('pdasgd', [0.010, 0.030]) == 0.030
  # 1:3: three backward workers of 30 and 36 ms share the batches: one every 12 ms, core
  # 0's forward and update (10 ms) faster: 12.
  assert nc.pace('pdasgd', [0.010, 0.030, 0.036, 0.030]) == pytest.approx(0.012)
  assert nc.pace('pdasgd', [0.020, 0.030, 0.036, 0.030]) == 0.020  # core 0's 20
  assert nc.pace('pdasgd', [0.200]) == 0.200  # N = 1: BP alone


def test_processes_time_together_as_often_as_asked_and_end_with_the_context():
  """Two pinned processes of a tiny tanh task: each `time()` releases both and returns a
  median per process; leaving the context ends both (none left running)."""
  shape = argparse.Namespace(layers=1, features=8, batch=2, depth=1, warmup=1, reps=3)
  cores = sorted(os.sched_getaffinity(0))[:2]
  with nc.Together(cores, shape) as together:
    processes = list(together.processes)
    rounds = [together.time(), together.time()]
  assert [len(medians) for medians in rounds] == [len(cores)] * 2
  assert all(seconds > 0 for medians in rounds for seconds in medians)
  assert all(process.poll() is not None for process in processes)


def test_local_stages_are_the_local_roles_tasks_with_an_auxiliary_loss(monkeypatch):
  """`local:K:k` is stage k of `local.roles(K)`: the first stage's forward returns its
  auxiliary head's loss, where DDG's first stage has none; the last stage is the model's
  loss in both. Each process gets a forward, a backward and an update."""
  from benchmarks import real_speedup

  for name in ('FEATURES', 'BATCH', 'HIDDEN'):  # (`stage_calls` sets them, in a worker)
    monkeypatch.setattr(real_speedup, name, getattr(real_speedup, name))
  shape = argparse.Namespace(layers=1, features=8, batch=4, depth=1, warmup=1, reps=1)

  def losses(stage):
    calls = nc.stage_calls(stage, shape)
    assert len(calls) == 3
    forward, forward_args = calls[0]
    return forward(*forward_args)[1]

  assert losses('ddg:2:0') is None
  aux = losses('local:2:0')
  assert np.isfinite(aux) and np.shape(aux) == ()
  assert np.isfinite(losses('ddg:2:1')) and np.isfinite(losses('local:2:1'))
