"""Delay compensation for asynchronous SGD (DC-ASGD) as Optax transformations.

Two forms of the same rule:

* worker side, `scale_by_delay_compensation` / `dc_asgd`: the caller passes the
  parameters the gradient was computed at (`stale_params`) to `update`;
* server side, `delay_compensation_server` / `dc_asgd_server`: the state keeps
  one backup per worker, recorded by `pull` (Algorithm 2 of the paper), and
  `update` only needs the pushing `worker_id`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxsgd.transforms import _checks

CONSTANT_LAMBDA0 = 0.04  # DC-ASGD-c default (paper, Sec. 5).
ADAPTIVE_LAMBDA0 = 2.0  # DC-ASGD-a default (paper, Sec. 5).


class ScaleByDelayCompensationState(NamedTuple):
  """State of `scale_by_delay_compensation`.

  Attributes:
    mean_square: running mean of g ⊙ g (a pytree like the params, with a leading
      `[num_workers]` axis when kept per worker), in at least float32; None for
      a constant λ.
  """

  mean_square: Any


def _compute_dtype(dtype):
  # Squares of bf16/fp16 gradients lose too much; compute in >= float32.
  return jnp.promote_types(dtype, jnp.float32)


def _init_mean_square(params, num_workers):
  def zeros(p):
    shape = p.shape if num_workers is None else (num_workers, *p.shape)
    return jnp.zeros(shape, _compute_dtype(p.dtype))

  return jax.tree.map(zeros, params)


def _new_mean_square(ms, g, decay, worker_id):
  """MeanSquare ← m·MeanSquare + (1−m)·g⊙g, on row `worker_id` if per worker."""
  g = g.astype(ms.dtype)
  row = ms if worker_id is None else ms[worker_id]
  row = decay * row + (1 - decay) * g * g
  return row if worker_id is None else ms.at[worker_id].set(row)


def _adaptive_lambda(mean_square, grads, lambda0, decay, eps, row):
  """(MeanSquare_t, λ_t = λ0 / sqrt(MeanSquare_t + ε)), MS updated first."""
  mean_square = jax.tree.map(lambda ms, g: _new_mean_square(ms, g, decay, row), mean_square, grads)
  current = mean_square if row is None else jax.tree.map(lambda ms: ms[row], mean_square)
  return mean_square, jax.tree.map(lambda ms: lambda0 / jnp.sqrt(ms + eps), current)


def _compensate(g, w, w_bak, lam):
  """g + λ ⊙ g ⊙ g ⊙ (w − w_bak), computed in >= float32, in g's dtype."""
  dtype = _compute_dtype(g.dtype)
  g32 = g.astype(dtype)
  diff = w.astype(dtype) - w_bak.astype(dtype)
  return (g32 + jnp.asarray(lam, dtype) * g32 * g32 * diff).astype(g.dtype)


def _check_dc_args(lambda0, adaptive, mean_square_decay, eps, per_worker_mean_square, num_workers):
  """Validates the constructor arguments; returns (lambda0, num_workers)."""
  if not isinstance(adaptive, bool):
    raise TypeError(f'adaptive must be a bool; got {adaptive!r}.')
  if lambda0 is None:
    lambda0 = ADAPTIVE_LAMBDA0 if adaptive else CONSTANT_LAMBDA0
  _checks.check_range('lambda0', lambda0, '>= 0 (0 gives plain ASGD)', lambda v: v >= 0)
  _checks.check_range('mean_square_decay', mean_square_decay, 'in [0, 1)', lambda v: 0 <= v < 1)
  _checks.check_range('eps', eps, '>= 0', lambda v: v >= 0)
  if num_workers is not None:
    num_workers = _checks.static_int('num_workers', num_workers, 1)
  if per_worker_mean_square and not adaptive:
    raise ValueError(
      'per_worker_mean_square=True needs adaptive=True (a constant lambda keeps no MeanSquare).'
    )
  if per_worker_mean_square and num_workers is None:
    raise ValueError(
      'per_worker_mean_square=True needs num_workers (an int '
      '>= 1) to size one MeanSquare per worker.'
    )
  return lambda0, num_workers


