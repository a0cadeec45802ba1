"""`delayed_nesterov`: a hand-computed run, and the two methods it must equal."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsgd import transforms


def _run(tx, pseudo_gradients, params):
  """Applies `tx` to each arriving pseudo-gradient in turn; the params after each."""
  state, seen = tx.init(params), []
  update = jax.jit(tx.update)
  for delta in pseudo_gradients:
    updates, state = update(delta, state, params)
    params = optax.apply_updates(params, updates)
    seen.append(params)
  return seen, state


def test_hand_computed_every_two():
  # ε = 0.5, β = 0.5, N = 2, θ₀ = 10, Δ = 2, 4, 6, 8 (binary fractions: exact floats).
  # t=1: plain:    θ = 10 − 0.5·2/2 = 9.5;                    A = 2, m = 0
  # t=2: momentum: A = 6, m = 6/2 + 0.5·0 = 3,
  #                θ = 9.5 − 0.5·(4/2 + 0.5·3) = 9.5 − 1.75 = 7.75;   A = 0
  # t=3: plain:    θ = 7.75 − 0.5·6/2 = 6.25;                 A = 6, m = 3
  # t=4: momentum: A = 14, m = 14/2 + 0.5·3 = 8.5,
  #                θ = 6.25 − 0.5·(8/2 + 0.5·8.5) = 6.25 − 4.125 = 2.125
  tx = transforms.delayed_nesterov(learning_rate=0.5, momentum=0.5, every=2)
  deltas = [jnp.float32(d) for d in (2.0, 4.0, 6.0, 8.0)]
  seen, state = _run(tx, deltas, jnp.float32(10.0))
  np.testing.assert_array_equal(np.array(seen), [9.5, 7.75, 6.25, 2.125])
  assert int(state.count) == 4
  assert float(state.momentum) == 8.5 and float(state.accumulated) == 0.0


def _tree(key):
  a, b = jax.random.split(key)
  return {'w': jax.random.normal(a, (3, 4)), 'b': jax.random.normal(b, (4,))}


def test_every_one_is_nesterov_bit_for_bit():
  deltas = [_tree(jax.random.key(i)) for i in range(6)]
  params = _tree(jax.random.key(99))
  ours, _ = _run(transforms.delayed_nesterov(0.7, 0.9, every=1), deltas, params)
  nesterov, _ = _run(optax.sgd(0.7, momentum=0.9, nesterov=True), deltas, params)
  for a, b in zip(ours, nesterov):
    chex.assert_trees_all_equal(a, b)


def test_n_arrivals_from_one_point_are_one_diloco_step_on_their_mean():
  # Rounds of N pseudo-gradients that all left from the same θ (synchronous workers):
  # DN moves θ per round as DiLoCo's outer Nesterov on the round's mean (up to rounding).
  n, rounds = 3, 4
  deltas = [_tree(jax.random.key(i)) for i in range(n * rounds)]
  params = _tree(jax.random.key(99))
  ours, _ = _run(transforms.delayed_nesterov(0.7, 0.9, every=n), deltas, params)
  means = [jax.tree.map(lambda *d: sum(d) / n, *deltas[r * n : (r + 1) * n]) for r in range(rounds)]
  diloco, _ = _run(optax.sgd(0.7, momentum=0.9, nesterov=True), means, params)
  for r in range(rounds):
    chex.assert_trees_all_close(ours[(r + 1) * n - 1], diloco[r], rtol=1e-6, atol=1e-6)
