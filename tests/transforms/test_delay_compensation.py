"""Exact tests of DC-ASGD: hand-computed steps, reductions, Taylor identity."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsgd.transforms as T

# Small numbers that are exact in binary, so hand results compare with ==.
W0 = jnp.array([1.0, 2.0])


def _step(tx, state, w, g, **extra):
  updates, state = jax.jit(tx.update)(g, state, w, **extra)
  return optax.apply_updates(w, updates), state


def test_constant_lambda_two_steps_by_hand():
  """DC-ASGD-c, λ = 0.5, η = 0.5: w ← w − η (g + λ g² (w − w_bak)).

  step 1: g = [2, −1], w_bak = [0.5, 2], w − w_bak = [0.5, 0]
          g̃ = [2 + 0.5·4·0.5, −1 + 0] = [3, −1];  w = [1 − 1.5, 2 + 0.5]
  step 2: g = [1, 2], w_bak = [1, 2] (= w0), w − w_bak = [−1.5, 0.5]
          g̃ = [1 + 0.5·1·(−1.5), 2 + 0.5·4·0.5] = [0.25, 3]
          w = [−0.5 − 0.125, 2.5 − 1.5]
  """
  tx = T.dc_asgd(0.5, lambda0=0.5)
  state = tx.init(W0)
  w1, state = _step(tx, state, W0, jnp.array([2.0, -1.0]), stale_params=jnp.array([0.5, 2.0]))
  chex.assert_trees_all_equal(w1, jnp.array([-0.5, 2.5]))
  w2, state = _step(tx, state, w1, jnp.array([1.0, 2.0]), stale_params=W0)
  chex.assert_trees_all_equal(w2, jnp.array([-0.625, 1.0]))


def test_adaptive_lambda_two_steps_by_hand():
  """DC-ASGD-a, λ0 = 1, m = 0.75, ε = 0, η = 0.5; MeanSquare updated first.

  step 1: g = [2, −1]: MS = 0.25·[4, 1] = [1, 0.25]; λ = 1/√MS = [1, 2]
          w − w_bak = [1, 2] − [0.5, 1.5] = [0.5, 0.5]
          g̃ = [2 + 1·4·0.5, −1 + 2·1·0.5] = [4, 0];  w = [−1, 2]
  step 2: g = [1, 0.5]: MS = 0.75·[1, 0.25] + 0.25·[1, 0.25] = [1, 0.25]
          λ = [1, 2]; w − w_bak = [−1, 2] − [0, 1.5] = [−1, 0.5]
          g̃ = [1 + 1·1·(−1), 0.5 + 2·0.25·0.5] = [0, 0.75];  w = [−1, 1.625]
  """
  tx = T.dc_asgd(0.5, lambda0=1.0, adaptive=True, mean_square_decay=0.75, eps=0.0)
  state = tx.init(W0)
  w1, state = _step(tx, state, W0, jnp.array([2.0, -1.0]), stale_params=jnp.array([0.5, 1.5]))
  chex.assert_trees_all_equal(w1, jnp.array([-1.0, 2.0]))
  chex.assert_trees_all_equal(state[0].mean_square, jnp.array([1.0, 0.25]))
  w2, state = _step(tx, state, w1, jnp.array([1.0, 0.5]), stale_params=jnp.array([0.0, 1.5]))
  chex.assert_trees_all_equal(w2, jnp.array([-1.0, 1.625]))
  chex.assert_trees_all_equal(state[0].mean_square, jnp.array([1.0, 0.25]))


def test_server_keeps_backups_set_at_pull_time():
  """Algorithm 2 with M = 2, λ = 0.5, η = 0.5 (backups start at w0).

  worker 0 pushes g = [2, −1] from w0: w − w_bak = 0, g̃ = g, w1 = [0, 2.5];
  worker 0 pulls w1.  Worker 1 pushes g = [1, 2], computed at its backup w0:
  w1 − w0 = [−1, 0.5], g̃ = [1 − 0.5, 2 + 0.5·4·0.5] = [0.5, 3],
  w2 = [−0.25, 1].  Backups are then [w1, w0]; worker 1 pulls w2.
  """
  tx = T.dc_asgd_server(0.5, num_workers=2, lambda0=0.5)
  state = tx.init(W0)
  w1, state = _step(tx, state, W0, jnp.array([2.0, -1.0]), worker_id=0)
  chex.assert_trees_all_equal(w1, jnp.array([0.0, 2.5]))
  state = jax.jit(tx.pull)(state, w1, 0)
  w2, state = _step(
    tx, state, w1, jnp.array([1.0, 2.0]), worker_id=jnp.int32(1)
  )  # A traced worker id.
  chex.assert_trees_all_equal(w2, jnp.array([-0.25, 1.0]))
  chex.assert_trees_all_equal(state[0].backups, jnp.stack([w1, W0]))
  state = T.record_pull(state, w2, 1)
  chex.assert_trees_all_equal(state[0].backups, jnp.stack([w1, w2]))


def test_per_worker_mean_square_keeps_one_row_per_worker():
  """m = 0.75: worker 1 pushes g = [2, 2] then worker 0 pushes g = [4, 0].

  MS[1] = 0.25·[4, 4] = [1, 1] after the first push, MS[0] untouched;
  MS[0] = 0.25·[16, 0] = [4, 0] after the second, MS[1] untouched.
  """
  tx = T.delay_compensation_server(
    2, lambda0=1.0, adaptive=True, mean_square_decay=0.75, per_worker_mean_square=True
  )
  state = tx.init(W0)
  _, state = jax.jit(tx.update)(jnp.array([2.0, 2.0]), state, W0, worker_id=1)
  chex.assert_trees_all_equal(state.compensation.mean_square, jnp.array([[0.0, 0.0], [1.0, 1.0]]))
  _, state = jax.jit(tx.update)(jnp.array([4.0, 0.0]), state, W0, worker_id=0)
  chex.assert_trees_all_equal(state.compensation.mean_square, jnp.array([[4.0, 0.0], [1.0, 1.0]]))


@pytest.mark.parametrize('adaptive', [False, True])
def test_lambda_zero_is_plain_sgd_bit_for_bit(adaptive):
  """λ0 = 0 must give exactly ASGD, i.e. optax.sgd on the stale gradient."""
  rng = np.random.default_rng(1)
  params = {
    'w': jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
    'b': jnp.asarray(rng.normal(size=3), jnp.float32),
  }
  dc, sgd = T.dc_asgd(0.3, lambda0=0.0, adaptive=adaptive), optax.sgd(0.3)
  w_dc, w_sgd, s_dc, s_sgd = params, params, dc.init(params), sgd.init(params)
  dc_update, sgd_update = jax.jit(dc.update), jax.jit(sgd.update)
  for _ in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    stale = jax.tree.map(lambda x: x + 1.0, w_dc)
    u_dc, s_dc = dc_update(grads, s_dc, w_dc, stale_params=stale)
    u_sgd, s_sgd = sgd_update(grads, s_sgd, w_sgd)
    chex.assert_trees_all_equal(u_dc, u_sgd)
    w_dc, w_sgd = optax.apply_updates(w_dc, u_dc), optax.apply_updates(w_sgd, u_sgd)
  chex.assert_trees_all_equal(w_dc, w_sgd)


@pytest.mark.parametrize('adaptive', [False, True])
def test_compensated_gradient_is_exact_on_matching_quadratic(adaptive):
  """The correction is the exact second-order Taylor term on a quadratic.

  Take any w_bak, g and λ_t (the λ the transform uses at this step), and

      f(w) = gᵀ(w − w_bak) + ½ (w − w_bak)ᵀ H (w − w_bak),
      H = diag(λ_t ⊙ g ⊙ g).

  Then ∇f(w_bak) = g and, f being quadratic, ∇f(w) = ∇f(w_bak) + H (w − w_bak)
  = g + λ_t ⊙ g ⊙ g ⊙ (w − w_bak) exactly: the compensated gradient computed
  from the stale g equals the true gradient at the current w.
  """
  rng = np.random.default_rng(2)
  w_bak, w, g = (jnp.asarray(rng.normal(size=6), jnp.float32) for _ in range(3))
  tx = T.scale_by_delay_compensation(
    lambda0=0.7, adaptive=adaptive, mean_square_decay=0.9, eps=1e-7
  )
  compensated, _ = jax.jit(tx.update)(g, tx.init(w), w, stale_params=w_bak)
  lam = 0.7 / jnp.sqrt(0.1 * g * g + 1e-7) if adaptive else 0.7
  hessian_diag = lam * g * g
  f = lambda v: g @ (v - w_bak) + 0.5 * (v - w_bak) @ (hessian_diag * (v - w_bak))
  chex.assert_trees_all_close(jax.grad(f)(w_bak), g, rtol=0, atol=0)
  chex.assert_trees_all_close(compensated, jax.grad(f)(w), rtol=2e-6)


def test_low_precision_gradients_compensate_in_float32():
  """fp16 g⊙g underflows (1e-4² < fp16's tiniest); the float32 path does not."""
  w, w_bak = jnp.array([1.0], jnp.float16), jnp.array([0.0], jnp.float16)
  g = jnp.array([1e-4], jnp.float16)
  tx = T.scale_by_delay_compensation(lambda0=1.0, adaptive=True, mean_square_decay=0.0, eps=0.0)
  out, state = jax.jit(tx.update)(g, tx.init(w), w, stale_params=w_bak)
  assert out.dtype == jnp.float16 and state.mean_square.dtype == jnp.float32
  # λ = 1/|g| so g̃ = g + |g|·(w − w_bak) = 2g.
  chex.assert_trees_all_close(out.astype(jnp.float32), 2 * g.astype(jnp.float32), rtol=1e-3)


def test_dc_asgd_defaults_follow_the_paper():
  """λ0 defaults to 0.04 (constant) and 2 (adaptive), m = 0.95, ε = 1e-7."""
  assert (T.CONSTANT_LAMBDA0, T.ADAPTIVE_LAMBDA0) == (0.04, 2.0)
  w, w_bak, g = jnp.array([1.0]), jnp.array([0.0]), jnp.array([3.0])
  for adaptive, lam in [(False, 0.04), (True, 2.0 / np.sqrt(0.05 * 9.0 + 1e-7))]:
    tx = T.scale_by_delay_compensation(adaptive=adaptive)
    out, _ = tx.update(g, tx.init(w), w, stale_params=w_bak)
    chex.assert_trees_all_close(out, 3.0 + lam * 9.0, rtol=1e-6)


# ------------------------------------------------------------- bad input.
@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(lambda0=-0.1), r'lambda0 must be >= 0'),
    (
      dict(adaptive=True, mean_square_decay=1.0),
      r'mean_square_decay must be '
      r'in \[0, 1\)',
    ),
    (dict(adaptive=True, mean_square_decay=-0.5), r'mean_square_decay'),
    (dict(adaptive=True, eps=-1e-8), r'eps must be >= 0'),
    (
      dict(adaptive=True, per_worker_mean_square=True),
      r'per_worker_mean_square=True needs num_workers',
    ),
    (
      dict(per_worker_mean_square=True, num_workers=2),
      r'per_worker_mean_square=True needs adaptive=True',
    ),
    (dict(num_workers=0), r'num_workers must be an int >= 1'),
  ],
)
def test_bad_constructor_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    T.scale_by_delay_compensation(**kwargs)


