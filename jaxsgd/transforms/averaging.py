"""Delayed averaging (DaSGD), local SGD and DiLoCo outer steps as Optax transformations.

All of them are chained AFTER an inner optimizer: they receive the inner
updates and the params, and return updates such that ``params + updates`` is
the new (possibly merged) parameters. Workers are either

* devices along a named mesh axis (``axis_name='data'``; call ``update``
  inside ``shard_map``/``pmap``; the average is ``lax.pmean``), or
* rows of stacked parameters (``axis_name=None``; every leaf has a leading
  worker axis ``[M, ...]``; the average is the mean over axis 0, broadcast
  back). The inner optimizer then acts on all workers at once, which is exact
  for element-wise optimizers (SGD, momentum, Adam) but mixes workers for
  global ones (e.g. ``clip_by_global_norm``).

Only parameters are averaged: the inner optimizer's state (momenta) and any
model state outside the params (BatchNorm statistics) stay local, as in DaSGD.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxsgd.transforms import _checks

MERGES = ('keep_local', 'mix')
_STATIC_HINT = " (under inject_hyperparams pass static_args=('period', 'delay'))"


class DelayedAveragingState(NamedTuple):
  """State of `delayed_averaging`.

  Attributes:
    count: int32 scalar, inner updates applied so far (k).
    snapshot: s, the weights sent at the last snapshot step (a pytree like the
      params); None when ``delay = 0`` (the average is merged at once).
  """

  count: jax.Array
  snapshot: Any


class DiLoCoOuterState(NamedTuple):
  """State of `diloco_outer_step`.

  Attributes:
    count: int32 scalar, inner updates applied so far (k).
    snapshot: s, as in `DelayedAveragingState` (None when ``delay = 0``).
    anchor: the outer (global) parameters of the last outer step.
    outer_state: the outer optimizer's state.
  """

  count: jax.Array
  snapshot: Any
  anchor: Any
  outer_state: Any


def _check_args(period, delay, axis_name, merge, mix, overlap):
  """Validates the shared constructor arguments; returns (period, delay)."""
  period = _checks.static_int('period', period, 1, _STATIC_HINT)
  delay = _checks.static_int('delay', delay, 0, _STATIC_HINT)
  if delay >= period:
    raise ValueError(
      f'delay must be < period (0 <= delay < period); got delay={delay}, period={period}.'
    )
  if merge not in MERGES:
    raise ValueError(f'merge must be one of {MERGES}; got {merge!r}.')
  _checks.check_range('mix', mix, 'in [0, 1]', lambda v: 0 <= v <= 1)
  if axis_name is not None and not isinstance(axis_name, (str, tuple)):
    raise TypeError(
      'axis_name must be None (stacked workers on axis 0) or a '
      f'mesh axis name (str or tuple of str); got {axis_name!r}.'
    )
  if not isinstance(overlap, bool):
    raise TypeError(f'overlap must be a bool; got {overlap!r}.')
  return period, delay


def _check_stacked(params):
  """With axis_name=None every leaf must share a leading worker axis."""
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(params)}
  if None in sizes or len(sizes) > 1:
    raise ValueError(
      'With axis_name=None params must be stacked: every leaf needs the same '
      f'leading worker axis [M, ...]; got leading sizes {sizes}. Pass '
      'axis_name=<mesh axis> to average across devices instead.'
    )


_MAX_UNROLLED_WORKERS = 8


def _stacked_mean(x):
  """Mean over the leading worker axis, kept as [1, ...]."""
  num_workers = x.shape[0]
  # XLA:CPU runs a reduce over a leading axis ~20x slower than a pass over
  # memory; a sum of row slices fuses into its consumer, and for many workers
  # a (1/M)-vector matvec (at full float32 precision) runs at bandwidth.
  if num_workers <= _MAX_UNROLLED_WORKERS:
    total = sum(x[i].astype(jnp.float32) for i in range(num_workers))
    return (total / num_workers).astype(x.dtype)[None]
  weights = jnp.full((num_workers,), 1.0 / num_workers, jnp.float32)
  mean = jnp.tensordot(weights, x.astype(jnp.float32), axes=1, precision=lax.Precision.HIGHEST)
  return mean.astype(x.dtype)[None]


def _average(tree, axis_name):
  """w̄: pmean over the mesh axis, or the mean over stacked workers (axis 0)."""
  if axis_name is not None:
    return lax.pmean(tree, axis_name)
  return jax.tree.map(_stacked_mean, tree)


def _maybe_average(tree, axis_name, when, overlap):
  """The average, computed every step (overlap) or only when it is used."""
  if overlap:
    return _average(tree, axis_name)

  def skip(tree):
    # Constants, so the branch types match pmean's device-invariant output.
    shape = lambda x: x.shape if axis_name is not None else (1, *x.shape[1:])
    return jax.tree.map(lambda x: jnp.zeros(shape(x), x.dtype), tree)

  return lax.cond(when, lambda t: _average(t, axis_name), skip, tree)


def _outer_step(outer, anchor, outer_state, average, when):
  """On merge steps: anchor ← anchor + outer(anchor − w̄); else unchanged."""

  def step(args):
    anchor, outer_state, average = args
    pseudo_grad = jax.tree.map(lambda a, m: a - m, anchor, average)
    updates, outer_state = outer.update(pseudo_grad, outer_state, anchor)
    return optax.apply_updates(anchor, updates), outer_state

  skip = lambda args: args[:2]
  return lax.cond(when, step, skip, (anchor, outer_state, average))


def _merged_updates(updates, post, sent, target, when, merge, mix):
  """Updates u' with params + u' = merged weights on merge steps, else u."""

  def one(u, w, s, m):
    if merge == 'keep_local':
      correction = m - s  # w ← w̄ + (w − s)  ⇔  u' = u + (w̄ − s).
    else:
      correction = (1 - mix) * (m - w)  # w ← p·w + (1 − p)·w̄.
    return jnp.where(when, u + correction.astype(u.dtype), u)

  return jax.tree.map(one, updates, post, sent, target)


def _schedule(count, period, delay):
  """(t, is_snapshot, is_merge) for the call after `count` inner updates."""
  t = count + 1
  return t, t % period == 0, (t >= period) & (t % period == delay)


def _next_snapshot(params, updates, snapshot, is_snapshot):
  """s ← params + updates on snapshot steps (delay >= 1), else s."""
  # No merge happens on a snapshot step (delay >= 1), so params + returned
  # updates is the post-update w. Reading the NEW params (not `post`, built
  # from the old ones) lets XLA update params and snapshot in place; otherwise
  # each output needs the other's old buffer and XLA inserts copies.
  new_params = optax.apply_updates(params, updates)
  return jax.tree.map(lambda w, s: jnp.where(is_snapshot, w, s), new_params, snapshot)


def _check_caller_average(average, may_merge, delay):
  """The extra arguments of a caller that runs the collective itself."""
  if not isinstance(may_merge, bool):
    raise TypeError(
      f'may_merge must be a Python bool (it decides what is compiled); got {may_merge!r}.'
    )
  if average is not None and delay == 0:
    raise ValueError(
      "average: with delay = 0 the average is of this step's "
      'own weights, which the caller cannot have; pass '
      'average only with delay >= 1.'
    )


def _find_states(opt_state):
  """The `DelayedAveragingState`s / `DiLoCoOuterState`s inside `opt_state`."""
  is_ours = lambda x: isinstance(x, (DelayedAveragingState, DiLoCoOuterState))
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_ours) if is_ours(x)]


def snapshot_average(opt_state, axis_name):
  """w̄ = the workers' mean of the stored snapshot s (one all-reduce).

  What a merge step of `delayed_averaging` / `diloco_outer_step` with
  ``delay >= 1`` averages. A caller that runs a whole period as one program
  (`jaxsgd.spmd.step.period_step`) issues it once, at the start of the
  period, and passes it to the merge step as ``update(..., average=w̄)``.

  Args:
    opt_state: a state containing exactly one such transform's state (e.g. the
      state of ``optax.chain(inner, delayed_averaging(...))``).
    axis_name: the transform's axis name (None: stacked workers on axis 0).
  """
  found = _find_states(opt_state)
  if len(found) != 1:
    raise ValueError(f'opt_state: expected one delayed-averaging state, found {len(found)}.')
  if found[0].snapshot is None:
    raise ValueError(
      'opt_state: no snapshot is stored when delay = 0; the '
      "average is of the merge step's own weights."
    )
  return _average(found[0].snapshot, axis_name)


def _periodic_merge(name, period, delay, axis_name, merge, mix, overlap, outer):
  """The machinery shared by delayed_averaging and diloco_outer_step."""
  period, delay = _check_args(period, delay, axis_name, merge, mix, overlap)

  def init_fn(params):
    if axis_name is None:
      _check_stacked(params)
    count = jnp.zeros([], jnp.int32)
    snapshot = None if delay == 0 else jax.tree.map(jnp.copy, params)
    if outer is None:
      return DelayedAveragingState(count, snapshot)
    anchor = jax.tree.map(jnp.copy, params)
    return DiLoCoOuterState(count, snapshot, anchor, outer.init(params))

  def update_fn(updates, state, params=None, *, average=None, may_merge=True, **extra_args):
    del extra_args
    _checks.require('params', params, name, 'the parameters before this step')
    _check_caller_average(average, may_merge, delay)
    cls = DelayedAveragingState if outer is None else DiLoCoOuterState
    t, is_snapshot, is_merge = _schedule(state.count, period, delay)
    if not may_merge:  # The caller knows: no merge, no collective this step.
      snapshot = (
        None if delay == 0 else _next_snapshot(params, updates, state.snapshot, is_snapshot)
      )
      return updates, cls(
        t, snapshot, *(() if outer is None else (state.anchor, state.outer_state))
      )
    post = optax.apply_updates(params, updates)
    # delay >= 1: average the snapshot from the STATE, so the collective does
    # not depend on this step's gradients and XLA may overlap it with them.
    sent = post if delay == 0 else state.snapshot
    if average is None:
      average = _maybe_average(sent, axis_name, is_merge, overlap)
    if outer is None:
      target, extra = average, ()
    else:
      target, outer_state = _outer_step(outer, state.anchor, state.outer_state, average, is_merge)
      extra = (target, outer_state)
    updates = _merged_updates(updates, post, sent, target, is_merge, merge, mix)
    snapshot = None if delay == 0 else _next_snapshot(params, updates, state.snapshot, is_snapshot)
    return updates, cls(t, snapshot, *extra)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def delayed_averaging(
  period: int,
  delay: int = 0,
  axis_name: str | tuple[str, ...] | None = None,
  merge: str = 'keep_local',
  mix: float | jax.Array = 0.25,
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""DaSGD: average the workers' weights every `period` steps, `delay` late.

  Chain it after an inner optimizer. With k = ``state.count`` (inner updates
  applied before this call, from 0) and t = k + 1, one call does::

    w  = params + updates                      # the inner step, kept local
    if t % period == 0:                        # snapshot step
        s = w                                  #   sent for averaging
    if t >= period and t % period == delay:    # merge step
        w̄ = mean over workers of s             #   (delay = 0: of w itself)
        w = w̄ + (w − s)        if merge == 'keep_local'   (paper)
        w = p·w + (1 − p)·w̄    if merge == 'mix'          (public code, p = mix)
    return w − params                          # as updates

  that is, in the paper's notation with local step counter k:

  .. math::
    k = n\tau:\ s_j = w_j; \qquad
    k = n\tau + d:\ w_j \leftarrow \bar s + (w_j - s_j).

  ``delay = 0`` merges at the snapshot step (then w − s = 0): synchronous
  periodic averaging, i.e. local SGD; with ``period = 1`` also it is SSGD
  with the same element-wise-linear inner optimizer (SGD, momentum). On
  non-merge steps the inner updates are returned unchanged.

  For ``delay >= 1`` the average is computed from ``state.snapshot`` (taken at
  an earlier step), so its all-reduce does not depend on the current step's
  gradients: inside one jitted step XLA is free to overlap it with the
  forward/backward pass.

  Args:
    period: τ >= 1, local steps between snapshots (a Python int).
    delay: d, 0 <= d < period, steps between a snapshot and its merge.
    axis_name: a mesh axis name: average with ``lax.pmean`` over it (call
      ``update`` inside ``shard_map``/``pmap``). None: params are stacked
      ``[M, ...]`` and the average is the mean over axis 0.
    merge: 'keep_local' (paper: w ← w̄ + (w − s)) or 'mix' (public code:
      w ← p·w + (1 − p)·w̄).
    mix: p in [0, 1], the weight of the local model for ``merge='mix'``
      (default 8/32).
    overlap: True: the average is computed unconditionally every step and
      used on merge steps only: the collective is a top-level op that can be
      overlapped with compute, at the price of one all-reduce per step. False:
      it runs inside ``lax.cond`` on merge steps only (one all-reduce per
      period, not overlappable). Results are identical.

  ``update`` also takes two keyword extra arguments, for a caller that runs
  a whole period as one program and issues the period's one all-reduce itself
  (`jaxsgd.spmd.step.period_step`); other extra arguments are ignored:

  * ``average``: w̄, the workers' mean of ``state.snapshot``
    (`snapshot_average`, delay >= 1 only), computed by the caller: the step
    issues no collective and merges it if this is a merge step.
  * ``may_merge=False`` (a Python bool): the caller knows this step is not a
    merge step: no collective and no merge are compiled. The caller must be
    right (the period program runs whole, aligned periods); the results are
    those of the default ``True``.

  Returns:
    A `GradientTransformationExtraArgs` with state `DelayedAveragingState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.sgd(0.1), delayed_averaging(period=4, delay=1))
    >>> w = jnp.zeros((2, 3))                    # 2 stacked workers
    >>> state = tx.init(w)
    >>> u, state = tx.update(jnp.ones((2, 3)), state, w)
    >>> w = optax.apply_updates(w, u)

  References:
    Zhou et al., `DaSGD: Squeezing SGD Parallelization Performance in
    Distributed Training Using Delayed Averaging
    <https://arxiv.org/abs/2006.00441>`_, 2020 (Algorithm 1).
  """
  return _periodic_merge('delayed_averaging', period, delay, axis_name, merge, mix, overlap, None)


