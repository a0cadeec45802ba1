"""Exact tests of the staleness-aware learning rate."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxsgd.transforms as T


def test_two_steps_by_hand():
  """η = 1, f = 1/τ: τ = 4 scales g = [2, −8] by 1/4, τ = 0 counts as τ = 1.

  step 1: u = −[0.5, −2];  w = [0, 0] + u = [−0.5, 2]
  step 2: τ = 0 → 1, u = −[1, 1]; w = [−1.5, 1]
  """
  tx = optax.chain(T.scale_by_staleness(T.inverse_staleness), optax.sgd(1.0))
  w = jnp.zeros(2)
  state = tx.init(w)
  update = jax.jit(tx.update)
  u, state = update(jnp.array([2.0, -8.0]), state, w, staleness=4)
  w = optax.apply_updates(w, u)
  chex.assert_trees_all_equal(w, jnp.array([-0.5, 2.0]))
  u, state = update(jnp.array([1.0, 1.0]), state, w, staleness=0)
  chex.assert_trees_all_equal(optax.apply_updates(w, u), jnp.array([-1.5, 1.0]))


@pytest.mark.parametrize(
  'fn, tau, scale',
  [
    (T.inverse_staleness, 0, 1.0),
    (T.inverse_staleness, 1, 1.0),
    (T.inverse_staleness, 8, 0.125),
    (T.inverse_sqrt_staleness, 0, 1.0),
    (T.inverse_sqrt_staleness, 16, 0.25),
    (T.power_staleness(2.0), 4, 1.0 / 16),
    (T.power_staleness(0.0), 7, 1.0),
  ],
)
def test_helpers_and_zero_guard(fn, tau, scale):
  tx = T.scale_by_staleness(fn)
  u = {'a': jnp.full(3, 4.0, jnp.bfloat16), 'b': jnp.full(2, 4.0)}
  out, _ = jax.jit(tx.update)(u, tx.init(u), staleness=jnp.int32(tau))
  chex.assert_trees_all_equal_dtypes(out, u)
  chex.assert_trees_all_equal(out['b'], jnp.full(2, 4.0 * scale))
  chex.assert_trees_all_equal(out['a'], jnp.full(3, 4.0 * scale, jnp.bfloat16))


def test_bad_input_raises():
  tx = T.scale_by_staleness(T.inverse_staleness)
  with pytest.raises(
    TypeError,
    match=r'requires the keyword argument '
    r'`staleness`',
  ):
    tx.update(jnp.ones(2), tx.init(jnp.ones(2)))
  with pytest.raises(TypeError, match=r'fn must be a callable'):
    T.scale_by_staleness(2.0)
  with pytest.raises(ValueError, match=r'power must be >= 0'):
    T.power_staleness(-1.0)
