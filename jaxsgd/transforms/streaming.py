"""Streaming DiLoCo's outer steps as an Optax transformation.

Same family as `jaxsgd.transforms.averaging` (chained after an inner optimizer;
workers along a mesh axis or stacked on axis 0; only parameters are averaged),
but the model is split into P fragments whose outer steps are staggered, each
overlapped with a few inner steps and mixed into the local weights.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxsgd.transforms import _checks
from jaxsgd.transforms import averaging

PATTERNS = ('strided', 'sequential')
_STATIC_HINT = " (under inject_hyperparams pass static_args=('period', 'fragments', 'delay'))"


class StreamingDiLoCoState(NamedTuple):
  """State of `streaming_diloco_outer_step`.

  Attributes:
    count: int32 scalar, inner updates applied so far (k).
    snapshot: s, the weights each fragment sent at its last sync step (a pytree
      like the params; fragment p's leaves are written at p's sync steps); None
      when ``delay = 0``.
    anchor: the outer (global) parameters, each fragment's as of its last outer
      step.
    outer_states: one outer-optimizer state per fragment (over the list of that
      fragment's leaves).
  """

  count: jax.Array
  snapshot: Any
  anchor: Any
  outer_states: tuple


def fragment_leaves(params, fragments: int, pattern: str = 'strided') -> list[list[int]]:
  """The leaf indices (``jax.tree.leaves`` order) of each of the P fragments.

  The unit of a fragment is a module: the leaves that share a parent path (a
  layer's kernel and bias); top-level leaves are a unit each. Units are taken in
  tree order and dealt out 'strided' (unit i to fragment i mod P, the paper's
  choice: every fragment spans the depth of the network) or 'sequential' (P
  contiguous runs of near-equal length).

  Raises:
    ValueError: naming `fragments` when the params have fewer than P units.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  units: dict[tuple, list[int]] = {}
  for index, path in enumerate(paths):
    units.setdefault(tuple(path[:-1]) if len(path) > 1 else tuple(path), []).append(index)
  units = list(units.values())
  if len(units) < fragments:
    raise ValueError(
      f'fragments: {fragments} fragments need at least {fragments} modules '
      f'(leaves sharing a parent) in the params; they have {len(units)}.'
    )
  if pattern == 'strided':
    groups = [units[p::fragments] for p in range(fragments)]
  else:
    bounds = [round(p * len(units) / fragments) for p in range(fragments + 1)]
    groups = [units[bounds[p] : bounds[p + 1]] for p in range(fragments)]
  return [sorted(i for unit in group for i in unit) for group in groups]


def _merging_fragments(may_merge, fragments) -> frozenset[int]:
  if may_merge is True or may_merge is False:
    return frozenset(range(fragments)) if may_merge else frozenset()
  try:
    merging = frozenset(int(p) for p in may_merge)
  except TypeError:
    merging = None
  if merging is None or not merging <= set(range(fragments)):
    raise TypeError(
      f'may_merge must be a Python bool or fragment indices in [0, {fragments}); got {may_merge!r}.'
    )
  return merging


def fragment_snapshot_average(
  opt_state, fragment: int, axis_name, *, fragments: int, pattern: str = 'strided'
) -> list:
  """w̄_p: the workers' mean of fragment p's stored snapshot (one all-reduce).

  For a caller that issues fragment p's all-reduce itself and passes it to the
  merge step as ``update(..., average={p: w̄_p})``.

  Args:
    opt_state: a state containing one `StreamingDiLoCoState` (delay >= 1).
    fragment: p.
    axis_name: the transform's axis name.
    fragments, pattern: the transform's (they fix the fragments' leaves).

  Returns:
    The average of fragment p's snapshot leaves, in `fragment_leaves` order.
  """
  is_ours = lambda x: isinstance(x, StreamingDiLoCoState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_ours) if is_ours(x)]
  if len(found) != 1 or found[0].snapshot is None:
    raise ValueError('opt_state: expected one streaming DiLoCo state with a snapshot (delay >= 1).')
  snapshot = found[0].snapshot
  leaves = jax.tree.leaves(snapshot)
  group = fragment_leaves(snapshot, fragments, pattern)[fragment]
  # pylint: disable-next=protected-access
  return averaging._average([leaves[i] for i in group], axis_name)


def _fragment_schedule(count, period, fragments, delay):
  """(t, [is_sync_p], [is_merge_p]) for the call after `count` inner updates.

  Fragment p syncs at the steps t >= 1 with t − p·H/P ≡ 0 (mod H), t − p·H/P >= 0,
  and merges `delay` steps after each of its syncs.
  """
  t = count + 1
  stride = period // fragments

  def syncs(step, p):
    since = step - p * stride
    return (step >= 1) & (since >= 0) & (since % period == 0)

  return (
    t,
    [syncs(t, p) for p in range(fragments)],
    [syncs(t - delay, p) for p in range(fragments)],
  )


def streaming_diloco_outer_step(
  outer: optax.GradientTransformation,
  period: int,
  fragments: int = 1,
  delay: int = 0,
  mix: float | jax.Array = 0.0,
  axis_name: str | tuple[str, ...] | None = None,
  pattern: str = 'strided',
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Streaming DiLoCo's staggered, overlapped outer steps on P fragments.

  Chain it after an inner optimizer. The params are split into P fragments
  (`fragment_leaves`). With t = ``state.count`` + 1, H = `period`, τ = `delay`
  and α = `mix`, fragment p (parameters w_p, global copy θ_p) does::

    w = params + updates                             # the inner step, kept local
    if t − p·H/P ≡ 0 (mod H), t − p·H/P >= 0:        # p's sync step
        s_p = w_p                                    #   sent for averaging
    if t − τ is a sync step of p:                    # τ inner steps later
        Δ_p = θ_p − mean over workers of s_p         #   outer gradient
        θ_p ← θ_p + outer_p(Δ_p)                      #   outer step (own state)
        w_p ← α·w_p + (1 − α)·θ_p                     #   mixing
    return w − params                                # as updates

  so every H/P inner steps one fragment is all-reduced (1/P of the model), its
  all-reduce can run during τ inner steps, and α = 0 takes the global value
  (the local progress of those τ steps on that fragment is dropped). One
  fragment, τ = 0 and α = 0 is DiLoCo (`diloco_outer_step` with ``delay = 0``):
  it computes the same numbers with the same operations (tested bit for bit).

  Args:
    outer: the outer optimizer, e.g. ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``; each fragment has its own state, stepped only at that
      fragment's outer steps.
    period: H >= 1, inner steps between two outer steps of a fragment (a Python
      int, a multiple of `fragments`).
    fragments: P >= 1, the number of fragments.
    delay: τ, 0 <= τ < H/P, inner steps an all-reduce overlaps before its merge
      (at most one fragment is in flight).
    mix: α in [0, 1], the weight of the local fragment in the merge.
    axis_name: a mesh axis name (average with ``lax.pmean``), or None for
      stacked ``[M, ...]`` params.
    pattern: 'strided' or 'sequential' (see `fragment_leaves`).
    overlap: as in `delayed_averaging`: True computes every fragment's average
      every step (top-level collectives); False only on its merge step, inside
      ``lax.cond``. Results are identical.

  ``update`` takes two keyword extra arguments, as `delayed_averaging`'s, for
  a caller that runs a whole cycle of H steps as one program and issues each
  fragment's all-reduce itself (`jaxsgd.spmd.step.make_worker_cycle`):

  * ``average``: ``{p: w̄_p}``, fragment p's average of its stored snapshot
    (`fragment_snapshot_average`, delay >= 1), computed by the caller.
  * ``may_merge``: True (default: every fragment's schedule decides), False
    (none merges) or the fragment indices that may merge at this step; the
    others compile no collective and no merge (the caller must be right).

  Returns:
    A `GradientTransformationExtraArgs` (other extra arguments are ignored)
    with state `StreamingDiLoCoState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.adamw(1e-3), streaming_diloco_outer_step(
    ...     optax.sgd(0.7, momentum=0.9, nesterov=True), period=8, fragments=2,
    ...     delay=1, mix=0.5))
    >>> state = tx.init({'a': {'w': jnp.zeros((4, 3))}, 'b': {'w': jnp.zeros((4, 2))}})

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication: Towards
    a Distributed Free Lunch <https://arxiv.org/abs/2501.18512>`_, 2025
    (fragments, overlap τ, mixing α; as in torchft's ``DiLoCo`` with
    ``fragment_sync_delay`` and ``fragment_update_alpha``).
  """
  if not isinstance(outer, optax.GradientTransformation):
    raise TypeError(f'outer must be an optax GradientTransformation; got {outer!r}.')
  period = _checks.static_int('period', period, 1, _STATIC_HINT)
  fragments = _checks.static_int('fragments', fragments, 1, _STATIC_HINT)
  delay = _checks.static_int('delay', delay, 0, _STATIC_HINT)
  if period % fragments:
    raise ValueError(
      f'period must be a multiple of fragments (fragment p syncs at '
      f'offset p·period/fragments); got period={period}, '
      f'fragments={fragments}.'
    )
  if delay >= period // fragments:
    raise ValueError(
      f'delay must be < period / fragments (one fragment in flight at a '
      f'time); got delay={delay}, period={period}, fragments={fragments}.'
    )
  _checks.check_range('mix', mix, 'in [0, 1]', lambda v: 0 <= v <= 1)
  if pattern not in PATTERNS:
    raise ValueError(f'pattern must be one of {PATTERNS}; got {pattern!r}.')
  if axis_name is not None and not isinstance(axis_name, (str, tuple)):
    raise TypeError(
      'axis_name must be None (stacked workers on axis 0) or a mesh axis '
      f'name (str or tuple of str); got {axis_name!r}.'
    )
  if not isinstance(overlap, bool):
    raise TypeError(f'overlap must be a bool; got {overlap!r}.')

  def init_fn(params):
    if axis_name is None:
      averaging._check_stacked(params)  # pylint: disable=protected-access
    leaves = jax.tree.leaves(params)
    outer_states = tuple(
      outer.init([leaves[i] for i in group])
      for group in fragment_leaves(params, fragments, pattern)
    )
    snapshot = None if delay == 0 else jax.tree.map(jnp.copy, params)
    return StreamingDiLoCoState(
      jnp.zeros([], jnp.int32), snapshot, jax.tree.map(jnp.copy, params), outer_states
    )

  def update_fn(updates, state, params=None, *, average=None, may_merge=True, **extra_args):
    del extra_args
    _checks.require(
      'params', params, 'streaming_diloco_outer_step', 'the parameters before this step'
    )
    merging = _merging_fragments(may_merge, fragments)
    average = {} if average is None else dict(average)
    if average and delay == 0:
      raise ValueError(
        "average: with delay = 0 a fragment averages its merge step's own "
        'weights, which the caller cannot have; pass it only with delay >= 1.'
      )
    t, is_sync, is_merge = _fragment_schedule(state.count, period, fragments, delay)
    u, treedef = jax.tree.flatten(updates)
    w = treedef.flatten_up_to(params)
    anchor = treedef.flatten_up_to(state.anchor)
    snapshot = None if delay == 0 else treedef.flatten_up_to(state.snapshot)
    outer_states = []
    for p, group in enumerate(fragment_leaves(params, fragments, pattern)):
      if p in merging:
        merged, anchor_p, outer_state = _fragment_update(
          [u[i] for i in group],
          [w[i] for i in group],
          None if delay == 0 else [snapshot[i] for i in group],
          [anchor[i] for i in group],
          state.outer_states[p],
          is_merge[p],
          average.get(p),
        )
      else:  # The caller knows p does not merge now: no collective, no outer step.
        merged, anchor_p = [u[i] for i in group], [anchor[i] for i in group]
        outer_state = state.outer_states[p]
      outer_states.append(outer_state)
      for k, i in enumerate(group):
        u[i], anchor[i] = merged[k], anchor_p[k]
        if delay:  # s_p ← params + updates at p's sync step (no merge there: τ >= 1).
          snapshot[i] = jnp.where(is_sync[p], w[i] + u[i], snapshot[i])
    unflatten = lambda leaves: jax.tree.unflatten(treedef, leaves)
    return unflatten(u), StreamingDiLoCoState(
      t, None if delay == 0 else unflatten(snapshot), unflatten(anchor), tuple(outer_states)
    )

  def _fragment_update(u, w, snapshot, anchor, outer_state, is_merge, average):
    """One fragment's merge, as `diloco_outer_step` does it (the same helpers)."""
    # pylint: disable=protected-access
    post = optax.apply_updates(w, u)
    sent = post if delay == 0 else snapshot
    if average is None:
      average = averaging._maybe_average(sent, axis_name, is_merge, overlap)
    anchor, outer_state = averaging._outer_step(outer, anchor, outer_state, average, is_merge)
    merged = averaging._merged_updates(u, post, sent, anchor, is_merge, 'mix', mix)
    return merged, anchor, outer_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def streaming_diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  period: int,
  fragments: int = 1,
  delay: int = 0,
  mix: float | jax.Array = 0.0,
  axis_name: str | tuple[str, ...] | None = None,
  pattern: str = 'strided',
  overlap: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Streaming DiLoCo: `inner` steps locally, staggered `outer` steps per fragment.

  .. math::
    t - pH/P \equiv 0 \ (\mathrm{mod}\ H):\ s_p = w_p; \qquad
    t - \tau\ \text{likewise}:\ \theta_p \leftarrow \theta_p +
    \mathrm{outer}_p(\theta_p - \bar s_p),\ w_p \leftarrow \alpha w_p +
    (1 - \alpha)\theta_p

  See `streaming_diloco_outer_step` for the arguments.

  Returns:
    ``optax.chain(inner, streaming_diloco_outer_step(outer, ...))``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = streaming_diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9,
    ...                       nesterov=True), period=4, fragments=2, delay=1)
    >>> state = tx.init({'a': {'w': jnp.zeros((2, 3))}, 'b': {'w': jnp.zeros((2, 1))}})

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025.
  """
  return optax.chain(
    inner,
    streaming_diloco_outer_step(outer, period, fragments, delay, mix, axis_name, pattern, overlap),
  )
