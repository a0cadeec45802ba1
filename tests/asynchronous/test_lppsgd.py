"""LPP-SGD: sequential equivalence, Hogwild! replay with partitioned steps, averaging."""

import math
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from async_helpers import UNIT, batches, executor, log_for, pipeline, run_lpp, sequential_sgd
from jaxsgd.algorithms import lppsgd as algorithms_lppsgd
from jaxsgd.asynchronous import common, lppsgd
from jaxsgd.pipeline.session import sequential_roles
from jaxsgd.scheduler.core import LoopState


def test_one_device_one_worker_equals_sequential_sgd_bit_for_bit():
  pipe = pipeline(tx='adam')
  settings = lppsgd.LppSettings(devices=1, workers_per_device=1, warmup_steps=100)
  session, _, _ = run_lpp(settings, 10, pipe=pipe)
  params, opt = sequential_sgd(pipe, batches(seed=0), 10)
  chex.assert_trees_all_equal(tuple(session.replicas[0].read().value), (params[0], opt[0]))
  chex.assert_trees_all_equal(session.variables()['params'], params[0])


def test_partition_masks_cover_every_parameter_exactly_once():
  params = {'a': jnp.zeros((3, 4)), 'b': jnp.zeros((5,)), 'c': jnp.zeros((2, 2))}
  masks = lppsgd.partition_masks(params, 3)
  total = jax.tree.map(lambda *ms: sum(m.astype(int) for m in ms), *masks)
  assert all((t == 1).all() for t in jax.tree.leaves(total))
  assert [sum(int(m.sum()) for m in jax.tree.leaves(mask)) for mask in masks] == [7, 7, 7]


def test_masked_update_writes_only_the_slice():
  params = {'w': jnp.arange(6.0)}
  update = lambda p, s, g: (jax.tree.map(lambda a, b: a - b, p, g), s)
  mask = {'w': jnp.array([False, True, True, False, False, False])}
  new, _ = lppsgd.make_masked_update(update, lambda p: ())(params, (), {'w': jnp.ones(6)}, mask)
  np.testing.assert_array_equal(new['w'], [0.0, 0.0, 1.0, 3.0, 4.0, 5.0])


# A 2-parameter problem cut into W = 2 slices: P0 = {w[0]}, P1 = {w[1]}. Numbers are exact
# in binary, so the hand results compare with ==.
W0 = {'w': jnp.array([1.0, 2.0])}
P0, P1 = lppsgd.partition_masks(W0, 2)


def _update(tx):
  """The full step, jitted (as the session's): `w ← w + tx.update(g)`."""

  @jax.jit
  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return update


def _grad(*values):
  return {'w': jnp.array(values)}


def test_momentum_full_then_two_partitioned_steps_by_hand():
  """SGD with momentum, η = 0.5, β = 0.5: t ← g + β t, w ← w − η t.

  full step,  g = [2, −4]:            t = [2, −4]               w = [0, 4]
  P0 step,    g = [4, 8] → [4, 0]:    t[0] = 4 + 1 = 5          w = [−2.5, 4]
              t[1] = −4 is kept (decayed to −2 it would be the zero gradient's momentum)
  P1 step,    g = [8, 4] → [0, 4]:    t[1] = 4 − 2 = 2, t[0] = 5 kept
                                      w = [−2.5, 4 − 1] = [−2.5, 3]
  (with t[1] decayed at the P0 step: t[1] = 4 − 1 = 3, w[1] = 2.5.)"""
  tx = optax.sgd(0.5, momentum=0.5)
  full = _update(tx)
  masked = lppsgd.make_masked_update(full, tx)
  w, state = full(W0, tx.init(W0), _grad(2.0, -4.0))
  chex.assert_trees_all_equal(
    (w['w'], state[0].trace['w']), (jnp.array([0.0, 4.0]), jnp.array([2.0, -4.0]))
  )
  w, state = masked(w, state, _grad(4.0, 8.0), P0)
  chex.assert_trees_all_equal(
    (w['w'], state[0].trace['w']), (jnp.array([-2.5, 4.0]), jnp.array([5.0, -4.0]))
  )
  w, state = masked(w, state, _grad(8.0, 4.0), P1)
  chex.assert_trees_all_equal(
    (w['w'], state[0].trace['w']), (jnp.array([-2.5, 3.0]), jnp.array([5.0, 2.0]))
  )