def scale_by_delay_compensation(
  lambda0: float | jax.Array | None = None,
  adaptive: bool = False,
  mean_square_decay: float | jax.Array = 0.95,
  eps: float | jax.Array = 1e-7,
  per_worker_mean_square: bool = False,
  num_workers: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Compensates a stale gradient with a diagonal second-order Taylor term.

  A gradient ``g`` computed at the stale parameters ``w_bak`` is corrected
  towards the gradient at the current parameters ``w``, approximating the
  Hessian by its cheap diagonal estimate ``λ ⊙ g ⊙ g``:

  .. math::
    \tilde g = g + \lambda_t \odot g \odot g \odot (w - w_{bak})

  with either a constant :math:`\lambda_t = \lambda_0` (DC-ASGD-c, default
  :math:`\lambda_0 = 0.04`) or an adaptive one (DC-ASGD-a, default
  :math:`\lambda_0 = 2`), where the mean square is updated before it is used:

  .. math::
    MS_t = m \, MS_{t-1} + (1 - m) \, g \odot g, \qquad
    \lambda_t = \lambda_0 / \sqrt{MS_t + \epsilon}.

  ``lambda0 = 0`` returns ``g`` unchanged (bit for bit): plain ASGD. The
  arithmetic runs in at least float32 and the result keeps ``g``'s dtype.

  Args:
    lambda0: :math:`\lambda_0 \ge 0`; None picks the paper's default (0.04
      constant, 2.0 adaptive).
    adaptive: False for DC-ASGD-c, True for DC-ASGD-a.
    mean_square_decay: :math:`m \in [0, 1)` (adaptive only).
    eps: :math:`\epsilon \ge 0`, inside the square root (adaptive only).
    per_worker_mean_square: keep one MeanSquare per worker (as one public
      implementation does) instead of the paper's single one; then `update`
      needs ``worker_id`` and the constructor ``num_workers``.
    num_workers: number of workers M (with ``per_worker_mean_square``).

  Returns:
    A `GradientTransformationExtraArgs` whose ``update(grads, state, params, *,
    stale_params, worker_id=None)`` returns the compensated gradient; other
    extra arguments are ignored.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(scale_by_delay_compensation(lambda0=0.5), optax.sgd(1.))
    >>> w = jnp.array([1.0]); state = tx.init(w)
    >>> u, state = tx.update(jnp.array([2.0]), state, w,
    ...                      stale_params=jnp.array([0.5]))
    >>> u  # -(2 + 0.5 * 2 * 2 * (1 - 0.5))
    Array([-3.], dtype=float32)

  References:
    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, ICML 2017 (Eq. 10 and
    Algorithm 1 for the worker-side rule, Sec. 4 for the adaptive λ).
  """
  lambda0, num_workers = _check_dc_args(
    lambda0, adaptive, mean_square_decay, eps, per_worker_mean_square, num_workers
  )
  name = 'scale_by_delay_compensation'

  def init_fn(params):
    if not adaptive:
      return ScaleByDelayCompensationState(mean_square=None)
    rows = num_workers if per_worker_mean_square else None
    return ScaleByDelayCompensationState(_init_mean_square(params, rows))

  def update_fn(updates, state, params=None, *, stale_params=None, worker_id=None, **extra_args):
    del extra_args
    _checks.require('params', params, name, 'the current parameters w')
    _checks.require(
      'stale_params', stale_params, name, 'the parameters w_bak the gradient was computed at'
    )
    _checks.same_structure('stale_params', stale_params, params, 'params')
    if per_worker_mean_square:
      _checks.require(
        'worker_id', worker_id, name, 'the pushing worker, for per_worker_mean_square'
      )
      _checks.worker_id_in_range(worker_id, num_workers)
    if adaptive:
      row = worker_id if per_worker_mean_square else None
      mean_square, lam = _adaptive_lambda(
        state.mean_square, updates, lambda0, mean_square_decay, eps, row
      )
    else:
      mean_square, lam = None, jax.tree.map(lambda _: lambda0, updates)
    updates = jax.tree.map(_compensate, updates, params, stale_params, lam)
    return updates, ScaleByDelayCompensationState(mean_square)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


delay_compensation = scale_by_delay_compensation  # The short name of the same transform.


def dc_asgd(
  learning_rate: optax.ScalarOrSchedule,
  lambda0: float | jax.Array | None = None,
  adaptive: bool = False,
  mean_square_decay: float | jax.Array = 0.95,
  eps: float | jax.Array = 1e-7,
  per_worker_mean_square: bool = False,
  num_workers: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DC-ASGD, worker-side form: delay-compensated SGD.

  .. math::
    w \leftarrow w - \eta \, (g + \lambda_t \odot g \odot g \odot
    (w - w_{bak}))

  See `scale_by_delay_compensation` for λ_t. With ``lambda0 = 0`` it equals
  ``optax.sgd(learning_rate)`` bit for bit.

  Args:
    learning_rate: η, a float or an Optax schedule.
    lambda0: see `scale_by_delay_compensation` (None: 0.04 / 2.0).
    adaptive: False for DC-ASGD-c, True for DC-ASGD-a.
    mean_square_decay: m in [0, 1).
    eps: ε >= 0, inside the square root.
    per_worker_mean_square: one MeanSquare per worker (needs num_workers).
    num_workers: number of workers M.

  Returns:
    ``optax.chain(scale_by_delay_compensation(...),
    optax.scale_by_learning_rate(learning_rate))``; its update needs
    ``stale_params=`` (and ``worker_id=`` when kept per worker).

  Example:
    >>> import jax.numpy as jnp
    >>> tx = dc_asgd(0.1, adaptive=True)
    >>> w = jnp.ones(3); state = tx.init(w)
    >>> u, state = tx.update(jnp.ones(3), state, w, stale_params=w)

  References:
    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, ICML 2017.
  """
  return optax.chain(
    scale_by_delay_compensation(
      lambda0, adaptive, mean_square_decay, eps, per_worker_mean_square, num_workers
    ),
    optax.scale_by_learning_rate(learning_rate),
  )


