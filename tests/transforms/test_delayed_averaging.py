"""Exact tests of delayed averaging (DaSGD), local SGD and DiLoCo.

Workers are rows of stacked params unless a test says otherwise; the mesh test
runs the same updates through `shard_map` on 4 fake CPU devices.
"""

import json
import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsgd.transforms as T

M, D = 4, 3
_RNG = np.random.default_rng(3)
TARGETS = jnp.asarray(_RNG.normal(size=(M, D)), jnp.float32)  # Per worker.
CURVATURE = jnp.asarray([0.5, 1.0, 1.5], jnp.float32)
W0 = jnp.asarray(np.tile(_RNG.normal(size=D), (M, 1)), jnp.float32)


def _grads(w, targets=TARGETS):
  """Worker j minimises ½ Σ h (w_j − target_j)²: gradients differ per worker."""
  return CURVATURE * (w - targets)


def _run(tx, steps, w=W0, grads_fn=_grads):
  """Runs `steps` jitted updates; returns the params after each step."""

  @jax.jit
  def step(w, state):
    updates, state = tx.update(grads_fn(w), state, w)
    return optax.apply_updates(w, updates), state

  state, out = tx.init(w), []
  for _ in range(steps):
    w, state = step(w, state)
    out.append(w)
  return jnp.stack(out)


def _sequence(tx, w0, grads):
  """Applies the given per-step gradients; returns params after each step."""
  w, state, out = w0, tx.init(w0), []
  for g in grads:
    updates, state = jax.jit(tx.update)(jnp.asarray(g), state, w)
    w = optax.apply_updates(w, updates)
    out.append(w)
  return jnp.stack(out), state


# --------------------------------------------------------------- by hand.
HAND_GRADS = [[1.0, -1.0], [1.0, 1.0], [2.0, 1.0], [0.0, 1.0], [1.0, 0.0]]


def test_keep_local_by_hand():
  """2 workers, η = 1, period 2, delay 1, w0 = [0, 4].

  t=1: w = [−1, 5]
  t=2: w = [−2, 4]               snapshot s = [−2, 4] (mean 1)
  t=3: w = [−4, 3] → merge: 1 + (w − s) = [−1, 0]
  t=4: w = [−1, −1]              snapshot s = [−1, −1] (mean −1)
  t=5: w = [−2, −1] → merge: −1 + (w − s) = [−2, −1]
  """
  tx = optax.chain(optax.sgd(1.0), T.delayed_averaging(period=2, delay=1))
  ws, state = _sequence(tx, jnp.array([0.0, 4.0]), HAND_GRADS)
  chex.assert_trees_all_equal(
    ws, jnp.array([[-1.0, 5.0], [-2.0, 4.0], [-1.0, 0.0], [-1.0, -1.0], [-2.0, -1.0]])
  )
  chex.assert_trees_all_equal(state[1].snapshot, jnp.array([-1.0, -1.0]))
  assert int(state[1].count) == 5


def test_mix_by_hand():
  """As above with merge='mix', p = 0.25: w ← 0.25 w + 0.75 w̄.

  t=3: w = [−4, 3], w̄ = mean([−2, 4]) = 1 → [−1 + 0.75, 0.75 + 0.75]
  t=4: w = [−0.25, 0.5]          snapshot (mean 0.125)
  t=5: w = [−1.25, 0.5] → 0.25 w + 0.75·0.125 = [−0.21875, 0.21875]
  """
  tx = optax.chain(optax.sgd(1.0), T.delayed_averaging(2, 1, merge='mix', mix=0.25))
  ws, _ = _sequence(tx, jnp.array([0.0, 4.0]), HAND_GRADS)
  chex.assert_trees_all_equal(
    ws, jnp.array([[-1.0, 5.0], [-2.0, 4.0], [-0.25, 1.5], [-0.25, 0.5], [-0.21875, 0.21875]])
  )


