"""Exact tests of streaming DiLoCo (`jaxsgd.transforms.streaming`).

Workers are rows of stacked params (`axis_name=None`); the SPMD path is tested in
tests/spmd (the `streaming_diloco` algorithm).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsgd.transforms as T

M = 2
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _params(rng, modules=4, size=3):
  """`modules` modules of one [M, size] kernel and one [M] bias, same on every worker."""
  return {
    f'layer_{i}': {
      'kernel': jnp.asarray(np.tile(rng.normal(size=size), (M, 1)), jnp.float32),
      'bias': jnp.asarray(np.tile(rng.normal(size=1), M), jnp.float32),
    }
    for i in range(modules)
  }


def _grad_fn(rng, params):
  """Per-worker quadratic pulls towards different targets: workers diverge."""
  targets = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
  return lambda w: jax.tree.map(lambda a, b: 0.5 * (a - b), w, targets)


def _run(tx, params, grads, steps):
  """`steps` jitted updates; returns the params after each step and the last state."""

  @jax.jit
  def step(w, state):
    updates, state = tx.update(grads(w), state, w)
    return optax.apply_updates(w, updates), state

  state, out = tx.init(params), []
  for _ in range(steps):
    params, state = step(params, state)
    out.append(params)
  return out, state


# ----------------------------------------------------------------- reductions.
def test_one_fragment_no_overlap_alpha0_is_diloco_bit_for_bit():
  rng = np.random.default_rng(0)
  params = _params(rng)
  grads = _grad_fn(rng, params)
  inner = optax.adam(0.05)
  streaming, _ = _run(
    T.streaming_diloco(inner, NESTEROV, period=3, fragments=1, delay=0, mix=0.0), params, grads, 10
  )
  diloco, _ = _run(T.diloco(inner, NESTEROV, period=3), params, grads, 10)
  chex.assert_trees_all_equal(streaming, diloco)
  assert not np.allclose(streaming[-1]['layer_0']['kernel'][0], params['layer_0']['kernel'][0])


def test_one_fragment_with_overlap_and_mixing_is_overlapped_diloco_bit_for_bit():
  """τ = 2, α = 0.5 on one fragment = `diloco(delay=2, merge='mix', mix=0.5)`."""
  rng = np.random.default_rng(1)
  params = _params(rng)
  grads = _grad_fn(rng, params)
  streaming, _ = _run(
    T.streaming_diloco(optax.sgd(0.1), NESTEROV, period=4, fragments=1, delay=2, mix=0.5),
    params,
    grads,
    11,
  )
  diloco, _ = _run(
    T.diloco(optax.sgd(0.1), NESTEROV, period=4, delay=2, merge='mix', mix=0.5), params, grads, 11
  )
  chex.assert_trees_all_equal(streaming, diloco)


# ------------------------------------------------------------------ by hand.
def test_two_fragments_by_hand():
  """2 workers, modules a and b (one scalar each), inner SGD η = 1 with gradients
  +1 (worker 0) and −3 (worker 1); outer SGD 0.5: θ ← θ − 0.5 (θ − s̄); H = 4, P = 2,
  τ = 1, α = 0.5: w ← 0.5 w + 0.5 θ. Fragment a syncs at t = 4 (merges at 5),
  fragment b at t = 2, 6 (merges at 3, 7).

  t=1: a = [−1, 3]            b = [−1, 3]
  t=2: a = [−2, 6]            b = [−2, 6]     b sends s_b = [−2, 6] (mean 2)
  t=3: a = [−3, 9]            b = [−3, 9] → θ_b = 0.5·0 + 0.5·2 = 1, b = [−1, 5]
  t=4: a = [−4, 12]           b = [−2, 8]     a sends s_a = [−4, 12] (mean 4)
  t=5: a = [−5, 15] → θ_a = 2, a = [−1.5, 8.5]      b = [−3, 11]
  t=6: a = [−2.5, 11.5]       b = [−4, 14]    b sends s_b = [−4, 14] (mean 5)
  t=7: a = [−3.5, 14.5]       b = [−5, 17] → θ_b = 0.5·1 + 0.5·5 = 3, b = [−1, 10]
  """
  params = {'a': {'w': jnp.zeros(M)}, 'b': {'w': jnp.zeros(M)}}
  grads = lambda w: jax.tree.map(lambda x: jnp.array([1.0, -3.0]), w)
  tx = T.streaming_diloco(optax.sgd(1.0), optax.sgd(0.5), period=4, fragments=2, delay=1, mix=0.5)
  out, state = _run(tx, params, grads, 7)
  a = [[-1, 3], [-2, 6], [-3, 9], [-4, 12], [-1.5, 8.5], [-2.5, 11.5], [-3.5, 14.5]]
  b = [[-1, 3], [-2, 6], [-1, 5], [-2, 8], [-3, 11], [-4, 14], [-1, 10]]
  chex.assert_trees_all_equal(jnp.stack([w['a']['w'] for w in out]), jnp.asarray(a, 'float32'))
  chex.assert_trees_all_equal(jnp.stack([w['b']['w'] for w in out]), jnp.asarray(b, 'float32'))
  outer = state[1]
  chex.assert_trees_all_equal(
    outer.anchor, {'a': {'w': jnp.full(M, 2.0)}, 'b': {'w': jnp.full(M, 3.0)}}
  )
  assert int(outer.count) == 7


def _reference(params, grads, steps, *, lr, outer_lr, period, fragments, delay, mix, groups):
  """The paper's procedure written out literally (numpy, per fragment, outer SGD)."""
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  w = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  theta = [x.copy() for x in w]
  sent, out = [None] * len(w), []
  for t in range(1, steps + 1):
    g = jax.tree.leaves(
      grads(jax.tree.unflatten(jax.tree.structure(params), [x.astype(np.float32) for x in w]))
    )
    w = [x - lr * np.asarray(gi, np.float64) for x, gi in zip(w, g)]
    for p, group in enumerate(groups):
      offset = p * period // fragments
      if t - offset >= 0 and (t - offset) % period == 0:
        for i in group:
          sent[i] = w[i].copy()
      if t - delay - offset >= 0 and (t - delay - offset) % period == 0 and t - delay >= 1:
        for i in group:
          delta = theta[i] - sent[i].mean(0, keepdims=True)
          theta[i] = theta[i] - outer_lr * delta
          w[i] = mix * w[i] + (1 - mix) * theta[i]
    out.append(dict(zip(names, w)))
  return out