class DelayCompensationServerState(NamedTuple):
  """State of `delay_compensation_server`.

  Attributes:
    backups: w_bak(m) for every worker m: a pytree like the params with a
      leading ``[num_workers]`` axis, set by `record_pull`.
    compensation: the `ScaleByDelayCompensationState` (MeanSquare).
  """

  backups: Any
  compensation: ScaleByDelayCompensationState


def record_pull(opt_state: Any, params: Any, worker_id: Any) -> Any:
  """Records that worker ``worker_id`` pulled ``params``: w_bak(m) ← w.

  Works on the bare server state or on any optimizer state that contains one
  (chains, `optax.inject_hyperparams`, ...): every
  `DelayCompensationServerState` inside ``opt_state`` is updated. Jittable;
  ``worker_id`` may be traced.

  Args:
    opt_state: an optimizer state holding a `DelayCompensationServerState`.
    params: the parameters the worker receives.
    worker_id: int in [0, num_workers).

  Returns:
    ``opt_state`` with ``backups[worker_id]`` replaced by ``params``.
  """
  is_server = lambda x: isinstance(x, DelayCompensationServerState)
  found = []

  def record(node):
    if not is_server(node):
      return node
    found.append(node)
    _checks.same_structure('params', params, node.backups, 'the server backups')
    _checks.worker_id_in_range(worker_id, _num_rows(node.backups))
    backups = jax.tree.map(
      lambda b, p: b.at[worker_id].set(p.astype(b.dtype)), node.backups, params
    )
    return node._replace(backups=backups)

  new_state = jax.tree.map(record, opt_state, is_leaf=is_server)
  if not found:
    raise ValueError(
      'record_pull: opt_state holds no '
      'DelayCompensationServerState (build the optimizer with '
      'delay_compensation_server or dc_asgd_server).'
    )
  return new_state


def _num_rows(backups):
  return jax.tree.leaves(backups)[0].shape[0]


class DelayCompensationServer(optax.GradientTransformationExtraArgs):
  """A `GradientTransformationExtraArgs` with a ``pull`` (= `record_pull`)."""

  __slots__ = ()

  @staticmethod
  def pull(opt_state: Any, params: Any, worker_id: Any) -> Any:
    return record_pull(opt_state, params, worker_id)


