"""ASGD / DC-ASGD on the scheduler: exact equivalences, hand-computed staleness, failures."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from async_helpers import batches, executor, pipeline, run_asgd, run_lpp, run_pd, run_with_timeout
from async_helpers import sequential_sgd
from jaxsgd.asynchronous import lppsgd, pdasgd
from jaxsgd.asynchronous import server


def test_one_worker_equals_sequential_sgd_bit_for_bit():
  pipe = pipeline(tx='adam')
  session, _, _ = run_asgd(1, 12, pipe=pipe)
  params, opt = sequential_sgd(pipe, batches(seed=0), 12)
  final = session.server.store.read().value
  chex.assert_trees_all_equal(final.params, params[0])
  chex.assert_trees_all_equal(final.opt_state[-1], opt[0])  # chain(base)'s state is base's
  assert session.server.store.staleness().tolist() == [0] * 12


def test_equal_speed_workers_have_staleness_m_minus_one():
  """Round one: staleness 0..M−1 (everyone pulled version 0); then exactly M − 1."""
  M, rounds = 5, 4
  session, timeline, _ = run_asgd(M, M * rounds)
  staleness = session.server.store.staleness().tolist()
  assert staleness[:M] == list(range(M))
  assert staleness[M:] == [M - 1] * (M * (rounds - 1))
  assert [u.lane for u in session.server.store.updates] == list(range(1, M + 1)) * rounds
  # Worker m's update of round r ends at r·(F + B + U) + m·U: F = 1, B = 2, U = 1/8.
  ends = [r.end for r in timeline.tasks(lane=0, kind='update')]
  assert ends == [r * 3.125 + m * 0.125 for r in range(1, rounds + 1) for m in range(M)]


def test_dcasgd_with_lambda_zero_equals_asgd_bit_for_bit():
  def run(**dc):
    settings = server.ServerSettings(3, **dc)
    ex = executor(speeds=(1.0, 1.0, 0.7, 0.45), straggler_std=0.4, seed=3)
    session, _, _ = run_asgd(3, 15, settings=settings, ex=ex)
    return session.server.store.read().value.params, session.server.store.staleness()

  asgd, asgd_staleness = run()
  assert len(set(asgd_staleness.tolist())) > 1  # Stragglers make it non-trivial.
  for adaptive in (False, True):
    dc, dc_staleness = run(delay_compensation=True, lambda0=0.0, adaptive=adaptive)
    chex.assert_trees_all_equal(dc, asgd)
    np.testing.assert_array_equal(dc_staleness, asgd_staleness)
  compensated, _ = run(delay_compensation=True, lambda0=50.0)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(compensated, asgd)


def _server(num_workers, settings, lr=0.5):
  w0 = {'w': jnp.array([1.0, -2.0, 3.0])}
  tx = server.server_optimizer(optax.sgd(lr), settings)
  return server.ParameterServer(
    tx, w0, num_workers, jax.devices()[0], record_pulls=settings.delay_compensation
  ), w0


def _push(ps, worker, grads, version):
  fn, args = ps.update_call(worker, grads, version)
  return ps.commit(worker, fn(*args), version, lane=1 + worker, batch=0)


def test_dcasgd_backup_is_the_pulled_model():
  """Worker 1 pulled w0; worker 0's push moves the server to w1; worker 1's push is
  compensated with w1 − w_bak(1) = w1 − w0 (Algorithm 2), λ constant."""
  lam, lr = 0.25, 0.5
  ps, w0 = _server(2, server.ServerSettings(2, delay_compensation=True, lambda0=lam), lr)
  ps.pull(0), ps.pull(1)
  g0, g1 = {'w': jnp.array([1.0, 2.0, -1.0])}, {'w': jnp.array([0.5, -1.0, 2.0])}
  _push(ps, 0, g0, 0)
  w1 = w0['w'] - lr * g0['w']
  record = _push(ps, 1, g1, 0)
  compensated = g1['w'] + lam * g1['w'] ** 2 * (w1 - w0['w'])
  np.testing.assert_allclose(ps.store.read().value.params['w'], w1 - lr * compensated, rtol=1e-6)
  assert record.staleness == 1
  backups = ps.store.read().value.opt_state[0].backups['w']
  np.testing.assert_array_equal(backups[0], w1)  # The reply to its push = its next pull.


def test_inverse_staleness_scales_the_stale_push():
  ps, w0 = _server(3, server.ServerSettings(3, staleness_lr='inverse'), lr=1.0)
  for m in range(3):
    ps.pull(m)
  g = {'w': jnp.array([4.0, 8.0, -2.0])}
  _push(ps, 0, g, 0)  # τ = 0 → scale 1
  _push(ps, 1, g, 0)  # τ = 1 → scale 1
  before = ps.store.read().value.params['w']
  assert _push(ps, 2, g, 0).staleness == 2
  np.testing.assert_allclose(before - ps.store.read().value.params['w'], g['w'] / 2, rtol=1e-6)
  np.testing.assert_allclose(before, w0['w'] - 2 * g['w'], rtol=1e-6)


def test_a_push_without_a_pull_is_refused():
  ps, _ = _server(2, server.ServerSettings(2, delay_compensation=True))
  with pytest.raises(
    ValueError,
    match=r'worker 1 pushed a gradient but never pulled: the server '
    r'records w_bak\(1\)',
  ):
    ps.update_call(1, {'w': jnp.ones(3)}, 0)
  ps.pull(1)
  with pytest.raises(ValueError, match=r'computed at version 3 but its last pull was version 0'):
    ps.update_call(1, {'w': jnp.ones(3)}, 3)


def test_virtual_clock_with_stragglers_is_bit_identical_run_to_run():
  def run():
    ex = executor(speeds=(1.0, 1.0, 0.5, 0.8), straggler_std=0.5, seed=11)
    session, timeline, _ = run_asgd(3, 10, ex=ex, tx='adam')
    return session, timeline

  (a, ta), (b, tb) = run(), run()
  chex.assert_trees_all_equal(a.server.store.read().value, b.server.store.read().value)
  assert a.server.store.updates == b.server.store.updates
  assert ta.records == tb.records


def test_a_failed_worker_stops_pushing_and_the_others_finish():
  session, _, log = run_asgd(3, 12, failures={1: 7.0})
  summary = log.summary()
  [failed] = summary['failed_workers']
  assert (failed['worker'], failed['failure_time']) == ('worker 1', 7.0)
  assert failed['last_push'] < 7.0 <= failed['stopped_at']
  assert max(log.pushes[0]) > 7.0 and max(log.pushes[2]) > 7.0
  lanes = [u.lane for u in session.server.store.updates]
  assert len(lanes) == 12 and lanes.count(2) == len(log.pushes[1]) == 2  # pushes at 3, 6.25


def _raising_stream(after):
  stream = batches(seed=1)
  for _ in range(after):
    yield next(stream)
  raise RuntimeError('worker data stream broke')


@pytest.mark.parametrize('clock', ['virtual', 'real'])
def test_a_worker_that_raises_stops_the_run(clock):
  streams = [batches(seed=0), _raising_stream(2), batches(seed=2)]
  # Far more steps than the run reaches: on the real clock a starved worker-1 thread must
  # not let the others finish every step before its stream breaks (seen under load).
  outcome = run_with_timeout(lambda: run_asgd(3, 5000, ex=executor(clock), streams=streams), 60)
  assert isinstance(outcome.get('error'), RuntimeError), outcome
  assert 'worker data stream broke' in str(outcome['error'])


def test_real_clock_threads_apply_exactly_the_steps_without_losing_updates():
  session, timeline, _ = run_asgd(3, 15, ex=executor('real'), tx='adam')
  updates = session.server.store.updates
  assert len(updates) == 15 and {u.lane for u in updates} == {1, 2, 3}
  assert int(session.server.store.read().value.opt_state[-1][0].count) == 15
  for lane in range(4):
    spans = timeline.tasks(lane=lane)
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize('policy', ['dcasgd', 'lppsgd', 'pdasgd'])
def test_no_implicit_host_device_transfer_in_a_run(policy):
  """Batches, constants and copies go through `jaxsgd.scheduler.transfer` (explicit).
  (The shared pipelines are built first: model initialization is not the hot path.)"""
  pipeline(), pipeline(3, hidden=(16, 16))
  runs = {
    'dcasgd': lambda: run_asgd(
      3, 6, settings=server.ServerSettings(3, staleness_lr='inverse', delay_compensation=True)
    ),
    'lppsgd': lambda: run_lpp(lppsgd.LppSettings(2, 2, averaging_freq=1), 8),
    'pdasgd': lambda: run_pd(pdasgd.PdSettings(1, 2), 6),
  }
  with jax.transfer_guard('disallow'):
    runs[policy]()


def test_weight_decay_is_folded_into_g_before_delay_compensation():
  """docs/algorithms.md (DC-ASGD): it squares g + wd·w, the gradient the optimizer steps with.

  λ0 = 1 (constant), wd = 1, w = 2, w_bak = 1, g = 1, SGD lr 1:
  g' = g + wd·w = 3;  g' + λ g'² (w − w_bak) = 3 + 9 = 12;  w ← 2 − 12 = −10.
  (Compensating before the decay would give 1 + 1 + 2 = 4, w ← −2.)
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxsgd import transforms  # pylint: disable=g-import-not-at-top
  from jaxsgd import optimizers  # pylint: disable=g-import-not-at-top

  opt = optimizers.OptimizerSettings('sgd', 1.0, schedule='constant', weight_decay=1.0)
  settings = server.ServerSettings(1, 'none', True, 1.0, False)
  tx = optimizers.make_optimizer(opt, 10, server.server_gradient_transforms(settings))
  w_bak, w = jnp.array([1.0]), jnp.array([2.0])
  state = transforms.record_pull(tx.init(w_bak), w_bak, 0)
  updates, _ = tx.update(jnp.array([1.0]), state, w, worker_id=0, staleness=1)
  assert float(updates[0]) == -12.0
