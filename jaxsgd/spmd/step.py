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
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.spmd.mesh import AXIS


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

  def step(variables, opt_state, batch):
    params, state = stages_lib.split_variables(variables)
    diff_params = vary(params) if average_grads else params
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff_params, state, batch)
    if average_grads:
      grads, loss, new_state = lax.pmean((grads, loss, new_state), AXIS)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {'params': optax.apply_updates(params, updates), **new_state}, opt_state, loss

  return step


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
