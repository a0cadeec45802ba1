"""Local parallelism: each variant against an independent stop-gradient reference."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import local as local_config
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd import models
from jaxsgd import training
from jaxsgd.algorithms import ddg
from jaxsgd.algorithms import local
from jaxsgd.models import Stage
from jaxsgd.models import layers as L
from jaxsgd.pipeline import BatchFeed, PlacedStages, StageRole, sequential_roles
from jaxsgd.pipeline.agreement import loss_groups
from jaxsgd.scheduler import Placement, VirtualExecutor
from scheduler_helpers import OPTIMIZERS, UNIT_COSTS, fused_bp, make_pipeline, mlp
from scheduler_helpers import pipeline_for, stage_params, take, train

LR, STEPS = 0.1, 4


def reference(pipeline, roles, groups, steps=STEPS):
  """SGD on Σ_g L_g, where loss g is taken at stage end−1 of its group (start, end)
  from sg(h_{start−1}): the gradient that reaches a stage is exactly the groups it is in."""
  stages, last = pipeline.stages, len(roles) - 1
  params = jax.device_put(
    [pipeline.initial_variables(k, role)['params'] for k, role in enumerate(roles)],
    jax.devices()[0],
  )

  def objective(params, x, y):
    outputs, h = [], x
    for stage, p in zip(stages, params):
      h = stage.apply({'params': p}, h)
      outputs.append(h)
    total = 0.0
    for start, end in groups:
      h = x if start == 0 else jax.lax.stop_gradient(outputs[start - 1])
      for k in range(start, end):
        if k == end - 1 and k < last:
          h, logits = stages[k].apply({'params': params[k]}, h, method=Stage.forward_with_aux)
        else:
          h = logits = stages[k].apply({'params': params[k]}, h)
      total += stages_lib.cross_entropy(logits, y)
    return total

  grad = jax.jit(jax.grad(objective))
  for batch in take(steps):
    grads = grad(params, batch['image'], batch['label'])
    params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
  return params


@pytest.mark.parametrize(
  'variant,chunks,groups',
  [
    ('greedy', 1, [(0, 1), (1, 2), (2, 3)]),
    ('overlapping', 1, [(0, 1), (0, 2), (1, 3)]),  # each loss reaches two blocks
    ('chunked', 2, [(0, 2), (2, 3)]),  # stop-gradient between the chunks
  ],
)
def test_lock_step_equals_the_stop_gradient_objective(variant, chunks, groups):
  roles = local.roles(3, variant, chunks, pipelined=False)
  pipeline = pipeline_for(roles)
  session, _, _ = train(pipeline, roles, STEPS)
  expected = reference(pipeline, roles, groups)
  chex.assert_trees_all_close(stage_params(session), expected, rtol=1e-6, atol=2e-7)


def test_pipelined_overlapping_follows_its_delayed_recursion():
  """K = 2, SGD. Block 1 learns from L_1 of the current batch plus L_2's gradient of the
  previous batch, taken at that forward's weights:

      g_1(t) = ∇_{θ1} L_1(a_1(f_1(θ1_t; x_t)))  +  J_{θ1} f_1(θ1_{t−1}; x_{t−1})ᵀ δ_{t−1}
      δ_t    = ∂L_2(f_2(θ2_t; h_t)) / ∂h_t,   g_2(t) = ∇_{θ2} L_2(f_2(θ2_t; h_t))
  """
  roles = local.roles(2, 'overlapping', pipelined=True)
  pipeline = pipeline_for(roles)
  first, second = pipeline.stages
  w1, w2 = jax.device_put(
    [pipeline.initial_variables(k, role)['params'] for k, role in enumerate(roles)],
    jax.devices()[0],
  )
  apply1 = lambda w, x, **kw: first.apply({'params': w}, x, **kw)
  own1 = jax.jit(
    jax.grad(
      lambda w, x, y: stages_lib.cross_entropy(apply1(w, x, method=Stage.forward_with_aux)[1], y)
    )
  )
  grad2 = jax.jit(
    jax.grad(
      lambda w, h, y: stages_lib.cross_entropy(second.apply({'params': w}, h), y), argnums=(0, 1)
    )
  )
  pullback1 = jax.jit(jax.grad(lambda w, x, delta: jax.numpy.vdot(apply1(w, x), delta)))
  sgd = lambda w, g: jax.tree.map(lambda p, q: p - LR * q, w, g)
  previous = None
  for batch in take(STEPS):
    x, y = batch['image'], batch['label']
    g1 = own1(w1, x, y)
    g2, delta = grad2(w2, apply1(w1, x), y)
    if previous is not None:
      g1 = jax.tree.map(jax.numpy.add, g1, pullback1(*previous))
    previous = (w1, x, delta)
    w1, w2 = sgd(w1, g1), sgd(w2, g2)
  session, _, _ = train(pipeline, roles, STEPS)
  chex.assert_trees_all_close(stage_params(session), [w1, w2], rtol=1e-6, atol=2e-7)


def test_greedy_heads_are_trained_and_dropped_at_evaluation():
  roles = local.roles(3, 'greedy')
  pipeline = pipeline_for(roles)
  session, _, _ = train(pipeline, roles, STEPS)
  for k in (0, 1):
    head = f'aux_{k}'
    trained = stage_params(session)[k][head]
    initial = pipeline.initial_variables(k, roles[k])['params'][head]
    assert not np.allclose(trained['Dense_0']['kernel'], initial['Dense_0']['kernel'])
  assert not any(name.startswith('aux_') for name in session.variables()['params'])


def test_one_chunk_is_bp_and_its_pipelined_form_is_ddg():
  roles = local.roles(3, 'chunked', 1, pipelined=False)
  assert roles == sequential_roles(3)
  assert local.roles(3, 'chunked', 1, pipelined=True) == ddg.roles(3)
  assert local.roles(3, 'chunked', 3) == local.roles(3, 'greedy')
  session, _, _ = train(pipeline_for(roles, tx='adam'), roles, STEPS)
  chex.assert_trees_all_equal(session.variables(), fused_bp(mlp(), OPTIMIZERS['adam'](), STEPS))


def test_greedy_is_exact_whether_pipelined_or_not():
  """No gradient comes from downstream: pipelining changes the timing, not the values."""
  pipelined, lockstep = (
    local.roles(3, 'greedy', pipelined=True),
    local.roles(3, 'greedy', pipelined=False),
  )
  assert pipelined == lockstep
  session, timeline, _ = train(pipeline_for(pipelined), pipelined, STEPS)
  # F = 1, B = 2, U = 0: block k runs batch t's forward at 3t + k, its backward right after.
  assert [(r.kind, r.batch, r.start) for r in timeline.tasks(lane=2) if r.kind != 'update'] == [
    ('forward', 0, 2),
    ('backward', 0, 3),
    ('forward', 1, 5),
    ('backward', 1, 6),
    ('forward', 2, 8),
    ('backward', 2, 9),
    ('forward', 3, 11),
    ('backward', 3, 12),
  ]
  assert timeline.makespan == 14
  assert all(s.staleness().max() == 0 for s in session.stores)


def test_pipelined_overlapping_and_chunked_use_delayed_gradients():
  overlapping = local.roles(4, 'overlapping', pipelined=True)
  assert [r.delay for r in overlapping] == [1, 1, 1, 0]
  assert [r.sends_delta for r in overlapping] == ['none', 'own', 'own', 'own']
  chunked = local.roles(4, 'chunked', 2, pipelined=True)
  assert chunked == (
    StageRole('none', True, 'none', delay=1),
    StageRole('aux', False, 'total', delay=0),
    StageRole('none', True, 'none', delay=1),
    StageRole('head', False, 'total', delay=0),
  )
  overlapping = local.roles(3, 'overlapping', pipelined=True)
  session, _, _ = train(pipeline_for(overlapping), overlapping, STEPS)
  # The first update is the own loss alone (fill); then the L_{k+1} part is one write old.
  assert [s.staleness().tolist() for s in session.stores] == [[0, 1, 1, 1]] * 2 + [[0] * 4]


# --- gradient agreement (Laskin et al. 2020) ----------------------------------------------
def _probe(pipeline, roles, steps, every):
  """Runs `steps` iterations measuring every `every` batches; returns (session, cosines)."""
  feed = BatchFeed(iter(take(steps)), 1 + sum(r.loss != 'none' for r in roles))
  session = pipeline.session(roles, feed, steps, agreement_every=every)
  VirtualExecutor(UNIT_COSTS).run(session.cluster, session.processes())
  return session, session.agreement.series()


def test_loss_groups_are_the_reach_of_each_loss():
  assert loss_groups(local.roles(3, 'greedy')) == ((0, 1), (1, 2), (2, 3))
  assert loss_groups(local.roles(3, 'overlapping')) == ((0, 1), (0, 2), (1, 3))
  assert loss_groups(local.roles(3, 'chunked', 2)) == ((0, 2), (2, 3))
  assert loss_groups(local.roles(4, 'chunked', 1)) == ((0, 4),) == loss_groups(ddg.roles(4))


def test_one_chunk_is_backprop_so_every_block_agrees_and_training_is_unchanged():
  """chunks = 1 is BP (pipelined: DDG): each block's local gradient is the true one."""
  roles = local.roles(4, 'chunked', 1)
  pipeline = pipeline_for(roles, hidden=(16, 16, 16))
  session, (steps, cosines) = _probe(pipeline, roles, 7, every=3)
  assert steps.tolist() == [0, 3, 6] and cosines.shape == (3, 4)
  np.testing.assert_allclose(cosines, 1, atol=1e-6)
  plain, _, _ = train(pipeline, roles, 7)  # The same batches, no probe: the same bits.
  chex.assert_trees_all_equal(stage_params(session), stage_params(plain))