def diloco_outer_step(
  outer: optax.GradientTransformation,
  period: int,
  delay: int = 0,
  axis_name: str | tuple[str, ...] | None = None,
  merge: str = 'keep_local',
  mix: float | jax.Array = 0.25,
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo's outer step on the averaged pseudo-gradient, optionally delayed.

  Same schedule as `delayed_averaging`, but on merge steps the average w̄
  first drives an outer optimizer on the anchor (the last global params):

  .. math::
    \Delta = w_{anchor} - \bar s, \qquad
    w_{anchor} \leftarrow w_{anchor} + \mathrm{outer}(\Delta), \qquad
    w \leftarrow w_{anchor} + (w - s)

  (or ``w ← p·w + (1 − p)·w_anchor`` with ``merge='mix'``, the streaming
  variant's mixing). ``delay = 0`` is DiLoCo (w ← w_anchor); ``delay >= 1``
  overlaps the all-reduce with ``delay`` inner steps. With
  ``outer = optax.sgd(1.0)`` it equals `delayed_averaging` (up to rounding).

  Args:
    outer: the outer optimizer, e.g. ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``. The anchor and the outer state are initialised from
      each worker's own params and kept per worker, so workers must start
      from identical params (as in DiLoCo); they then stay identical.
    period: H >= 1, inner steps per outer step (a Python int).
    delay: 0 <= delay < period.
    axis_name: mesh axis name, or None for stacked ``[M, ...]`` params.
    merge: 'keep_local' or 'mix'.
    mix: p in [0, 1] for ``merge='mix'``.
    overlap: see `delayed_averaging`.

  ``update`` takes the extra arguments ``average`` and ``may_merge`` of
  `delayed_averaging`.

  Returns:
    A `GradientTransformationExtraArgs` with state `DiLoCoOuterState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.adamw(1e-3),
    ...                  diloco_outer_step(optax.sgd(0.7, momentum=0.9,
    ...                                              nesterov=True), period=8))
    >>> state = tx.init(jnp.zeros((4, 10)))      # 4 stacked workers

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1).
  """
  if not isinstance(outer, optax.GradientTransformation):
    raise TypeError(f'outer must be an optax GradientTransformation; got {outer!r}.')
  return _periodic_merge('diloco_outer_step', period, delay, axis_name, merge, mix, overlap, outer)


def local_sgd(
  inner: optax.GradientTransformation,
  period: int,
  delay: int = 0,
  axis_name: str | tuple[str, ...] | None = None,
  merge: str = 'keep_local',
  mix: float | jax.Array = 0.25,
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Local SGD: `inner` steps on each worker, weights averaged every `period`.

  .. math::
    w_j \leftarrow w_j + \mathrm{inner}(g_j); \qquad
    t \equiv 0 \pmod{H}:\ w_j \leftarrow \tfrac{1}{M} \textstyle\sum_i w_i

  ``delay >= 1`` gives the delayed (DaSGD) variant; see `delayed_averaging`.

  Args:
    inner: the local optimizer, e.g. ``optax.sgd(0.1, momentum=0.9)``.
    period: H >= 1, local steps between averages.
    delay: 0 <= delay < period.
    axis_name: mesh axis name, or None for stacked ``[M, ...]`` params.
    merge: 'keep_local' or 'mix'.
    mix: p in [0, 1] for ``merge='mix'``.
    overlap: see `delayed_averaging`.

  Returns:
    ``optax.chain(inner, delayed_averaging(period, delay, ...))``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = local_sgd(optax.sgd(0.1), period=4)
    >>> state = tx.init(jnp.zeros((2, 3)))       # 2 stacked workers

  References:
    Lin et al., `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020.
  """
  return optax.chain(inner, delayed_averaging(period, delay, axis_name, merge, mix, overlap))


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  period: int,
  delay: int = 0,
  axis_name: str | tuple[str, ...] | None = None,
  merge: str = 'keep_local',
  mix: float | jax.Array = 0.25,
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo: `inner` steps locally, `outer` on the averaged pseudo-gradient.

  .. math::
    \Delta = w_{anchor} - \tfrac{1}{M}\textstyle\sum_j w_j \ \text{every } H
    \text{ steps}; \quad w_{anchor} \leftarrow w_{anchor} +
    \mathrm{outer}(\Delta); \quad w_j \leftarrow w_{anchor}

  ``delay >= 1`` is the streaming/overlapped variant; see `diloco_outer_step`.

  Args:
    inner: the local optimizer (DiLoCo uses AdamW).
    outer: the outer optimizer (DiLoCo: ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``; ``optax.sgd(1.0)`` gives local SGD).
    period: H >= 1, inner steps per outer step.
    delay: 0 <= delay < period.
    axis_name: mesh axis name, or None for stacked ``[M, ...]`` params.
    merge: 'keep_local' or 'mix'.
    mix: p in [0, 1] for ``merge='mix'``.
    overlap: see `delayed_averaging`.

  Returns:
    ``optax.chain(inner, diloco_outer_step(outer, period, delay, ...))``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9,
    ...             nesterov=True), period=16)
    >>> state = tx.init(jnp.zeros((2, 3)))       # 2 stacked workers

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023.
  """
  return optax.chain(inner, diloco_outer_step(outer, period, delay, axis_name, merge, mix, overlap))