def delay_compensation_server(
  num_workers: int,
  lambda0: float | jax.Array | None = None,
  adaptive: bool = False,
  mean_square_decay: float | jax.Array = 0.95,
  eps: float | jax.Array = 1e-7,
  per_worker_mean_square: bool = False,
) -> DelayCompensationServer:
  r"""Delay compensation on a parameter server that keeps the worker backups.

  The server state holds exactly Algorithm 2's extra memory: one backup
  ``w_bak(m)`` per worker, set when worker m pulls. Protocol::

    state = tx.init(w)                       # every backup = w
    state = tx.pull(state, w, m)             # worker m receives w
    ... worker m computes g at w_bak(m), pushes g ...
    u, state = tx.update(g, state, w, worker_id=m)
    w = optax.apply_updates(w, u)

  .. math::
    \tilde g = g + \lambda_t \odot g \odot g \odot (w - w_{bak}(m))

  Args:
    num_workers: M >= 1, a Python int (static under inject_hyperparams).
    lambda0: see `scale_by_delay_compensation` (None: 0.04 / 2.0).
    adaptive: False for DC-ASGD-c, True for DC-ASGD-a.
    mean_square_decay: m in [0, 1).
    eps: ε >= 0, inside the square root.
    per_worker_mean_square: one MeanSquare per worker instead of one.

  Returns:
    A `DelayCompensationServer`: ``init``, ``update(grads, state, params, *,
    worker_id)`` (worker_id may be traced) and ``pull(state, params,
    worker_id)``.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = delay_compensation_server(num_workers=2, lambda0=0.5)
    >>> w = jnp.array([1.0]); state = tx.init(w)
    >>> g, state = tx.update(jnp.array([2.0]), state, w + 1., worker_id=0)
    >>> g  # 2 + 0.5 * 2 * 2 * ((w + 1) - w)
    Array([4.], dtype=float32)

  References:
    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, ICML 2017,
    Algorithm 2.
  """
  num_workers = _checks.static_int('num_workers', num_workers, 1)
  inner = scale_by_delay_compensation(
    lambda0, adaptive, mean_square_decay, eps, per_worker_mean_square, num_workers
  )

  def init_fn(params):
    backups = jax.tree.map(lambda p: jnp.broadcast_to(p, (num_workers, *jnp.shape(p))), params)
    return DelayCompensationServerState(backups, inner.init(params))

  def update_fn(updates, state, params=None, *, worker_id=None, **extra_args):
    del extra_args  # The server's own backups replace any stale_params.
    _checks.require(
      'worker_id', worker_id, 'delay_compensation_server', 'the worker that pushed the gradient'
    )
    _checks.worker_id_in_range(worker_id, num_workers)
    _checks.require(
      'params', params, 'delay_compensation_server', 'the current server parameters w'
    )
    stale = jax.tree.map(lambda b: b[worker_id], state.backups)
    updates, compensation = inner.update(
      updates, state.compensation, params, stale_params=stale, worker_id=worker_id
    )
    return updates, state._replace(compensation=compensation)

  return DelayCompensationServer(init_fn, update_fn)


def dc_asgd_server(
  learning_rate: optax.ScalarOrSchedule,
  num_workers: int,
  lambda0: float | jax.Array | None = None,
  adaptive: bool = False,
  mean_square_decay: float | jax.Array = 0.95,
  eps: float | jax.Array = 1e-7,
  per_worker_mean_square: bool = False,
) -> DelayCompensationServer:
  r"""DC-ASGD, parameter-server form (Algorithm 2): backups kept in the state.

  .. math::
    w \leftarrow w - \eta \, (g_m + \lambda_t \odot g_m \odot g_m \odot
    (w - w_{bak}(m)))

  Args:
    learning_rate: η, a float or an Optax schedule.
    num_workers: M >= 1.
    lambda0: see `scale_by_delay_compensation` (None: 0.04 / 2.0).
    adaptive: False for DC-ASGD-c, True for DC-ASGD-a.
    mean_square_decay: m in [0, 1).
    eps: ε >= 0, inside the square root.
    per_worker_mean_square: one MeanSquare per worker instead of one.

  Returns:
    A `DelayCompensationServer` (chain of `delay_compensation_server` and
    ``optax.scale_by_learning_rate``) with ``pull``.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = dc_asgd_server(0.1, num_workers=4, adaptive=True)
    >>> w = jnp.zeros(3); state = tx.init(w)
    >>> state = tx.pull(state, w, 2)
    >>> u, state = tx.update(jnp.ones(3), state, w, worker_id=2)

  References:
    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, ICML 2017.
  """
  return DelayCompensationServer(
    *optax.chain(
      delay_compensation_server(
        num_workers, lambda0, adaptive, mean_square_decay, eps, per_worker_mean_square
      ),
      optax.scale_by_learning_rate(learning_rate),
    )
  )
