"""The contract every jaxsgd transform keeps, run over all of them.

Each case builds a full optimizer around the transform under test and says how
the gradients are read: 'stale' (computed at the previous params and passed as
`stale_params`), 'server' (read from the worker's pulled copy, round-robin
over 2 workers, backups recorded with `record_pull`) or 'fresh'. Every case gets
ALL extra arguments (stale_params, worker_id, staleness and an unknown one),
so ignoring unused extra arguments is part of the contract.
"""

import doctest
import functools
from typing import Any, Callable, NamedTuple

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsgd.transforms as T
from jaxsgd.transforms import averaging
from jaxsgd.transforms import compensation
from jaxsgd.transforms import async_outer
from jaxsgd.transforms import staleness
from jaxsgd.transforms import streaming

M = 2  # Workers (stacked rows, or server workers).
LR = 0.1


class Case(NamedTuple):
  name: str
  fn: Callable[..., Any]  # The transform's public constructor.
  kwargs: dict[str, Any]
  static_args: tuple[str, ...] = ()
  before: Any = None  # Optimizer chained before (delayed averaging family).
  after: Any = None  # Optimizer chained after (scale_by_staleness).
  read: str = 'fresh'  # 'fresh' | 'stale' | 'server'.
  stacked: bool = False  # Params carry a leading [M] worker axis.

  def make(self, inject=False):
    fn = self.fn
    if inject:
      fn = optax.inject_hyperparams(fn, static_args=self.static_args)
    parts = [p for p in (self.before, fn(**self.kwargs), self.after) if p is not None]
    return parts[0] if len(parts) == 1 else optax.chain(*parts)


NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)
# Adaptive cases use λ0 = 0.1: with the paper's λ0 = 2, g̃ ≈ g (1 − λ0 η |g| /
# sqrt(1 − m^t)) changes sign once η|g| is O(0.1), as it is on these toy
# problems (deep nets have far smaller gradients).
CASES = [
  Case('dc_asgd_c', T.dc_asgd, dict(learning_rate=LR, lambda0=0.04), read='stale'),
  Case(
    'dc_asgd_a',
    T.dc_asgd,
    dict(learning_rate=LR, lambda0=0.1, adaptive=True, mean_square_decay=0.95, eps=1e-7),
    read='stale',
  ),
  Case(
    'dc_asgd_server_a_per_worker',
    T.dc_asgd_server,
    dict(learning_rate=LR, num_workers=M, lambda0=0.1, adaptive=True, per_worker_mean_square=True),
    static_args=('num_workers',),
    read='server',
  ),
  Case(
    'delayed_nesterov',
    T.delayed_nesterov,
    dict(learning_rate=LR, momentum=0.9, every=M),
    static_args=('every',),
  ),
  Case(
    'scale_by_staleness',
    T.scale_by_staleness,
    dict(fn=T.inverse_sqrt_staleness),
    static_args=('fn',),
    after=optax.sgd(LR),
    read='stale',
  ),
  Case(
    'delayed_averaging_keep_local',
    T.delayed_averaging,
    dict(period=3, delay=1),
    static_args=('period', 'delay'),
    before=optax.sgd(LR),
    stacked=True,
  ),
  Case(
    'delayed_averaging_mix_no_overlap',
    T.delayed_averaging,
    dict(period=2, delay=1, merge='mix', mix=0.25, overlap=False),
    static_args=('period', 'delay'),
    before=optax.sgd(LR),
    stacked=True,
  ),
  Case(
    'local_sgd',
    T.local_sgd,
    dict(inner=optax.sgd(LR, momentum=0.5), period=3),
    static_args=('period', 'delay'),
    stacked=True,
  ),
  Case(
    'diloco',
    T.diloco,
    dict(inner=optax.sgd(LR), outer=NESTEROV, period=3),
    static_args=('period', 'delay'),
    stacked=True,
  ),
  Case(
    'diloco_streaming_mix',
    T.diloco,
    dict(inner=optax.adam(0.05), outer=NESTEROV, period=3, delay=1, merge='mix', mix=0.5),
    static_args=('period', 'delay'),
    stacked=True,
  ),
  Case(
    'streaming_diloco',
    T.streaming_diloco,
    dict(
      inner=optax.sgd(LR, momentum=0.5), outer=NESTEROV, period=4, fragments=2, delay=1, mix=0.5
    ),
    static_args=('period', 'fragments', 'delay'),
    stacked=True,
  ),
  Case(
    'streaming_diloco_no_overlap',
    T.streaming_diloco,
    dict(inner=optax.sgd(LR), outer=NESTEROV, period=3, fragments=1, overlap=False),
    static_args=('period', 'fragments', 'delay', 'overlap'),
    stacked=True,
  ),
]
IDS = [c.name for c in CASES]


# ------------------------------------------------------------------ problems.
def _quadratic():
  """f(w) = ½ Σ h ⊙ (w − w*)², with a fixed per-worker gradient offset ±0.1.

  The offsets sum to zero over the workers, so averaging cancels them.
  """
  h = {'a': jnp.array([0.5, 1.0, 2.0]), 'b': jnp.array([[1.0, 1.5], [0.7, 1.2]])}
  target = jax.tree.map(lambda x: jnp.linspace(-1.0, 1.0, x.size).reshape(x.shape), h)
  init = jax.tree.map(lambda x: 2.0 * jnp.ones_like(x), h)
  loss = lambda w: sum(
    jax.tree.leaves(
      jax.tree.map(lambda hh, ww, tt: 0.5 * jnp.sum(hh * (ww - tt) ** 2), h, w, target)
    )
  )

  def grad(w, worker):
    offset = 0.1 * (2.0 * worker - 1.0)
    return jax.tree.map(lambda g: g + offset, jax.grad(loss)(w))

  return init, loss, grad


