"""One worker's training step, and the two ways to map it onto M workers.

The step is written once, for one worker, with its collectives over the axis
named `data`:

    (loss, state'), g = value_and_grad(L)(w, state, ξ_m)     # this worker's batch
    SSGD:   g, loss, state' = pmean over data of (g, loss, state')
    u, opt_state = tx.update(g, opt_state, w)                 # tx may pmean too
    w' = w + u

It is then mapped onto the workers either

* over a device mesh with `jax.shard_map` (one device per worker, one jitted
  SPMD program, the same across processes), or
* stacked on one device with `jax.vmap(..., axis_name='data')` (any M on one
  device: the collectives become means over the vmapped axis).

Both run the same code, so they compute the same numbers (up to the order of
floating-point sums in the collectives).

The delayed-averaging methods can also run a whole period of τ steps as one
program (`make_worker_period`) that issues the period's one all-reduce itself.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.spmd.mesh import AXIS
from jaxsgd import transforms
from jaxsgd.transforms import averaging

# XLA:CPU pays ~10-40 ms per iteration of a while loop around a training step
# (measured here: 8 steps of the CNN as a loop, 65 ms on 1 device and 340 ms on 2;
# unrolled, 5 and 11 ms, as fast as 8 separate step programs). So the steps of a
# period are unrolled, up to this many per loop iteration (long DiLoCo periods
# keep a loop, with the overhead spread over this many steps).
MAX_UNROLLED_STEPS = 32


def make_worker_step(
  model,
  tx: optax.GradientTransformation,
  *,
  average_grads: bool,
  vary: Callable = lambda tree: tree,
) -> Callable:
  """`(variables, opt_state, batch) -> (variables, opt_state, loss)` of one worker.

  Args:
    model: a `StagedModel`; its unsplit module is trained.
    tx: the optimizer. For local methods it contains the delayed-averaging
      transform (with `axis_name='data'`), which does its own `pmean`.
    average_grads: SSGD: all-reduce-mean the gradients, the loss and the model
      state (BatchNorm statistics) over `data` before the update, so every worker
      applies the same update to the same replicated parameters.
    vary: marks the replicated parameters as varying over `data` before
      differentiating, so that each worker's gradient is its own and the mean is an
      explicit `pmean` (`lax.pcast(..., to='varying')` under `shard_map`; identity
      under `vmap`).
  """
  module = model.full()

  def loss_fn(params, state, batch):
    logits, new_state = stages_lib.apply_train(module, params, state, batch['image'])
    return stages_lib.cross_entropy(logits, batch['label']), new_state

  def step(variables, opt_state, batch, **update_args):
    params, state = stages_lib.split_variables(variables)
    diff_params = vary(params) if average_grads else params
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff_params, state, batch)
    if average_grads:
      grads, loss, new_state = lax.pmean((grads, loss, new_state), AXIS)
    updates, opt_state = tx.update(grads, opt_state, params, **update_args)
    return {'params': optax.apply_updates(params, updates), **new_state}, opt_state, loss

  return step


def make_worker_period(worker_step: Callable, *, period: int, delay: int) -> Callable:
  r"""`(variables, opt_state, batches[τ]) -> (variables, opt_state, losses[τ])`.

  One worker's τ = `period` local steps of a delayed-averaging method
  (`jaxsgd.transforms.delayed_averaging` / `diloco_outer_step`, with
  `axis_name='data'`) as one program with ONE all-reduce. It must start on a
  period boundary (after a multiple of τ steps), where the optimizer state holds
  the snapshot s of the previous period's last step. With m = d (delay ≥ 1) or
  m = τ (delay 0) the merge step of the period:

      w̄ = pmean(s)                      # issued first: reads only the state
      steps 1 .. m−1:  scan, no merge    # update(..., may_merge=False)
      step m:          merge w̄           # update(..., average=w̄)
      steps m+1 .. τ:  scan, no merge    # the last one stores the next snapshot

  For delay ≥ 1 nothing in steps 1..m−1, nor step m's forward and backward,
  depends on the all-reduce, so XLA may run it during those d steps of compute
  (asynchronous collectives on GPU). With delay 0 it is step τ's average of its
  own weights. The arithmetic is that of τ calls of `worker_step`: the same w̄
  from the same snapshot, the same updates (`tests/spmd/test_spmd_period.py`).
  """
  merge_at = delay if delay else period

  def no_merge(carry, batch):
    variables, opt_state, loss = worker_step(*carry, batch, may_merge=False)
    return (variables, opt_state), loss

  def run(variables, opt_state, batches):
    average = averaging.snapshot_average(opt_state, AXIS) if delay else None
    head, merge_batch, tail = _split_steps(batches, merge_at)
    carry, head_losses = _scan(no_merge, (variables, opt_state), head)
    variables, opt_state, loss = worker_step(*carry, merge_batch, average=average)
    carry, tail_losses = _scan(no_merge, (variables, opt_state), tail)
    return (*carry, jnp.concatenate([head_losses, loss[None], tail_losses]))

  return run


def make_worker_cycle(
  worker_step: Callable, *, period: int, fragments: int, delay: int, pattern: str = 'strided'
) -> Callable:
  r"""`(variables, opt_state, batches[H]) -> (variables, opt_state, losses[H])`.

  One worker's H = `period` inner steps of streaming DiLoCo
  (`jaxsgd.transforms.streaming_diloco_outer_step`, `axis_name='data'`) as one
  program with exactly one all-reduce per fragment: P all-reduces of 1/P of the
  weights. It must start on a cycle boundary (after a multiple of H steps). In
  the cycle, fragment p ≥ 1 syncs at step p·H/P and fragment 0 at step H; each
  merges τ = `delay` steps after its sync:

      w̄_0 = pmean(s_0)                     # fragment 0 synced at the previous
                                            #   cycle's end: issued first
      step τ:            merge w̄_0          # update(..., average={0: w̄_0})
      step p·H/P:        s_p = w_p          #   then w̄_p = pmean(s_p) is issued
      step p·H/P + τ:    merge w̄_p
      other steps:       no merge           # update(..., may_merge=False)

  so every all-reduce reads only a snapshot, and nothing of the τ − 1 steps after
  it, nor the forward and backward of its merge step, depends on it (with τ = 0
  each fragment averages its sync step's own weights). The arithmetic is that of
  H calls of `worker_step`.
  """
  stride = period // fragments
  sync_at = {p: p * stride if p else period for p in range(fragments)}
  merges, issues = {}, {}  # cycle step -> fragments merging / issued after that step
  for p, at in sync_at.items():
    merge_at = at + delay if p else (delay or period)
    merges.setdefault(merge_at, []).append(p)
    if delay:
      issues.setdefault(at if p else 0, []).append(p)
  special = sorted(set(merges) | (set(issues) - {0}))

  def no_merge(carry, batch):
    variables, opt_state, loss = worker_step(*carry, batch, may_merge=False)
    return (variables, opt_state), loss

  def average(opt_state, p):
    return transforms.fragment_snapshot_average(
      opt_state, p, AXIS, fragments=fragments, pattern=pattern
    )

  def run(variables, opt_state, batches):
    carry, losses, done = (variables, opt_state), [], 0
    pending = {p: average(opt_state, p) for p in issues.get(0, ())}
    for k in special:  # Plain steps as (unrolled) scans; merges and issues in between.
      carry, plain_losses = _scan(no_merge, carry, _steps(batches, done, k - 1))
      merging = tuple(merges.get(k, ()))
      given = {p: pending.pop(p) for p in merging if p in pending}
      variables, opt_state, loss = worker_step(
        *carry,
        jax.tree.map(lambda x, k=k: x[k - 1], batches),
        may_merge=merging or False,
        average=given or None,
      )
      pending.update({p: average(opt_state, p) for p in issues.get(k, ())})
      carry, done = (variables, opt_state), k
      losses += [plain_losses, loss[None]]
    carry, plain_losses = _scan(no_merge, carry, _steps(batches, done, period))
    return (*carry, jnp.concatenate(losses + [plain_losses]))

  return run


def _steps(batches, start: int, stop: int):
  """The batches of (0-based) steps start .. stop − 1."""
  return jax.tree.map(lambda x: x[start:stop], batches)


def _scan(step, carry, batches):
  """`lax.scan` of `step` over the leading axis, unrolled (see `MAX_UNROLLED_STEPS`)."""
  length = jax.tree.leaves(batches)[0].shape[0]
  return lax.scan(step, carry, batches, unroll=max(1, min(length, MAX_UNROLLED_STEPS)))


def _split_steps(batches, merge_at: int):
  """(the steps before the merge, the merge step's batch, the steps after it)."""
  k = merge_at - 1
  return (
    jax.tree.map(lambda x: x[:k], batches),
    jax.tree.map(lambda x: x[k], batches),
    jax.tree.map(lambda x: x[k + 1 :], batches),
  )


def _squeeze(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _expand(tree):
  return jax.tree.map(lambda x: x[None], tree)


def mesh_step(worker_step: Callable, mesh, *, replicated: bool) -> Callable:
  """`worker_step` over the mesh's `data` axis with `jax.shard_map`, jitted.

  Args:
    worker_step: from `make_worker_step`.
    mesh: a mesh with axis `data`; worker m runs on its device m.
    replicated: variables and optimizer state are replicated `P()` (SSGD);
      otherwise they are stacked `[M, ...]` and sharded `P('data')`, each worker
      seeing its own row.

  Returns:
    Jitted `(variables, opt_state, batch[M*B]) -> (variables, opt_state, loss)`;
    `loss` is a replicated scalar (SSGD) or `[M]`, one per worker. The variables
    and optimizer state passed in are donated.
  """
  if replicated:
    mapped = jax.shard_map(
      worker_step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P(), P())
    )
  else:

    def per_worker(variables, opt_state, batch):
      variables, opt_state, loss = worker_step(_squeeze(variables), _squeeze(opt_state), batch)
      return _expand(variables), _expand(opt_state), loss[None]

    spec = P(AXIS)
    mapped = jax.shard_map(
      per_worker, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec)
    )
  return jax.jit(mapped, donate_argnums=(0, 1))


def mesh_period(worker_period: Callable, mesh) -> Callable:
  """`worker_period` (per-worker state) over the mesh with `jax.shard_map`, jitted.

  Returns:
    Jitted `(variables[M], opt_state[M], batches[τ, M*B]) -> (variables, opt_state,
    losses[M, τ])`; step k's batches are `batches[k]`, split by worker. The
    variables and optimizer state passed in are donated.
  """

  def per_worker(variables, opt_state, batches):
    variables, opt_state, losses = worker_period(_squeeze(variables), _squeeze(opt_state), batches)
    return _expand(variables), _expand(opt_state), losses[None]

  spec = P(AXIS)
  mapped = jax.shard_map(
    per_worker, mesh=mesh, in_specs=(spec, spec, P(None, AXIS)), out_specs=(spec, spec, spec)
  )
  return jax.jit(mapped, donate_argnums=(0, 1))


def stacked_period(worker_period: Callable, workers: int) -> Callable:
  """`worker_period` for M workers stacked on one device (`jax.vmap`), jitted.

  Same signature and outputs as `mesh_period`.
  """

  def stacked(variables, opt_state, batches):
    batches = jax.tree.map(lambda x: x.reshape((x.shape[0], workers, -1) + x.shape[2:]), batches)
    return jax.vmap(worker_period, in_axes=(0, 0, 1), out_axes=(0, 0, 0), axis_name=AXIS)(
      variables, opt_state, batches
    )

  return jax.jit(stacked, donate_argnums=(0, 1))


def stacked_step(worker_step: Callable, workers: int, *, replicated: bool) -> Callable:
  """`worker_step` for M workers stacked on one device (`jax.vmap`), jitted.

  Same signature and outputs as `mesh_step`; the batch `[M*B, ...]` is split into
  the workers' `[B, ...]` batches in order.
  """
  axes = None if replicated else 0

  def stacked(variables, opt_state, batch):
    batch = jax.tree.map(lambda x: x.reshape((workers, -1) + x.shape[1:]), batch)
    return jax.vmap(
      worker_step, in_axes=(axes, axes, 0), out_axes=(axes, axes, axes), axis_name=AXIS
    )(variables, opt_state, batch)

  return jax.jit(stacked, donate_argnums=(0, 1))


def consensus_fn(*, replicated: bool) -> Callable:
  """`variables -> the model to evaluate`: the copy (SSGD) or the workers' mean."""
  if replicated:
    return lambda variables: variables
  return lambda variables: jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), variables)