def test_greedy_agreement_by_hand():
  """K = 2 linear blocks, one example x, squared loss: h = x W + b, the head of block 0
  z = h u + c, the model out = h v + b'. With r = out − y and s = z − y,

      ∇_{W,b} L   = (xᵀ, 1) ⊗ r vᵀ          (backprop)
      ∇_{W,b} L_0 = (xᵀ, 1) ⊗ s uᵀ          (greedy: block 0's own loss)
      cos_0 = sign(r s) · u·v / (‖u‖ ‖v‖),   cos_1 = 1 (its loss is the model's)
  """
  model = models.StagedModel(
    'linear', (L.DenseLayer(2, activate=False), L.DenseLayer(1, activate=False)), (3,), 1
  )
  squared_error = lambda out, y: 0.5 * jnp.mean((out - y) ** 2)
  pipeline = PlacedStages(
    model,
    2,
    optax.sgd(0.1),
    batch_size=1,
    aux_heads=True,
    loss_fn=squared_error,
    placement=Placement.create(2, jax.devices()[:2]),
  )
  roles = local.roles(2, 'greedy')
  x, y = np.array([[0.5, -1.0, 2.0]], np.float32), np.array([[0.25]], np.float32)
  feed = BatchFeed(iter([{'image': x, 'label': y}]), 3)
  session = pipeline.session(roles, feed, 1, agreement_every=1)
  VirtualExecutor(UNIT_COSTS).run(session.cluster, session.processes())
  p0, p1 = (
    jax.tree.map(np.asarray, pipeline.initial_variables(k, role)['params'])
    for k, role in enumerate(roles)
  )
  h = x @ p0['layer_0']['Dense_0']['kernel'] + p0['layer_0']['Dense_0']['bias']
  u, c = p0['aux_0']['Dense_0']['kernel'][:, 0], p0['aux_0']['Dense_0']['bias'][0]
  v, b = p1['layer_1']['Dense_0']['kernel'][:, 0], p1['layer_1']['Dense_0']['bias'][0]
  r, s = float(h[0] @ v + b - y[0, 0]), float(h[0] @ u + c - y[0, 0])
  expected = np.sign(r * s) * float(u @ v) / float(np.linalg.norm(u) * np.linalg.norm(v))
  np.testing.assert_allclose(session.agreement.series()[1], [[expected, 1.0]], atol=1e-6)