def test_bad_server_arguments_raise():
  with pytest.raises(ValueError, match=r'num_workers must be an int >= 1'):
    T.dc_asgd_server(0.1, num_workers=0)
  with pytest.raises(TypeError, match=r'num_workers must be an int'):
    T.delay_compensation_server(num_workers=2.5)
  with pytest.raises(TypeError, match=r'adaptive must be a bool'):
    T.dc_asgd(0.1, adaptive='yes')


def test_missing_or_mismatched_extra_arguments_raise():
  w = {'a': jnp.zeros(2), 'b': jnp.zeros(())}
  tx = T.dc_asgd(0.1)
  state = tx.init(w)
  with pytest.raises(
    TypeError,
    match=r'requires the keyword argument '
    r'`stale_params`',
  ):
    tx.update(w, state, w)
  with pytest.raises(
    ValueError,
    match=r'stale_params must have the same tree '
    r'structure as params',
  ):
    tx.update(w, state, w, stale_params={'a': jnp.zeros(2)})
  with pytest.raises(TypeError, match=r'`params`'):
    tx.update(w, state, stale_params=w)
  per_worker = T.dc_asgd(0.1, adaptive=True, per_worker_mean_square=True, num_workers=2)
  with pytest.raises(TypeError, match=r'`worker_id`'):
    per_worker.update(w, per_worker.init(w), w, stale_params=w)


def test_server_worker_id_required_and_in_range():
  w = jnp.zeros(2)
  tx = T.dc_asgd_server(0.1, num_workers=2)
  state = tx.init(w)
  with pytest.raises(
    TypeError,
    match=r'requires the keyword argument '
    r'`worker_id`',
  ):
    tx.update(w, state, w)
  with pytest.raises(
    ValueError,
    match=r'worker_id must be in \[0, '
    r'num_workers=2\)',
  ):
    tx.update(w, state, w, worker_id=2)
  with pytest.raises(ValueError, match=r'worker_id must be in'):
    tx.pull(state, w, -1)
  with pytest.raises(
    ValueError,
    match=r'params must have the same tree '
    r'structure as the server backups',
  ):
    tx.pull(state, {'w': w}, 0)
  with pytest.raises(ValueError, match=r'holds no DelayCompensationServerState'):
    T.record_pull(optax.sgd(0.1).init(w), w, 0)