def test_diloco_outer_momentum_by_hand():
  """2 workers, inner η = 1, outer SGD(0.5, momentum 0.5), period 1.

  t=1: local [2, 2] − [1, 3] = [1, −1], w̄ = 0, Δ = 2 − 0 = 2, m = 2,
       anchor = 2 − 0.5·2 = 1 → w = [1, 1]
  t=2: local [1, 1] − [2, 0] = [−1, 1], w̄ = 0, Δ = 1, m = 1 + 0.5·2 = 2,
       anchor = 1 − 1 = 0 → w = [0, 0]
  """
  tx = T.diloco(optax.sgd(1.0), optax.sgd(0.5, momentum=0.5), period=1)
  ws, state = _sequence(tx, jnp.array([2.0, 2.0]), [[1.0, 3.0], [2.0, 0.0]])
  chex.assert_trees_all_equal(ws, jnp.array([[1.0, 1.0], [0.0, 0.0]]))
  chex.assert_trees_all_equal(state[1].anchor, jnp.array([0.0, 0.0]))


# ----------------------------------------------------------- reductions.
@pytest.mark.parametrize(
  'inner', [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9)], ids=['sgd', 'momentum']
)
def test_period_one_delay_zero_is_synchronous_sgd(inner):
  """Averaging the params after every local step = applying the averaged
  gradient (both SGD and momentum are linear in the gradients)."""
  ws = _run(optax.chain(inner, T.delayed_averaging(period=1)), steps=6)
  w, state, ssgd = W0[0], inner.init(W0[0]), []
  for _ in range(6):
    updates, state = inner.update(_grads(w).mean(0), state, w)
    w = optax.apply_updates(w, updates)
    ssgd.append(jnp.broadcast_to(w, (M, D)))
  chex.assert_trees_all_close(ws, jnp.stack(ssgd), rtol=1e-6, atol=1e-6)


def _reference(steps, period, delay, merge='keep_local', mix=0.25, lr=0.1):
  """The paper's pseudo-code, written out literally (DaSGD Algorithm 1)."""
  w, s, out = W0, None, []
  for t in range(1, steps + 1):
    w = w - lr * _grads(w)
    if t % period == 0:
      s = w
    if t >= period and t % period == delay:
      mean = s.mean(0, keepdims=True)
      w = mean + (w - s) if merge == 'keep_local' else mix * w + (1 - mix) * mean
    out.append(w)
  return jnp.stack(out)


@pytest.mark.parametrize(
  'period, delay, merge',
  [
    (3, 0, 'keep_local'),  # Local SGD.
    (3, 1, 'keep_local'),
    (4, 3, 'keep_local'),
    (3, 2, 'mix'),
  ],
)
def test_matches_literal_pseudo_code(period, delay, merge):
  tx = T.local_sgd(optax.sgd(0.1), period, delay, merge=merge)
  ws = _run(tx, steps=10)
  chex.assert_trees_all_close(ws, _reference(10, period, delay, merge), rtol=1e-6, atol=1e-6)
  # A wrong step index must fail: shifting the delay changes the result.
  if delay + 1 < period:
    assert not np.allclose(ws, _reference(10, period, delay + 1, merge), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('delay, merge', [(0, 'keep_local'), (1, 'keep_local'), (2, 'mix')])
def test_diloco_with_unit_outer_sgd_is_local_sgd(delay, merge):
  local = _run(T.local_sgd(optax.sgd(0.1), 3, delay, merge=merge), steps=8)
  dil = _run(T.diloco(optax.sgd(0.1), optax.sgd(1.0), 3, delay, merge=merge), steps=8)
  chex.assert_trees_all_close(dil, local, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  'make',
  [
    lambda o: T.local_sgd(optax.sgd(0.1), 3, 1, overlap=o),
    lambda o: T.diloco(
      optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), 2, 1, merge='mix', overlap=o
    ),
  ],
  ids=['local_sgd', 'diloco'],
)
def test_overlap_flag_does_not_change_results(make):
  chex.assert_trees_all_close(_run(make(False), 7), _run(make(True), 7), rtol=1e-7, atol=1e-7)


# ----------------------------------------------------- mesh / collectives.
def _step_jaxpr(tx, axis_size=4):
  """Per-device jaxpr of one update with a bound mesh axis 'data'."""
  w = jnp.zeros(D)
  return jax.make_jaxpr(lambda g, s, w: tx.update(g, s, w), axis_env=[('data', axis_size)])(
    w, tx.init(w), w
  )


