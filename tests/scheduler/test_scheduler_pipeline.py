"""Staged BP and DDG on the scheduler: exact equivalences and hand-computed schedules."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsgd import models
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.algorithms import ddg
from jaxsgd.pipeline import sequential_roles
from jaxsgd.scheduler import CostModel, RealExecutor, VirtualExecutor
from scheduler_helpers import OPTIMIZERS, fused_bp, make_pipeline, mlp, pipeline_for
from scheduler_helpers import stage_params, take, train


@pytest.mark.parametrize('num_stages', [1, 3])
def test_staged_bp_equals_fused_bp_bit_for_bit(num_stages):
  roles = sequential_roles(num_stages)
  session, _, _ = train(pipeline_for(roles, tx='adam'), roles, 4)
  chex.assert_trees_all_equal(session.variables(), fused_bp(mlp(), OPTIMIZERS['adam'](), 4))


def test_ddg_with_one_stage_is_bp():
  assert ddg.roles(1) == sequential_roles(1)
  session, _, _ = train(pipeline_for(ddg.roles(1), tx='adam'), ddg.roles(1), 4)
  chex.assert_trees_all_equal(session.variables(), fused_bp(mlp(), OPTIMIZERS['adam'](), 4))


@pytest.mark.parametrize('variant', ['paper', 'recompute'])
def test_ddg_two_stages_follows_the_delayed_gradient_recursion(variant):
  """K = 2, SGD: module 2 has no delay, module 1 uses δ from the previous iteration.

  w2 ← w2 − η ∇_{w2} L(w2; h_t),   δ_t = ∇_h L(w2; h_t),   h_t = f1(w1; x_t)
  w1 ← w1 − η J_{w1} f1(w1'; x_{t−1})ᵀ δ_{t−1}     (t ≥ 1)
  w1' = the weights of batch t − 1's forward (paper) or the current w1 (recompute)
  """
  model, lr, steps = mlp(hidden=(16,)), 0.1, 5
  stage1, stage2 = models.split(model, 2)
  full = model.init(jax.random.key(0))['params']
  w1, w2 = ({n: full[n] for n in ('layer_0',)}, {n: full[n] for n in ('layer_1',)})
  f1 = lambda w, x: stage1.apply({'params': w}, x)
  loss2 = lambda w, h, y: stages_lib.cross_entropy(stage2.apply({'params': w}, h), y)
  grad2 = jax.jit(jax.grad(loss2, argnums=(0, 1)))  # (∇_{w2} L, δ)
  grad1 = jax.jit(jax.grad(lambda w, x, delta: jnp.vdot(f1(w, x), delta)))  # J_{w1}ᵀ δ
  sgd = lambda w, g: jax.tree.map(lambda a, b: a - lr * b, w, g)
  previous = None  # (w1 of the forward, x, δ) of batch t − 1
  for batch in take(steps):
    h = f1(w1, batch['image'])
    g2, delta = grad2(w2, h, batch['label'])
    w1_next = w1  # Iteration 0: pipeline fill, no update of module 1.
    if previous is not None:
      w_forward, x_old, delta_old = previous
      w1_next = sgd(w1, grad1(w_forward if variant == 'paper' else w1, x_old, delta_old))
    previous = (w1, batch['image'], delta)
    w1, w2 = w1_next, sgd(w2, g2)

  roles = ddg.roles(2, variant)
  session, _, _ = train(pipeline_for(roles, hidden=(16,)), roles, steps)
  got = stage_params(session)
  chex.assert_trees_all_close(got[0], w1, rtol=2e-6, atol=2e-7)
  chex.assert_trees_all_close(got[1], w2, rtol=2e-6, atol=2e-7)
  # Paper: computed at the forward's weights, one write ago. Recompute: at the current ones.
  expected = [0] + [1] * (steps - 2) if variant == 'paper' else [0] * (steps - 1)
  assert [u.staleness for u in session.stores[0].updates] == expected


def test_ddg_paper_and_recompute_differ():
  paper, recompute = ddg.roles(2, 'paper'), ddg.roles(2, 'recompute')
  a, _, _ = train(pipeline_for(paper, hidden=(16,)), paper, 4)
  b, _, _ = train(pipeline_for(recompute, hidden=(16,)), recompute, 4)
  chex.assert_trees_all_equal(stage_params(a)[1], stage_params(b)[1])  # Same last stage.
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(stage_params(a)[0], stage_params(b)[0], rtol=1e-4)


# --- the virtual clock, by hand -------------------------------------------------------------
def _spans(timeline, lane):
  return [
    (r.kind[0].upper(), r.batch, r.start, r.end)
    for r in timeline.tasks(lane=lane)
    if r.kind in ('forward', 'backward')
  ]


def test_ddg_virtual_schedule_by_hand():
  """K = 3, F = 1, B = 2, U = 0, free links, 4 iterations (worked out on paper).

  t =  0  1  2  3  4  5  6  7  8  9 10 11 12 13
  s0   F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1
  s1   .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2
  s2   .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3
  """
  roles = ddg.roles(3)
  _, timeline, _ = train(pipeline_for(roles), roles, 4)
  assert _spans(timeline, 0) == [
    ('F', 0, 0, 1),
    ('F', 1, 1, 2),
    ('F', 2, 2, 3),
    ('B', 0, 7, 9),
    ('F', 3, 9, 10),
    ('B', 1, 10, 12),
  ]
  assert _spans(timeline, 1) == [
    ('F', 0, 1, 2),
    ('F', 1, 2, 3),
    ('B', 0, 5, 7),
    ('F', 2, 7, 8),
    ('B', 1, 8, 10),
    ('F', 3, 10, 11),
    ('B', 2, 11, 13),
  ]
  assert _spans(timeline, 2) == [
    ('F', 0, 2, 3),
    ('B', 0, 3, 5),
    ('F', 1, 5, 6),
    ('B', 1, 6, 8),
    ('F', 2, 8, 9),
    ('B', 2, 9, 11),
    ('F', 3, 11, 12),
    ('B', 3, 12, 14),
  ]
  assert timeline.makespan == 14
  # Steady state: one iteration per F + B = 3 s on every stage, versus 3 (F + B) = 9 s for BP.
  roles = sequential_roles(3)
  _, bp_timeline, _ = train(pipeline_for(roles), roles, 4)
  assert bp_timeline.makespan == 4 * 9


def test_idle_pipeline_slots_filled_with_nan_never_reach_the_results():
  for variant in ('paper', 'recompute'):
    roles = ddg.roles(3, variant)
    pipeline = pipeline_for(roles)
    clean, _, _ = train(pipeline, roles, 5)
    filled, _, losses = train(pipeline, roles, 5, idle_fill='nan')
    chex.assert_tree_all_finite(stage_params(filled))
    chex.assert_trees_all_equal(stage_params(filled), stage_params(clean))
    assert np.isfinite(np.asarray(losses)).all()


def test_every_stage_function_is_traced_once():
  roles = ddg.roles(3, 'recompute')
  pipeline = make_pipeline(mlp(), roles)
  train(pipeline, roles, 5)
  train(pipeline, roles, 3, executor=RealExecutor())
  for k, role in enumerate(roles):
    counts = {name: fn._cache_size() for name, fn in pipeline.ops(k, role).jitted}  # pylint: disable=protected-access
    used = {'forward', 'update', 'recompute' if role.delay else 'backward'}
    assert counts == {name: int(name in used) for name in counts}, (k, counts)


def test_real_virtual_and_threaded_clocks_give_the_same_bits():
  roles = ddg.roles(3)
  pipeline = pipeline_for(roles)
  runs = [
    train(pipeline, roles, 6, executor=executor)[0]
    for executor in (VirtualExecutor(_costs(std=0.4)), RealExecutor(), RealExecutor(threads=True))
  ]
  for session in runs[1:]:
    chex.assert_trees_all_equal(session.variables(), runs[0].variables())
    assert [s.staleness().tolist() for s in session.stores] == [
      s.staleness().tolist() for s in runs[0].stores
    ]


def _costs(std):
  return CostModel({'forward': 1.0, 'backward': 2.0, 'update': 0.1}, straggler_std=std)


def test_stages_live_on_their_devices_and_copies_are_explicit():
  """Every copy goes through `jaxsgd.scheduler.transfer` (explicit device_put)."""
  roles = ddg.roles(4)
  devices = jax.devices()[4:8]
  pipeline = make_pipeline(mlp(hidden=(16, 16, 16)), roles, devices=devices)
  with jax.transfer_guard('disallow'):
    session, timeline, _ = train(pipeline, roles, 4, executor=RealExecutor())
  for k, params in enumerate(stage_params(session)):
    assert {leaf.devices().pop() for leaf in jax.tree.leaves(params)} == {devices[k]}
  assert {r.lane for r in timeline.records if r.kind == 'transfer'} == set(range(4, 10))
