"""Staged BP and DDG on the scheduler: exact equivalences and hand-computed schedules."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsgd import models
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.algorithms import ddg
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles, stale_graph
from jaxsgd.scheduler import CostModel, Placement, RealExecutor, VirtualExecutor
from scheduler_helpers import OPTIMIZERS, UNIT_COSTS, fused_bp, make_pipeline, mlp
from scheduler_helpers import pipeline_for, stage_params, take, train

DDG_VARIANTS = ('paper', 'stale_graph', 'recompute')


@pytest.mark.parametrize('num_stages', [1, 3])
def test_staged_bp_equals_fused_bp_bit_for_bit(num_stages):
  roles = sequential_roles(num_stages)
  session, _, _ = train(pipeline_for(roles, tx='adam'), roles, 4)
  chex.assert_trees_all_equal(session.variables(), fused_bp(mlp(), OPTIMIZERS['adam'](), 4))


def test_ddg_with_one_stage_is_bp():
  assert ddg.roles(1) == sequential_roles(1)
  session, _, _ = train(pipeline_for(ddg.roles(1), tx='adam'), ddg.roles(1), 4)
  chex.assert_trees_all_equal(session.variables(), fused_bp(mlp(), OPTIMIZERS['adam'](), 4))


@pytest.mark.parametrize('variant', DDG_VARIANTS)
def test_ddg_two_stages_follows_the_delayed_gradient_recursion(variant):
  """K = 2, SGD: module 2 has no delay, module 1 uses δ from the previous iteration.

      w2 ← w2 − η ∇_{w2} L(w2; h_t),   δ_t = ∇_h L(w2; h_t),   h_t = f1(w1; x_t)
      w1 ← w1 − η J_{w1} f1(w1'; x_{t−1})ᵀ δ_{t−1}     (t ≥ 1)
      w1' = the weights of batch t − 1's forward (paper) or the current w1 (recompute).
  Module 1 is one layer, relu(x W + b): its weight gradient reads only x and the relu
  mask of the forward, so the stale graph's is the paper's.
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
      w1_next = sgd(w1, grad1(w1 if variant == 'recompute' else w_forward, x_old, delta_old))
    previous = (w1, batch['image'], delta)
    w1, w2 = w1_next, sgd(w2, g2)

  roles = ddg.roles(2, variant)
  session, _, _ = train(pipeline_for(roles, hidden=(16,)), roles, steps)
  got = stage_params(session)
  chex.assert_trees_all_close(got[0], w1, rtol=2e-6, atol=2e-7)
  chex.assert_trees_all_close(got[1], w2, rtol=2e-6, atol=2e-7)
  # Every form learns from batch t − 1's input and δ, one write old (the first update: 0).
  assert [u.staleness for u in session.stores[0].updates] == [0] + [1] * (steps - 2)
  # The paper's Jacobian is at the forward's weights; the other forms' at the current ones.
  assert session.weight_staleness[0] == (
    [0] + [1] * (steps - 2) if variant == 'paper' else [0] * (steps - 1)
  )
  assert ('weight_staleness_mean/stage0' in session.metrics()) == (variant != 'paper')


class Scale(nn.Module):
  """y = w · x, one scalar weight: a layer whose arithmetic is done by hand."""

  init: float

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    return self.param('w', nn.initializers.constant(self.init), ()) * x


@pytest.mark.parametrize(
  'variant,module_1',
  [('paper', [-7.0, -2.0]), ('stale_graph', [-4.0, -2.0]), ('recompute', [-4.0, 4.0])],
)
def test_ddg_forms_by_hand(variant, module_1):
  """K = 2 modules of two scalar layers, h = b·(a·x) and out = d·(c·h), loss ½(out − y)²,
  SGD η = ½, batches (x, y) = (1, 0), (2, 1), (1, 1); a, b, c, d start at 1, 2, 1, 1.

    t = 0: h = 2, out = 2, r = out − y = 2; g_c = r·d·h = 4 = g_d; c = d = −1;
           δ_0 = ∂L/∂h = r·c·d = 2 (at the old c, d). Module 1 idles (pipeline fill).
    t = 1: forward at a = 1, b = 2: a·x = 2, h = 4, out = 4, r = 3; g_c = g_d = −12,
           c = d = 5; δ_1 = 3. Module 1, batch 0 (forward weights = current weights):
           g_a = x·b·δ_0 = 4, g_b = (a·x)·δ_0 = 2 → a = −1, b = 1 in every form.
    t = 2: forward at a = −1, b = 1: h = −1, out = −25, r = −26; g_c = g_d = 130,
           c = d = −60. Module 1, batch 1 (x = 2, forward a·x = 2, δ_1 = 3):
             paper        g_a = x·b_fwd·δ = 12   g_b = (a·x)_fwd·δ = 6    → a = −7, b = −2
             stale_graph  g_a = x·b_now·δ = 6    g_b = (a·x)_fwd·δ = 6    → a = −4, b = −2
             recompute    g_a = x·b_now·δ = 6    g_b = (a_now·x)·δ = −6   → a = −4, b =  4
  In PyTorch (the public code), `mul` saves both its operands: the activation a·x as the
  forward left it, and the parameter b itself, updated in place since.
  """
  model = models.StagedModel('scalar', (Scale(1.0), Scale(2.0), Scale(1.0), Scale(1.0)), (1,), 1)
  squared_error = lambda out, y: 0.5 * jnp.mean((out - y) ** 2)
  pipeline = PlacedStages(
    model,
    2,
    optax.sgd(0.5),
    batch_size=1,
    loss_fn=squared_error,
    placement=Placement.create(2, jax.devices()[:2]),
  )
  assert [s.layer_range for s in pipeline.stages] == [range(0, 2), range(2, 4)]
  data = iter(
    [
      {'image': np.full((1, 1), x, np.float32), 'label': np.full((1, 1), y, np.float32)}
      for x, y in ((1, 0), (2, 1), (1, 1))
    ]
  )
  session = pipeline.session(ddg.roles(2, variant), BatchFeed(data, consumers=2), 3)
  VirtualExecutor(UNIT_COSTS).run(session.cluster, session.processes())
  got = [
    [float(p[f'layer_{i}']['w']) for i in s.layer_range]
    for s, p in zip(pipeline.stages, stage_params(session))
  ]
  assert got == [module_1, [-60.0, -60.0]]  # Exact: every number is a small integer.
  assert session.stores[0].staleness().tolist() == [0, 1]
  assert session.weight_staleness[0] == ([0, 1] if variant == 'paper' else [0, 0])


def test_stale_graph_backward_of_a_three_layer_module_by_formula():
  """Stage 1 of 3: three layers h_i = relu(h_{i−1} W_i + b_i). The public code's
  backward through its kept graph, at weights changed since the forward (written out):

      e_3 = δ ⊙ [u_3 > 0];  e_i = (e_{i+1} W_{i+1,now}ᵀ) ⊙ [u_i > 0];  dx = e_1 W_{1,now}ᵀ
      grad W_i = h_{i−1}ᵀ e_i,  grad b_i = Σ e_i      (u_i, h_i: the forward's, at W_fwd)
  """
  roles = ddg.roles(3, 'stale_graph')
  pipeline = make_pipeline(mlp(hidden=(8, 4, 4, 16)), roles)
  assert list(pipeline.stages[1].layer_range) == [1, 2, 3]
  ops = pipeline.ops(1, roles[1])
  forward_weights = pipeline.initial_variables(1, roles[1])
  now = jax.tree.map(lambda w: w + 0.3 * jnp.sign(w) + 0.05, forward_weights)
  x = jax.random.normal(jax.random.key(1), (16, 8))
  delta = jax.random.normal(jax.random.key(2), (16, 16))
  _, _, _, kept = ops.forward(forward_weights, x, None)
  grads, dx = ops.stale_backward(kept, now, x, None, delta)

  def dense(variables, i):
    p = variables['params'][f'layer_{i}']['Dense_0']
    return p['kernel'], p['bias']

  h, u = {0: x}, {}
  for i in (1, 2, 3):
    kernel, bias = dense(forward_weights, i)
    u[i] = h[i - 1] @ kernel + bias
    h[i] = jnp.maximum(u[i], 0)
  e, expected = delta * (u[3] > 0), {}
  for i in (3, 2, 1):
    expected[f'layer_{i}'] = {'Dense_0': {'kernel': h[i - 1].T @ e, 'bias': e.sum(0)}}
    e = e @ dense(now, i)[0].T * (u[i - 1] > 0 if i > 1 else 1)
  chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(dx, e, rtol=1e-5, atol=1e-6)
  # At the forward's own weights it is the ordinary backward (the stored vjp's).
  paper = ddg.roles(3)
  stored_ops = make_pipeline(mlp(hidden=(8, 4, 4, 16)), paper).ops(1, paper[1])
  stored = stored_ops.backward(stored_ops.forward(forward_weights, x, None)[3], delta)
  chex.assert_trees_all_close(
    ops.stale_backward(kept, forward_weights, x, None, delta), stored, rtol=1e-6, atol=1e-7
  )


def test_stale_graph_refuses_an_opaque_operation_on_weights_and_activations():
  """Inside `jax.checkpoint` the activations would be recomputed at the current weights."""
  forward, _ = stale_graph.stale_graph(
    lambda w, x: (jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x), None)
  )
  with pytest.raises(NotImplementedError, match="'remat2' operation .* takes both weights"):
    forward(jnp.ones((2, 2)), jnp.ones((3, 2)))