def test_adam_full_then_two_partitioned_steps_by_hand():
  """Adam, η = 1, β1 = 1/2, β2 = 3/8, ε = 0; the count t advances on every step:
      m ← β1 m + (1 − β1) g,  v ← β2 v + (1 − β2) g²,
      w ← w − η (m / (1 − β1^t)) / sqrt(v / (1 − β2^t)).

  t = 1, full, g = [7, 16]:  m = [3.5, 8], v = 5/8 [49, 256] = [30.625, 160]
         m̂ = [7, 16], v̂ = [49, 256]: w = [1, 2] − [1, 1] = [0, 1]
  t = 2, P0, g = [4, 5] → [4, 0]:
         m[0] = 1.75 + 2 = 3.75, v[0] = 3/8 · 30.625 + 5/8 · 16 = 21.484375
         m̂[0] = 3.75 / (3/4) = 5, v̂[0] = 21.484375 / (55/64) = 25: w[0] = 0 − 5/5 = −1
         m[1] = 8, v[1] = 160, w[1] = 1 kept
  t = 3, P1, g = [3, −1] → [0, −1]:
         m[1] = 4 − 0.5 = 3.5, v[1] = 3/8 · 160 + 5/8 · 1 = 60.625
         m̂[1] = 3.5 / (7/8) = 4, v̂[1] = 60.625 / (485/512) = 64: w[1] = 1 − 4/8 = 0.5
         (w[1]'s moments saw 2 of the 3 steps; its bias correction uses t = 3.)
         m[0] = 3.75, v[0] = 21.484375, w[0] = −1 kept."""
  tx = optax.adam(1.0, b1=0.5, b2=0.375, eps=0.0)
  full = _update(tx)
  masked = lppsgd.make_masked_update(full, tx)

  def check(w, state, expected_w, mu, nu, count):
    adam = state[0]  # The moments are exact; w is not: XLA's fused program does not round
    # m̂ / sqrt(v̂) as the exact quotient (w[0] = −4.5e−8 after step 1), so 1e-6 for w.
    chex.assert_trees_all_equal(
      (adam.mu['w'], adam.nu['w'], adam.count), (jnp.array(mu), jnp.array(nu), jnp.int32(count))
    )
    np.testing.assert_allclose(w['w'], expected_w, rtol=0, atol=1e-6)

  w, state = full(W0, tx.init(W0), _grad(7.0, 16.0))
  check(w, state, [0.0, 1.0], [3.5, 8.0], [30.625, 160.0], 1)
  w, state = masked(w, state, _grad(4.0, 5.0), P0)
  check(w, state, [-1.0, 1.0], [3.75, 8.0], [21.484375, 160.0], 2)
  w, state = masked(w, state, _grad(3.0, -1.0), P1)
  check(w, state, [-1.0, 0.5], [3.75, 3.5], [21.484375, 60.625], 3)


def test_a_partitioned_step_changes_nothing_outside_its_slice():
  """On the MLP with Adam and weight decay: every coordinate outside the slice keeps its
  parameter and both moments bit for bit; inside, the step is the full step's, bit for bit
  too (Adam is elementwise, and the partitioned step runs the full step's program)."""
  pipe = pipeline(tx='adam')
  tx = optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-2))
  full = _update(tx)
  masked = lppsgd.make_masked_update(full, tx)
  ops = pipe.ops(0, sequential_roles(1)[0])
  params = pipe.initial_variables(0, sequential_roles(1)[0])['params']
  stream = batches(seed=0)

  def grads_at(params):
    batch = next(stream)
    return ops.backward(ops.forward({'params': params}, batch['image'], batch['label'])[3], None)[0]

  params, state = full(params, tx.init(params), grads_at(params))  # Moments ≠ 0 everywhere.
  g = grads_at(params)
  for mask in lppsgd.partition_masks(params, 3):
    new_params, new_state = masked(params, state, g, mask)
    ref_params, ref_state = full(params, state, g)
    for new, old, ref in [
      (new_params, params, ref_params),
      (new_state[1][0].mu, state[1][0].mu, ref_state[1][0].mu),
      (new_state[1][0].nu, state[1][0].nu, ref_state[1][0].nu),
    ]:
      for n, o, r, m in zip(*map(jax.tree.leaves, (new, old, ref, mask))):
        np.testing.assert_array_equal(np.asarray(n)[~m], np.asarray(o)[~m])
        np.testing.assert_array_equal(np.asarray(n)[m], np.asarray(r)[m])
    assert int(new_state[1][0].count) == 2


