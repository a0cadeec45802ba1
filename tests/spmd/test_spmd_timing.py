"""The virtual clock: ring all-reduce time and hiding by delay (metrics: test_spmd_train)."""

import dataclasses
import pytest

from jaxsgd.spmd import timing


def test_ring_allreduce_time_by_hand():
  # 2(M−1)/M · bytes·8/β + 2(M−1)·α = 1.5 · 8e6/1e10 + 6 · 1e-5
  t = timing.ring_allreduce_time(1e6, 4, bandwidth=1.25e9, latency=1e-5)
  assert t == pytest.approx(1.2e-3 + 6e-5, rel=1e-12)
  assert timing.ring_allreduce_time(1e6, 1, bandwidth=1.25e9, latency=1e-5) == 0


def test_dasgd_hides_up_to_delay_steps_of_compute():
  c = 0.1
  hidden = timing.StepTimeModel(compute=c, comm=0.2, period=4, delay=2)
  assert hidden.exposed_comm == 0 and hidden.relative_throughput() == 1
  partly = timing.StepTimeModel(compute=c, comm=0.25, period=4, delay=2)
  assert partly.exposed_comm == pytest.approx(0.05)
  assert partly.hidden_fraction() == pytest.approx(0.8)
  # Merges at steps 6 and 10 (t ≡ 2 mod 4, t >= 4); step 2 has no snapshot yet.
  assert [t for t in range(1, 12) if partly.is_merge_step(t)] == [6, 10]
  assert partly.elapsed(11) == pytest.approx(11 * c + 2 * 0.05)


@pytest.mark.parametrize('period, delay', [(1, 0), (4, 0), (4, 3), (5, 2)])
def test_elapsed_is_the_sum_of_step_times(period, delay):
  model = timing.StepTimeModel(compute=0.01, comm=0.05, period=period, delay=delay)
  for steps in range(0, 23):
    assert model.elapsed(steps) == pytest.approx(
      sum(model.step_time(t) for t in range(1, steps + 1))
    )


def test_ssgd_blocks_every_step():
  ssgd = timing.StepTimeModel(compute=0.01, comm=0.005)
  assert ssgd.elapsed(10) == pytest.approx(0.15)
  assert ssgd.relative_throughput() == pytest.approx(2 / 3)


@pytest.mark.parametrize('overlap,exposed', [(True, 0.0), (False, 0.004)])
def test_dasgd_hides_the_all_reduce_only_when_it_can_overlap(overlap, exposed):
  """overlap=False all-reduces inside a lax.cond on the merge step, which then waits."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments.configs import dasgd  # pylint: disable=g-import-not-at-top
  from jaxsgd.algorithms import data_parallel  # pylint: disable=g-import-not-at-top
  from jaxsgd.models import get_model  # pylint: disable=g-import-not-at-top

  config = dasgd.get_config('smoke')
  config.algorithm.overlap = overlap
  config.cost.compute.step = 0.01  # 1 step of compute covers the all-reduce below.
  s = data_parallel.settings(config)
  model = get_model('mlp', (40, 1), 10, hidden=(8,))
  variables = model.init(jax.random.key(0))
  clock = data_parallel.make_time_model(s, model, variables, None)
  clock = dataclasses.replace(clock, comm=0.004)
  # The merge stays `delay` steps after the snapshot either way; only its wait changes.
  assert clock.delay == 1 and clock.hidden_steps == (1 if overlap else 0)
  assert clock.exposed_comm == pytest.approx(exposed)
  assert [t for t in range(1, 13) if clock.is_merge_step(t)] == [5, 9]  # period 4


def test_ring_allreduce_bandwidth_inverts_the_time_by_hand():
  # 4 workers, 8 MB, 1 ms latency: 0.1 s leaves 0.1 - 6 ms = 0.094 s for
  # 2 * 3/4 * 8e6 = 1.2e7 bytes, so 1.2e7 / 0.094 bytes/s.
  beta = timing.ring_allreduce_bandwidth(0.1, 8e6, 4, latency=1e-3)
  assert beta == pytest.approx(1.2e7 / 0.094, rel=1e-12)
  assert timing.ring_allreduce_time(8e6, 4, bandwidth=beta, latency=1e-3) == pytest.approx(0.1)
  # The latency alone takes 6 ms: no bandwidth makes the all-reduce 5 ms long.
  assert timing.ring_allreduce_bandwidth(0.005, 8e6, 4, latency=1e-3) == float('inf')
  assert timing.ring_allreduce_bandwidth(0.1, 8e6, 1, latency=1e-3) == 0.0


def test_comm_budget_is_the_longest_all_reduce_for_a_throughput():
  # Period 4 steps of 0.5 s, 1 hidden: 90 % throughput allows 4 * 0.5 * (1/0.9 - 1)
  # = 0.2222 s exposed, so 0.5 + 0.2222 s of all-reduce.
  model = timing.StepTimeModel(compute=0.5, comm=0.0, period=4, delay=1)
  budget = model.comm_budget(0.9)
  assert budget == pytest.approx(0.5 + 2 / 9, rel=1e-12)
  at_budget = dataclasses.replace(model, comm=budget)
  assert at_budget.relative_throughput() == pytest.approx(0.9, rel=1e-12)


@pytest.mark.parametrize(
  'name, period, delay, fragments, synchronizations',
  [
    ('ssgd', 1, 0, 1, 28),  # every step
    ('diloco', 4, 0, 1, 7),  # steps 4, 8, ..., 28
    ('dasgd', 4, 1, 1, 6),  # merged at 5, 9, ..., 25 (29 is past the end)
    ('streaming_diloco', 8, 1, 2, 6),  # a fragment every 4 steps, merged at 5, ..., 25
  ],
)
def test_a_runs_communication_by_hand(name, period, delay, fragments, synchronizations):
  import types  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxsgd.algorithms import data_parallel  # pylint: disable=g-import-not-at-top

  s = types.SimpleNamespace(name=name, period=period, delay=delay, fragments=fragments)
  variables = {'params': {'w': np.zeros((10, 10), np.float32)}}  # 400 bytes
  sent = data_parallel.communication(s, variables, 28)
  assert sent == {
    'synchronizations': synchronizations,
    'steps_between_synchronizations': period // fragments,
    'bytes_per_synchronization': 400 / fragments,
    'bytes': synchronizations * 400 / fragments,
  }


@pytest.mark.parametrize('period, delay', [(1, 0), (4, 0), (4, 1), (4, 3), (8, 5)])
def test_merges_counts_the_merge_steps_and_elapsed_adds_their_waits(period, delay):
  model = timing.StepTimeModel(compute=0.5, comm=0.75, period=period, delay=delay, hidden=0)
  for steps in range(0, 30):
    merge_steps = [t for t in range(1, steps + 1) if model.is_merge_step(t)]
    assert model.merges(steps) == len(merge_steps)
    # Nothing hidden: every merge step waits the whole all-reduce.
    assert model.elapsed(steps) == pytest.approx(0.5 * steps + 0.75 * len(merge_steps))
  assert [t for t in range(1, 2 * period + 1) if model.is_merge_step(t)] == (
    [period + delay] if delay else [period, 2 * period]
  )