def test_ddg_forms_differ():
  """K = 2, 3 steps: module 1's second update (t = 2) is the first whose forward weights
  are not the current ones; module 2 has seen only forwards before it."""
  runs = {}
  for variant in DDG_VARIANTS:
    roles = ddg.roles(2, variant)
    runs[variant] = stage_params(train(pipeline_for(roles, hidden=(4, 16, 16)), roles, 3)[0])
  for a, b in (('paper', 'stale_graph'), ('paper', 'recompute'), ('stale_graph', 'recompute')):
    chex.assert_trees_all_equal(runs[a][1], runs[b][1])  # Same last stage.
    with pytest.raises(AssertionError):
      chex.assert_trees_all_close(runs[a][0], runs[b][0], rtol=1e-4)


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
  for variant in DDG_VARIANTS:
    roles = ddg.roles(3, variant)
    pipeline = pipeline_for(roles)
    clean, _, _ = train(pipeline, roles, 5)
    filled, _, losses = train(pipeline, roles, 5, idle_fill='nan')
    chex.assert_tree_all_finite(stage_params(filled))
    chex.assert_trees_all_equal(stage_params(filled), stage_params(clean))
    assert np.isfinite(np.asarray(losses)).all()


@pytest.mark.parametrize('variant', ['recompute', 'stale_graph'])
def test_every_stage_function_is_traced_once(variant):
  roles = ddg.roles(3, variant)
  pipeline = make_pipeline(mlp(), roles)
  train(pipeline, roles, 5)
  train(pipeline, roles, 3, executor=RealExecutor())
  backward = {'recompute': 'recompute', 'stale_graph': 'stale_backward'}[variant]
  for k, role in enumerate(roles):
    counts = {name: fn._cache_size() for name, fn in pipeline.ops(k, role).jitted}  # pylint: disable=protected-access
    used = {'forward', 'update', backward if role.delay else 'backward'}
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