def test_an_optimizer_without_per_parameter_state_is_refused():
  """Adafactor keeps a 256 × 256 matrix's second moment as a row and a column of 256:
  a mask would broadcast over them silently instead of selecting a slice."""
  params = {'w': jnp.ones((256, 256))}
  tx = optax.adafactor(1e-2)
  masked = lppsgd.make_masked_update(_update(tx), tx)
  with pytest.raises(ValueError, match='per-parameter state'):
    masked(params, tx.init(params), params, lppsgd.partition_masks(params, 2)[0])


def test_one_partition_steps_equal_full_steps_bit_for_bit():
  """W = 1: the one slice is the whole model, so the partitioned steps (every other
  step once warm-up is over) are full steps and the run is sequential Adam."""
  pipe = pipeline(tx='adam')
  settings = lppsgd.LppSettings(devices=1, workers_per_device=1, warmup_steps=0)
  session, _, _ = run_lpp(settings, 10, pipe=pipe)
  params, opt = sequential_sgd(pipe, batches(seed=0), 10)
  chex.assert_trees_all_equal(tuple(session.replicas[0].read().value), (params[0], opt[0]))


def test_with_one_slice_the_partitioned_step_is_the_full_step_itself():
  """W = 1: no masks (they would select every coordinate, in two more passes over the
  parameters and the optimizer state); with several slices, a masked step per slice."""
  tx = optax.sgd(0.5, momentum=0.9)
  update = _update(tx)
  assert lppsgd.partitioned_steps(update, tx, 1) == [update]
  params = {'w': jnp.arange(6.0)}
  steps = lppsgd.partitioned_steps(update, tx, 2)
  new, _ = steps[1](params, tx.init(params), {'w': jnp.ones(6)})
  np.testing.assert_array_equal(new['w'], [0.0, 1.0, 2.0, 2.5, 3.5, 4.5])  # slice 1: the last 3


def test_hogwild_workers_replay_with_alternating_partitioned_steps():
  """Two workers share one replica. Replaying the recorded (worker, read version)
  sequence — the gradient at the version read, applied to the replica as it is at
  the end, full or own-slice-only alternately — gives the run's parameters exactly."""
  pipe = pipeline()
  settings = lppsgd.LppSettings(devices=1, workers_per_device=2, warmup_steps=2)
  session, _, _ = run_lpp(settings, 12, pipe=pipe, ex=executor(straggler_std=0.3, seed=5))
  updates = session.replicas[0].store.updates
  assert max(u.staleness for u in updates) >= 1  # Two Hogwild! workers overlap.
  ops = pipe.ops(0, sequential_roles(1)[0])
  masks = lppsgd.partition_masks(session.replicas[0].read().value.params, 2)
  history = [pipe.initial_variables(0, sequential_roles(1)[0])['params']]
  empty = pipe.tx.init(history[0])  # SGD: no optimizer state to follow.
  streams, taken = [batches(seed=m) for m in range(2)], [0, 0]
  for step, u in enumerate(updates):
    batch, k = next(streams[u.lane]), taken[u.lane]
    taken[u.lane] += 1
    _, _, _, vjp = ops.forward({'params': history[u.read_version]}, batch['image'], batch['label'])
    grads, _ = ops.backward(vjp, None)
    if k % 2 == 1 and step >= settings.warmup_steps:  # Its partitioned steps.
      history.append(session.masked_update(history[-1], empty, grads, masks[u.lane])[0])
    else:
      history.append(ops.update(history[-1], empty, grads)[0])
  chex.assert_trees_all_equal(session.replicas[0].read().value.params, history[-1])
  assert taken[0] >= 4 and taken[1] >= 4


def test_replicas_are_averaged_with_the_keep_local_merge():
  """D = 2, one worker each, averaging after every update, free links: at the end of
  step k both replicas are merged to m_k = mean(s_0, s_1), but each worker's next
  gradient was read at its own pre-merge s_d (the collective runs after it started):
      s_d^{k+1} = m_k − η ∇f(s_d^k; ξ_d^{k+1}),   m_0 = w0."""
  pipe = pipeline()
  settings = lppsgd.LppSettings(devices=2, workers_per_device=1, averaging_freq=1)
  session, timeline, _ = run_lpp(settings, 10, pipe=pipe)
  ops = pipe.ops(0, sequential_roles(1)[0])
  w0 = pipe.initial_variables(0, sequential_roles(1)[0])['params']
  streams, sent, merged, empty = [batches(seed=0), batches(seed=1)], [w0, w0], w0, pipe.tx.init(w0)
  for _ in range(5):
    new = []
    for d in range(2):
      batch = next(streams[d])
      vjp = ops.forward({'params': sent[d]}, batch['image'], batch['label'])[3]
      new.append(ops.update(merged, empty, ops.backward(vjp, None)[0])[0])
    sent, merged = new, lppsgd._mean(new)  # pylint: disable=protected-access
  for d in range(2):
    chex.assert_trees_all_equal(session.replicas[d].read().value.params, sent[d])
  chex.assert_trees_all_equal(session.variables()['params'], merged)
  assert session.averaged_rounds == 4  # Not after the final step.
  assert len(timeline.tasks(kind='average')) == 4