def _collective_reads_current_step(closed_jaxpr, num_state_leaves):
  """Whether any psum reads a value derived from this step's grads/params.

  Inputs are flattened as (grads, state, params); grads are the first D-leaf
  and params the last: taint them and propagate through the equations.
  """
  jaxpr = closed_jaxpr.jaxpr
  invars = jaxpr.invars
  tainted = {invars[0], invars[-1]}
  assert len(invars) == 2 + num_state_leaves
  reads_current, n_collectives = False, 0
  for eqn in jaxpr.eqns:
    hit = any(v in tainted for v in eqn.invars if not hasattr(v, 'val'))
    if eqn.primitive.name.startswith('psum'):
      n_collectives += 1
      reads_current |= hit
    if hit:
      tainted.update(eqn.outvars)
  assert n_collectives > 0  # The all-reduce is a top-level op.
  return reads_current


@pytest.mark.parametrize(
  'make',
  [
    lambda d: T.delayed_averaging(3, d, axis_name='data'),
    lambda d: T.diloco_outer_step(
      optax.sgd(0.7, momentum=0.9, nesterov=True), 3, d, axis_name='data', merge='mix'
    ),
  ],
  ids=['delayed_averaging', 'diloco'],
)
def test_all_reduce_is_independent_of_current_step(make):
  """delay >= 1: the pmean reads only the state's snapshot, so XLA may run it
  concurrently with the step's compute; delay = 0 must read the step."""
  for delay, expected in [(1, False), (2, False), (0, True)]:
    tx = make(delay)
    n_state = len(jax.tree.leaves(tx.init(jnp.zeros(D))))
    assert _collective_reads_current_step(_step_jaxpr(tx), n_state) == expected


MESH_CASES = {
  'keep_local': lambda axis: optax.chain(optax.sgd(0.1), T.delayed_averaging(3, 1, axis_name=axis)),
  'mix_no_overlap': lambda axis: optax.chain(
    optax.sgd(0.1, momentum=0.9),
    T.delayed_averaging(2, 1, axis_name=axis, merge='mix', overlap=False),
  ),
  'local_sgd': lambda axis: T.local_sgd(optax.adam(0.05), 3, axis_name=axis),
  'diloco_streaming': lambda axis: T.diloco(
    optax.sgd(0.1),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    3,
    2,
    axis_name=axis,
    merge='mix',
    mix=0.5,
  ),
}


