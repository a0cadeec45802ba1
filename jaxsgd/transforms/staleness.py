"""Staleness-aware learning rates: scale an update by a function of its delay."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxsgd.transforms import _checks

StalenessFn = Callable[[jax.Array], jax.Array]


def inverse_staleness(tau: jax.Array) -> jax.Array:
  """1 / τ (Zhang et al. 2016's staleness-dependent learning rate)."""
  return 1.0 / tau


def inverse_sqrt_staleness(tau: jax.Array) -> jax.Array:
  """1 / sqrt(τ): a milder damping of stale gradients."""
  return jax.lax.rsqrt(tau)


def power_staleness(power: float) -> StalenessFn:
  """Returns τ ↦ τ^(−power); power 1 and 0.5 are the two helpers above."""
  _checks.check_range('power', power, '>= 0', lambda v: v >= 0)
  return lambda tau: tau ** (-power)


def scale_by_staleness(fn: StalenessFn) -> optax.GradientTransformationExtraArgs:
  r"""Scales updates by a function of their staleness τ.

  .. math::
    u \leftarrow f(\max(\tau, 1)) \, u

  τ is the number of parameter updates between the read the gradient was
  computed at and this update. τ = 0 (a fresh gradient, as in sequential SGD)
  is treated as τ = 1, so ``f`` never sees 0 and fresh and once-stale
  gradients get the same ``f(1)`` (= 1 for the helpers below); negative values
  are clamped the same way. ``f`` is evaluated in float32 and the result is
  cast to each update's dtype.

  Args:
    fn: a jnp-traceable map from τ >= 1 (float32 array) to a scale factor,
      e.g. `inverse_staleness`, `inverse_sqrt_staleness`, `power_staleness(p)`.

  Returns:
    A `GradientTransformationExtraArgs` whose ``update(updates, state, params,
    *, staleness)`` takes τ (an int or a scalar array, may be traced); other
    extra arguments are ignored.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(scale_by_staleness(inverse_staleness), optax.sgd(1.))
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.ones(2), state, staleness=4)
    >>> u
    Array([-0.25, -0.25], dtype=float32)

  References:
    Zhang, Gupta, Lian and Liu, `Staleness-aware Async-SGD for Distributed
    Deep Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016.
  """
  if not callable(fn):
    raise TypeError(f'fn must be a callable tau -> scale; got {fn!r}.')

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    _checks.require(
      'staleness', staleness, 'scale_by_staleness', "tau, updates since the gradient's read"
    )
    tau = jnp.maximum(jnp.asarray(staleness, jnp.float32), 1.0)
    scale = fn(tau)
    updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