def test_averaging_cost_is_a_ring_allreduce_of_the_parameter_bytes():
  cost = {'latency': 1e-3, 'bandwidth': 1e6}
  assert lppsgd.allreduce_time(4000, 4, **cost) == pytest.approx(6 * (1e-3 + 1000 / 1e6))
  assert lppsgd.allreduce_time(4000, 1, **cost) == 0.0
  assert lppsgd.allreduce_time(4000, 4, latency=0.0, bandwidth=math.inf) == 0.0
  table = algorithms_lppsgd.task_costs(
    {(0, 'forward'): 1.0, (0, 'backward'): 2.0, (0, 'update'): 0.5}, 4000, 4, **cost
  )
  assert table[(0, 'backward')] == 2.5 and table[(0, 'average')] == pytest.approx(0.012)


def test_lane_processes_price_the_mean_and_merge_as_measured_else_as_an_update():
  """The lane-process form's averaging tasks: the profile's own figures where it has them
  (the mean writes a fresh model-sized output, which an update does not), else the update's."""
  cost = {'latency': 1e-3, 'bandwidth': 1e6, 'lane_processes': True}
  base = {(0, 'forward'): 1.0, (0, 'backward'): 2.0, (0, 'update'): 0.5}
  measured = {**base, (0, 'average'): 2.25, (0, 'merge'): 1.5}
  table = algorithms_lppsgd.task_costs(measured, 4000, 4, **cost)
  assert table == measured  # the backward unfolded: the update is a task of its own
  table = algorithms_lppsgd.task_costs(base, 4000, 4, **cost)
  assert table == {**base, (0, 'average'): 0.5, (0, 'merge'): 0.5}


@pytest.mark.parametrize('clock', ['virtual', 'real'])
def test_concurrent_hogwild_updates_are_never_lost(clock):
  """Adam counts its updates: the count equals the writes recorded (no lost update)."""
  settings = lppsgd.LppSettings(devices=2, workers_per_device=3, averaging_freq=2)
  session, _, _ = run_lpp(settings, 18, tx='adam', ex=executor(clock))
  counts = [int(r.read().value.opt_state[0].count) for r in session.replicas]
  assert counts == [len(r.store.updates) for r in session.replicas]
  assert sum(counts) == 18


def test_a_failed_worker_stops_and_its_replica_keeps_training():
  settings = lppsgd.LppSettings(devices=2, workers_per_device=2, averaging_freq=2)
  session, _, log = run_lpp(settings, 16, failures={1: 10.0})
  [failed] = log.summary()['failed_workers']
  assert failed['worker'] == 'worker 1' and failed['last_push'] < 10.0
  assert max(log.pushes[0]) > 10.0 and sum(len(p) for p in log.pushes) == 16
  assert session.active == {0, 1}  # Worker 0.0 still trains replica 0.


def test_a_replica_joins_one_averaging_round_at_a_time():
  """A snapshot taken before the previous round's merge landed would count that merge
  twice in w̄ + (w − s), so a replica waits for it. D = 2, one worker each, tasks of
  3 s, a collective of 5 s. Worker d applies an update every 3 s (its gradient at the
  replica it read when its task started, 3 s earlier):
      3: a1 = w0 − η g(w0), snapshot s1 = a1        6: a2 = a1 − η g(a1), none (in flight)
      8: b1 = mean(s1) + (a2 − s1)                   9: a3 = b1 − η g(a2), snapshot s2 = a3
     12: a4 = a3 − η g(a3), none                    14: b2 = mean(s2) + (a4 − s2)
     15: a5 = b2 − η g(a4), snapshot s3 = a5        18: a6 = a5 − η g(a5): step 12, done."""
  pipe = pipeline()
  settings = lppsgd.LppSettings(devices=2, workers_per_device=1, averaging_freq=1)
  session, _, _ = run_lpp(settings, 12, pipe=pipe, ex=executor(costs=dict(UNIT, average=5.0)))
  ops = pipe.ops(0, sequential_roles(1)[0])
  w0 = pipe.initial_variables(0, sequential_roles(1)[0])['params']
  empty, streams = pipe.tx.init(w0), [batches(seed=d) for d in range(2)]

  def step(d, at, onto):
    batch = next(streams[d])
    vjp = ops.forward({'params': at}, batch['image'], batch['label'])[3]
    return ops.update(onto, empty, ops.backward(vjp, None)[0])[0]

  def merge(now, sent):
    mean = lppsgd._mean(sent)  # pylint: disable=protected-access
    return [lppsgd.keep_local_merge(w, s, mean) for w, s in zip(now, sent)]

  a1 = [step(d, w0, w0) for d in range(2)]
  a2 = [step(d, a1[d], a1[d]) for d in range(2)]
  b1 = merge(a2, a1)
  a3 = [step(d, a2[d], b1[d]) for d in range(2)]
  a4 = [step(d, a3[d], a3[d]) for d in range(2)]
  b2 = merge(a4, a3)
  a5 = [step(d, a4[d], b2[d]) for d in range(2)]
  for d in range(2):
    chex.assert_trees_all_equal(session.replicas[d].read().value.params, step(d, a5[d], a5[d]))
  assert session.averaged_rounds == 2