def mesh_vs_stacked_max_diffs(steps=8):
  """Runs each case stacked and through shard_map on 4 devices; max |diff|."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((M,), ('data',), devices=jax.devices()[:M])
  rows = NamedSharding(mesh, P('data'))
  spec = lambda tree: jax.tree.map(lambda x: P() if jnp.ndim(x) == 0 else P('data'), tree)
  diffs = {}
  for name, make in MESH_CASES.items():
    stacked = _run(make(None), steps)
    tx = make('data')

    def step(w, targets, state, tx=tx):
      updates, state = tx.update(_grads(w, targets), state, w)
      return optax.apply_updates(w, updates), state

    w, targets = jax.device_put(W0, rows), jax.device_put(TARGETS, rows)
    state_spec = spec(jax.eval_shape(tx.init, W0[:1]))
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P('data'), out_specs=state_spec)
    state = jax.jit(init)(w)
    step = jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P('data'), P('data'), state_spec),
        out_specs=(P('data'), state_spec),
      )
    )
    out = []
    for _ in range(steps):
      w, state = step(w, targets, state)
      out.append(w)
    diffs[name] = float(jnp.max(jnp.abs(jnp.stack(out) - stacked)))
  return diffs


def test_shard_map_on_4_devices_equals_stacked_workers():
  if len(jax.devices()) >= M:
    diffs = mesh_vs_stacked_max_diffs()
  else:  # Fake devices must be set before JAX starts: use a fresh process.
    here = pathlib.Path(__file__).resolve().parent
    env = dict(
      os.environ,
      XLA_FLAGS='--xla_force_host_platform_device_count=4',
      JAX_PLATFORMS='cpu',
      PYTHONPATH=os.pathsep.join(
        [str(here), str(here.parents[1]), os.environ.get('PYTHONPATH', '')]
      ),
    )
    code = (
      'import json, test_delayed_averaging as t; print(json.dumps(t.mesh_vs_stacked_max_diffs()))'
    )
    proc = subprocess.run(
      [sys.executable, '-c', code], env=env, cwd=here, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(diffs) == set(MESH_CASES)
  for name, diff in diffs.items():
    assert diff <= 1e-6, (name, diff)


# ------------------------------------------------------------- bad input.
@pytest.mark.parametrize(
  'kwargs, error, match',
  [
    (dict(period=0), ValueError, r'period must be an int >= 1'),
    (dict(period=2.5), TypeError, r'period must be an int'),
    (dict(period=3, delay=-1), ValueError, r'delay must be an int >= 0'),
    (
      dict(period=3, delay=3),
      ValueError,
      r'delay must be < period \(0 <= delay < period\); got delay=3, period=3',
    ),
    (
      dict(period=3, merge='average'),
      ValueError,
      r"merge must be one of \('keep_local', 'mix'\); got 'average'",
    ),
    (dict(period=3, merge='mix', mix=1.5), ValueError, r'mix must be in \[0, 1\]; got 1.5'),
    (dict(period=3, mix=-0.1), ValueError, r'mix must be in \[0, 1\]'),
    (dict(period=3, axis_name=0), TypeError, r'axis_name must be None'),
    (dict(period=3, overlap='yes'), TypeError, r'overlap must be a bool'),
  ],
)
def test_bad_arguments_raise(kwargs, error, match):
  with pytest.raises(error, match=match):
    T.delayed_averaging(**kwargs)


def test_bad_arguments_raise_for_diloco_and_local_sgd():
  with pytest.raises(
    TypeError,
    match=r'outer must be an optax '
    r'GradientTransformation',
  ):
    T.diloco(optax.sgd(0.1), 0.7, period=2)
  with pytest.raises(ValueError, match=r'delay must be < period'):
    T.local_sgd(optax.sgd(0.1), period=2, delay=2)


def test_unstacked_params_are_refused_without_axis_name():
  tx = T.delayed_averaging(2)
  with pytest.raises(ValueError, match=r'params must be stacked'):
    tx.init({'a': jnp.zeros((2, 3)), 'b': jnp.zeros(3)})
  with pytest.raises(ValueError, match=r'params must be stacked'):
    tx.init(jnp.zeros(()))


def test_traced_period_under_inject_hyperparams_names_static_args():
  tx = optax.inject_hyperparams(T.delayed_averaging)(period=2, delay=1)
  w = jnp.zeros((2, 3))
  state = tx.init(w)
  with pytest.raises(
    TypeError,
    match=r'period must be a Python int.*'
    r"static_args=\('period', 'delay'\)",
  ):
    jax.jit(tx.update)(w, state, w)
  tx = optax.inject_hyperparams(T.delayed_averaging, static_args=('period', 'delay'))(period=2)
  jax.jit(tx.update)(w, tx.init(w), w)  # Fine once static.


def test_missing_params_raise():
  tx = T.delayed_averaging(2)
  with pytest.raises(
    TypeError,
    match=r'requires the keyword argument '
    r'`params`',
  ):
    tx.update(jnp.zeros((2, 3)), tx.init(jnp.zeros((2, 3))))


@pytest.mark.parametrize('workers', [3, 12])  # Unrolled sum and matvec paths.
def test_stacked_average_is_the_row_mean(workers):
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.normal(size=(workers, 5)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(workers, 5)), jnp.float32)
  tx = T.local_sgd(optax.sgd(0.5), period=1)
  updates, _ = jax.jit(tx.update)(g, tx.init(w), w)
  expected = jnp.broadcast_to((w - 0.5 * g).mean(0), w.shape)
  chex.assert_trees_all_close(optax.apply_updates(w, updates), expected, rtol=1e-6, atol=1e-6)


def test_donated_step_updates_params_and_snapshot_in_place():
  """No copy of a [M, ...] buffer in the compiled step (a 10x slowdown on CPU
  when the snapshot was built from the old params)."""
  tx = optax.chain(optax.sgd(0.1), T.delayed_averaging(4, 1))
  w = jnp.zeros((M, 4096))

  def step(w, state, g):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  hlo = jax.jit(step, donate_argnums=(0, 1)).lower(w, tx.init(w), w).compile().as_text()
  big_copies = [line for line in hlo.splitlines() if ' copy(' in line and f'[{M},4096]' in line]
  assert not big_copies, big_copies