@pytest.mark.parametrize(
  'fragments, period, delay, mix, pattern',
  [
    (2, 4, 1, 0.5, 'strided'),
    (2, 4, 1, 0.5, 'sequential'),
    (4, 8, 1, 0.0, 'strided'),
    (3, 6, 0, 0.25, 'strided'),
  ],
)
def test_matches_literal_pseudo_code(fragments, period, delay, mix, pattern):
  rng = np.random.default_rng(2)
  params = _params(rng, modules=4)
  grads = _grad_fn(rng, params)
  tx = T.streaming_diloco(
    optax.sgd(0.1),
    optax.sgd(0.7),
    period=period,
    fragments=fragments,
    delay=delay,
    mix=mix,
    pattern=pattern,
  )
  out, _ = _run(tx, params, grads, 2 * period + 3)
  groups = T.fragment_leaves(params, fragments, pattern)
  expected = _reference(
    params,
    grads,
    2 * period + 3,
    lr=0.1,
    outer_lr=0.7,
    period=period,
    fragments=fragments,
    delay=delay,
    mix=mix,
    groups=groups,
  )
  for got, want in zip(out, expected):
    flat = {
      jax.tree_util.keystr(p): np.asarray(x)
      for p, x in jax.tree_util.tree_flatten_with_path(got)[0]
    }
    for name in want:
      np.testing.assert_allclose(flat[name], want[name], rtol=1e-5, atol=1e-6)
  # The schedule matters: a one-step shift of the delay fails the comparison.
  shifted = _reference(
    params,
    grads,
    2 * period + 3,
    lr=0.1,
    outer_lr=0.7,
    period=period,
    fragments=fragments,
    delay=delay + 1,
    mix=mix,
    groups=groups,
  )
  last = {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_flatten_with_path(out[-1])[0]
  }
  assert not all(np.allclose(last[n], shifted[-1][n], rtol=1e-5, atol=1e-6) for n in last)


def test_fragments_are_modules_dealt_strided_or_sequential():
  params = {f'layer_{i}': {'bias': jnp.zeros(M), 'kernel': jnp.zeros((M, 2))} for i in range(5)}
  # Leaves in tree order: layer_0.bias, layer_0.kernel, layer_1.bias, ...
  assert T.fragment_leaves(params, 2, 'strided') == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7]]
  assert T.fragment_leaves(params, 2, 'sequential') == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
  assert T.fragment_leaves({'a': jnp.zeros(M), 'b': jnp.zeros(M)}, 2) == [[0], [1]]


def test_only_the_due_fragment_changes_at_a_merge():
  """At fragment b's merge (t = 3 above) fragment a's update is the inner one."""
  params = {'a': {'w': jnp.zeros(M)}, 'b': {'w': jnp.zeros(M)}}
  tx = T.streaming_diloco(optax.sgd(1.0), optax.sgd(0.5), period=4, fragments=2, delay=1, mix=0.5)
  out, state = _run(tx, params, lambda w: jax.tree.map(lambda x: jnp.array([1.0, -3.0]), w), 3)
  chex.assert_trees_all_equal(out[-1]['a']['w'], jnp.array([-3.0, 9.0]))
  # Fragment a's outer state never moved (momentum-free SGD has an empty state; the
  # anchor shows it): still the initial params.
  chex.assert_trees_all_equal(state[1].anchor['a']['w'], jnp.zeros(M))


# --------------------------------------------------------------- bad input.
@pytest.mark.parametrize(
  'kwargs, error, match',
  [
    (dict(period=4, fragments=3), ValueError, r'period must be a multiple of fragments'),
    (
      dict(period=4, fragments=2, delay=2),
      ValueError,
      r'delay must be < period / fragments \(one fragment in flight',
    ),
    (dict(period=4, fragments=0), ValueError, r'fragments must be an int >= 1'),
    (dict(period=4, mix=1.5), ValueError, r'mix must be in \[0, 1\]; got 1.5'),
    (dict(period=4, pattern='random'), ValueError, r"pattern must be one of \('strided'"),
    (dict(period=4, overlap=1), TypeError, r'overlap must be a bool'),
  ],
)
def test_bad_arguments_raise(kwargs, error, match):
  with pytest.raises(error, match=match):
    T.streaming_diloco_outer_step(NESTEROV, **kwargs)


def test_too_few_modules_for_the_fragments_are_refused():
  tx = T.streaming_diloco_outer_step(NESTEROV, period=4, fragments=4)
  with pytest.raises(ValueError, match=r'fragments: 4 fragments need at least 4 modules'):
    tx.init({'a': {'w': jnp.zeros((M, 3)), 'b': jnp.zeros((M,))}})