def _elastic_session(pipe, steps: common.StepCounter) -> lppsgd.LppSession:
  """Two replicas of two workers each, on lanes of their own (`replica_lanes`)."""
  settings = lppsgd.LppSettings(devices=2, workers_per_device=2, replica_lanes=True)
  variables = pipe.initial_variables(0, sequential_roles(1)[0])
  return lppsgd.LppSession(
    pipe,
    settings,
    variables,
    pipe.tx.init(variables['params']),
    [batches(seed=m) for m in range(4)],
    [jax.devices()[0]] * 2,
    steps,
    log_for([f'worker {m}' for m in range(4)], None, executor()),
  )


def _updater_at(phase: str, **fields):
  """A replica's updater process as `_heal` sees it: its state at `phase`."""
  state = LoopState(d=1, lost=[], **fields)
  state.phase = phase
  return types.SimpleNamespace(state=state)


@pytest.mark.parametrize(
  'phase, fields, claimed_after',
  [
    ('update', dict(claimed=True, step=None), 2),  # lost with its update: given back
    ('update', dict(claimed=True, step=3), 3),  # committed before the lane died: kept
    ('answer', dict(claimed=True, step=3), 3),
    ('update', dict(claimed=False, step=None), 3),  # no step was left to claim
    ('get', dict(), 3),
  ],
)
def test_a_healed_replica_gives_back_the_step_claimed_for_an_update_its_lane_lost(
  phase, fields, claimed_after
):
  """A step the replica's updater claimed for an update still running in its lane when
  the lane was lost is never committed: `_heal` gives it back, so that the run still
  applies all its steps (one kept took the run to `train_steps - 1` and it stopped as
  failed). A step already committed, or none claimed, is left alone."""
  steps = common.StepCounter(10)
  session = _elastic_session(pipeline(), steps)
  for _ in range(3):
    steps.claim()
  session._heal(1, _updater_at(phase, **fields), 'lost')  # pylint: disable=protected-access
  assert steps.claimed == claimed_after


def test_a_lost_replica_is_healed_from_a_live_peer():
  """Elastic workers (`replica_lanes`): when replica 1's lane is replaced, `_heal` gives
  replica 1 replica 0's parameters and optimizer state (a new version, no staleness
  recorded); its generation grows (a merge of a snapshot taken before is dropped), its
  round is no longer in flight, and the requests its lost lane held — those of its own
  workers 2 and 3, not worker 0's — are answered as lost by its restarted updater."""
  pipe = pipeline(tx='adam')
  session = _elastic_session(pipe, common.StepCounter(10))
  peer = session.replicas[0].read().value
  moved = jax.tree.map(lambda x: x + 1.0, peer.params)
  session.replicas[0].store.write(peer._replace(params=moved))  # the peer has moved on
  session.outstanding = {2: 5, 0: 3, 3: 7}
  session.in_flight[1] = True
  before = session.replicas[1].read().version
  state = session._heal(1, _updater_at('get'), 'lost')  # pylint: disable=protected-access
  healed = session.replicas[1].read()
  chex.assert_trees_all_equal(healed.value, session.replicas[0].read().value)
  assert healed.version == before + 1 and len(session.replicas[1].store.staleness()) == 0
  assert session.generation == [0, 1] and not session.in_flight[1]
  assert state.d == 1 and state.lost == [(2, 5), (3, 7)] and session.outstanding == {0: 3}