@pytest.mark.parametrize('variant,chunks', [('greedy', 1), ('overlapping', 1), ('chunked', 2)])
def test_agreement_is_the_applied_gradient_against_backprop(variant, chunks):
  """Lock-step, SGD η = 1, one step: the update each block applies is its local gradient
  g_local = θ_0 − θ_1; backprop's comes from the fused model. Their cosine is the probe's."""
  roles = local.roles(3, variant, chunks, pipelined=False)
  pipeline = make_pipeline(mlp(), roles, tx=optax.sgd(1.0))
  session, (_, cosines) = _probe(pipeline, roles, 1, every=1)
  batch = take(1)[0]
  full = mlp().init(jax.random.key(0))['params']
  true = jax.grad(
    lambda p: stages_lib.cross_entropy(
      mlp().full().apply({'params': p}, batch['image']), batch['label']
    )
  )(full)
  expected = []
  for k, (role, after) in enumerate(zip(roles, stage_params(session))):
    names = [n for n in after if not n.startswith('aux_')]
    before = pipeline.initial_variables(k, role)['params']
    pick = lambda tree, names=names: jax.tree.leaves({n: tree[n] for n in names})
    local_grad = np.concatenate([np.ravel(a - b) for a, b in zip(pick(before), pick(after))])
    true_grad = np.concatenate([np.ravel(g) for g in pick(true)])
    expected.append(local_grad @ true_grad / np.linalg.norm(local_grad) / np.linalg.norm(true_grad))
  np.testing.assert_allclose(cosines[0], expected, atol=1e-4)
  assert abs(expected[-1] - 1) < 1e-4 and min(expected) < 0.9  # Only the last block is BP.