def _logistic():
  """Logistic regression on 64 separable points; worker j sees half j."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  y = (x @ np.array([1.5, -2.0, 1.0, 0.5], np.float32) > 0).astype(np.float32)
  x, y = jnp.asarray(x), jnp.asarray(y)

  def loss(w, xs=x, ys=y):
    logits = xs @ w['w'] + w['b']
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, ys))

  def grad(w, worker):
    rows = lax.dynamic_slice_in_dim(jnp.arange(64), 32 * worker, 32)
    return jax.grad(loss)(w, x[rows], y[rows])

  init = {'w': jnp.zeros(4), 'b': jnp.zeros(())}
  return init, loss, grad


def _stack(tree):
  return jax.tree.map(lambda x: jnp.stack([x] * M), tree)


def _mean(tree, case):
  return jax.tree.map(lambda x: x.mean(0), tree) if case.stacked else tree


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


# --------------------------------------------------------------- the loop.
def _make_step(case, tx, grad_fn):
  """One training step; carry = (params, read copies, opt_state)."""

  def step(carry, t):
    params, reads, opt_state = carry
    worker = t % M
    if case.stacked:  # Worker j's gradient on row j.
      read = params
      grads = jax.vmap(grad_fn)(params, jnp.arange(M))
    else:
      read = jax.tree.map(lambda r: r[worker], reads)
      grads = grad_fn(read, worker)
    grads = _cast(grads, jax.tree.leaves(params)[0].dtype)
    updates, opt_state = tx.update(
      grads,
      opt_state,
      params,
      stale_params=read,
      worker_id=worker,
      staleness=t % 3,
      an_unknown_extra_arg=jnp.ones(()),
    )
    new = optax.apply_updates(params, updates)
    if case.read == 'server':
      opt_state = T.record_pull(opt_state, new, worker)
      reads = jax.tree.map(lambda r, w: r.at[worker].set(w), reads, new)
    else:  # 'stale' reads the params one step late, 'fresh' the new ones.
      latest = params if case.read == 'stale' else new
      reads = jax.tree.map(lambda r, w: jnp.broadcast_to(w, r.shape), reads, latest)
    return (new, reads, opt_state), updates

  return step


def _init_carry(case, tx, init):
  params = _stack(init) if case.stacked else init
  return params, _stack(params), tx.init(params)


def _run(case, problem, steps, inject=False, dtype=jnp.float32):
  init, loss, grad_fn = problem()
  tx = case.make(inject)
  carry = _init_carry(case, tx, _cast(init, dtype))
  step = _make_step(case, tx, grad_fn)

  @jax.jit
  def run(carry):
    return lax.scan(step, carry, jnp.arange(steps))[0]

  params, _, opt_state = run(carry)
  return loss(_cast(init, jnp.float32)), loss(_mean(params, case)), params, opt_state


# ------------------------------------------------------------- the tests.
@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_jitted_step_keeps_shapes_dtypes_finite_state_no_retrace(case):
  """In bfloat16 (float32 is checked by the convergence tests)."""
  dtype = jnp.bfloat16
  chex.clear_trace_counter()  # The counter is keyed by code, shared by cases.
  init, _, grad_fn = _quadratic()
  tx = case.make()
  carry = jax.jit(functools.partial(_init_carry, case, tx))(_cast(init, dtype))
  step = jax.jit(chex.assert_max_traces(_make_step(case, tx, grad_fn), n=1))
  for t in range(4):  # Passes snapshot and merge steps; a retrace raises.
    params = carry[0]
    carry, updates = step(carry, jnp.int32(t))
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(carry[0], params)
  chex.assert_tree_all_finite(carry)


@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_converges_on_quadratic_also_under_inject_hyperparams(case):
  initial, final, plain, _ = _run(case, _quadratic, steps=150)
  assert final < 1e-4 * initial, (initial, final)
  _, _, injected, state = _run(case, _quadratic, steps=150, inject=True)
  chex.assert_trees_all_close(injected, plain, rtol=1e-6, atol=1e-6)
  is_injected = lambda x: isinstance(x, optax.InjectStatefulHyperparamsState)
  [injected_state] = [x for x in jax.tree.leaves(state, is_leaf=is_injected) if is_injected(x)]
  numeric = {
    k for k, v in case.kwargs.items() if k not in case.static_args and isinstance(v, float)
  }
  assert numeric <= set(injected_state.hyperparams)


def test_inject_hyperparams_change_takes_effect():
  """Changing an injected lambda0 changes the step: the value is really used."""
  tx = optax.inject_hyperparams(T.dc_asgd)(learning_rate=1.0, lambda0=0.0)
  w, stale, g = jnp.array([1.0]), jnp.array([0.0]), jnp.array([2.0])
  state = tx.init(w)
  update = jax.jit(lambda s: tx.update(g, s, w, stale_params=stale)[0])
  chex.assert_trees_all_equal(update(state), jnp.array([-2.0]))
  state.hyperparams['lambda0'] = jnp.array(0.25)
  chex.assert_trees_all_equal(update(state), jnp.array([-3.0]))  # 2+.25*4*1


@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_converges_on_logistic_regression(case):
  initial, final, params, state = _run(case, _logistic, steps=300)
  assert final < 0.5 * initial, (initial, final)
  init = _logistic()[0]
  chex.assert_trees_all_equal_shapes_and_dtypes(params, _stack(init) if case.stacked else init)
  chex.assert_tree_all_finite(state)


@pytest.mark.parametrize(
  'module',
  [compensation, averaging, async_outer, staleness, streaming],
  ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, extraglobs=vars(module), optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
