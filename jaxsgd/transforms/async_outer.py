"""Asynchronous local SGD's outer step: Delayed Nesterov (DN) on arriving pseudo-gradients."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxsgd.transforms import _checks


class DelayedNesterovState(NamedTuple):
  """State of `delayed_nesterov`.

  Attributes:
    count: int32 scalar, pseudo-gradients received so far (t).
    accumulated: the sum of the pseudo-gradients since the last momentum step (a pytree
      like the params).
    momentum: m, the outer momentum (a pytree like the params).
  """

  count: jax.Array
  accumulated: Any
  momentum: Any


def delayed_nesterov(
  learning_rate: float | jax.Array, momentum: float | jax.Array = 0.9, every: int = 1
) -> optax.GradientTransformationExtraArgs:
  r"""Delayed Nesterov: plain outer steps per arrival, momentum every `every` arrivals.

  The server's update for the t-th pseudo-gradient Δ_t = θ_pulled − θ_local to arrive
  (ε: `learning_rate`, β: `momentum`, N: `every`; m₀ = 0, A₀ = 0):

  .. math::
    A \leftarrow A + \Delta_t;\qquad
    t \not\equiv 0 \pmod N:\ \theta \leftarrow \theta - \varepsilon\,\Delta_t / N;\qquad
    t \equiv 0 \pmod N:\ m \leftarrow A / N + \beta m,\
    \theta \leftarrow \theta - \varepsilon\,(\Delta_t / N + \beta m),\ A \leftarrow 0.

  Between momentum steps the momentum is neither updated nor applied, so a stale
  pseudo-gradient moves θ once, by ε Δ_t / N, instead of being carried by the momentum
  into every later step. The 1/N on the plain steps is our reading of the paper: then N
  pseudo-gradients that left from one θ move it exactly as one Nesterov step of DiLoCo
  on their mean (``optax.sgd(ε, β, nesterov=True)`` on mean Δ), the synchronous
  method DN is meant to match with N = M workers. ``every = 1`` is that Nesterov step per
  arrival, bit for bit (same operations in optax's order: m ← Δ + βm, u = −ε(Δ + βm)).

  Args:
    learning_rate: ε, the outer learning rate (DiLoCo's 0.7 is a good start).
    momentum: β in [0, 1), the outer momentum decay.
    every: N >= 1 (a Python int), arrivals per momentum step; the paper's default is
      the number of workers.

  Returns:
    A `GradientTransformationExtraArgs` with state `DelayedNesterovState`; its update
    takes the pseudo-gradient as `updates` and returns the server's parameter change.
    Extra arguments (worker id, staleness) are ignored.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = delayed_nesterov(learning_rate=0.5, momentum=0.5, every=2)
    >>> state = tx.init(jnp.zeros(()))
    >>> u, state = tx.update(jnp.asarray(2.0), state)
    >>> float(u)                                  # −ε Δ / N: momentum not yet due
    -0.5

  References:
    B. Liu, R. Chhaparia, A. Douillard, S. Kale, A. A. Rusu, J. Shen, A. Szlam,
    M. Ranzato. `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024 (Sec. 4, Delayed Nesterov update).
  """
  every = _checks.static_int(
    'every', every, 1, " (under inject_hyperparams: static_args=('every',))"
  )
  _checks.check_range('learning_rate', learning_rate, '>= 0', lambda v: v >= 0)
  _checks.check_range('momentum', momentum, 'in [0, 1)', lambda v: 0 <= v < 1)

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    count = state.count + 1
    due = count % every == 0
    accumulated = jax.tree.map(jnp.add, state.accumulated, updates)
    # Written as optax's trace and Nesterov step (g + β·m), so every=1 is bit-equal to it.
    stepped = jax.tree.map(lambda a, m: a / every + momentum * m, accumulated, state.momentum)

    def step(d, m_new):
      plain = d / every
      return jnp.where(due, -learning_rate * (plain + momentum * m_new), -learning_rate * plain)

    new_updates = jax.tree.map(step, updates, stepped)
    new_momentum = jax.tree.map(lambda s, m: jnp.where(due, s, m), stepped, state.momentum)
    accumulated = jax.tree.map(lambda a: jnp.where(due, jnp.zeros_like(a), a), accumulated)
    return new_updates, DelayedNesterovState(count, accumulated, new_momentum)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