def test_chunk_bounds():
  assert local.chunk_bounds(5, 2) == [(0, 3), (3, 5)]
  assert local.chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


# --- the experiment -----------------------------------------------------------------------
@pytest.mark.parametrize('clock', ['virtual', 'real'])
def test_smoke_config_trains_and_writes_trace_and_staleness(data_dir, tmp_path, clock):
  config = local_config.get_config('smoke')
  config.data_dir, config.clock = data_dir, clock
  config.stages = 3
  config.algorithm.agreement_every = 20
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['step'] for r in records] == [20, 40, 60]
  assert records[-1]['train_loss'] < records[0]['train_loss']
  assert records[-1]['test_loss'] < 2.3
  assert ('sim_time' in records[-1]) == (clock == 'virtual')
  assert records[-1]['staleness_max/stage0'] == 1 and records[-1]['staleness_max/stage2'] == 0
  assert 'local_loss/stage0' in records[-1]
  # Batches 0, 20, 40 measured; each record carries the one(s) since the previous.
  assert all(-1 <= r[f'grad_cosine/stage{k}'] <= 1 for r in records for k in range(3))
  assert records[-1]['grad_cosine/stage2'] == pytest.approx(1, abs=1e-6)  # The model's loss.
  assert np.load(tmp_path / 'grad_cosine.npz')['steps'].tolist() == [0, 20, 40]
  assert (tmp_path / 'grad_cosine.png').stat().st_size > 5_000
  trace = json.load(open(tmp_path / 'trace.json'))['traceEvents']
  assert {e['tid'] for e in trace if e['ph'] == 'X' and e['cat'] == 'forward'} == {0, 1, 2}
  assert (tmp_path / 'staleness.png').stat().st_size > 5_000
  assert all(
    0 < summary['utilization'][f'stage {k} ({d})'] <= 1 for k, d in enumerate(jax.devices()[:3])
  )


def test_negative_agreement_every_is_refused(data_dir, tmp_path):
  config = local_config.get_config('smoke')
  config.data_dir = data_dir
  config.algorithm.agreement_every = -1
  with pytest.raises(
    ValueError,
    match=r'algorithm.agreement_every: must be an integer >= 0 '
    r'\(0: off\), got -1',
  ):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert not (tmp_path / 'metrics.jsonl').exists()
