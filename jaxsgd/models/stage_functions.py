"""Per-stage jitted computations: forward (with `jax.vjp` residuals), backward, update.

Layer 3 of the design. For stage `k` with variables `{'params': p, **state}`:

    forward(variables, x)          -> (y, new_state, vjp)      # vjp: residuals as a pytree
    loss_forward(variables, x, y*) -> (loss, new_state, vjp)   # the last stage
    backward(vjp, dy)              -> (grads_p, dx)            # dx is None for stage 0
    update(params, opt_state, grads, **extra) -> (params, opt_state)

`vjp` is the `jax.tree_util.Partial` that `jax.vjp` returns: it can leave a jitted
function, carries the residuals computed at the forward's weights, and a jitted
`backward` consumes it without retracing. Backpropagating through it uses the
weights of the forward pass exactly (DDG's paper form, PD-ASGD's backward).
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxsgd.models import Stage


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy with integer labels: per example, or per position of
  `[B, T, V]` logits with `[B, T]` labels (nats per token)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def split_variables(variables):
  """`(params, state)`: the trainable parameters and the other collections."""
  state = {k: v for k, v in variables.items() if k != 'params'}
  return variables['params'], state


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=['params', 'state'], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class UnmergedVariables:
  """`{'params': params, **state}` whose `state` cannot be unpacked where it is built.

  A policy runs in the driver; with lanes in other processes, a stage's model state
  (BatchNorm statistics) is a handle to a dict that stays in a lane, so the driver
  cannot write `{**state}`. It hands the task this pair instead, and the task merges
  it (`merged`) where the state is a dict again: in the lane, before the same jitted
  call on the same dict as in one process.
  """

  params: Any
  state: Any


def with_state(params, state):
  """Flax variables `{'params': params, **state}`; a `state` that is not a mapping here
  (a lane's handle) gives `UnmergedVariables`, which the receiving task merges."""
  if isinstance(state, Mapping):
    return {'params': params, **state}
  return UnmergedVariables(params, state)


def merged(variables):
  """`variables` as a Flax variables dict (`UnmergedVariables` merged)."""
  if isinstance(variables, UnmergedVariables):
    return {'params': variables.params, **variables.state}
  return variables


def merging_variables(fn: Callable) -> Callable:
  """`fn` taking any `UnmergedVariables` argument as its merged dict (see `with_state`)."""

  def call(*args):
    return fn(*(merged(arg) for arg in args))

  return call


@dataclasses.dataclass(frozen=True)
class StageFns:
  """The jitted functions of one stage."""

  stage: Stage
  forward: Callable
  loss_forward: Callable
  backward: Callable


def apply_train(stage: Stage, params, state, x, method=None):
  """Applies `stage` in train mode; returns (output, updated state)."""
  variables = {'params': params, **state}
  if not state:
    return stage.apply(variables, x, train=True, method=method), {}
  return stage.apply(variables, x, train=True, method=method, mutable=list(state))


def make_stage_fns(
  stage: Stage, *, input_grad: bool = True, loss_fn: Callable = cross_entropy
) -> StageFns:
  """Builds and jits `forward`, `loss_forward` and `backward` for `stage`.

  Args:
    stage: the stage module.
    input_grad: whether `backward` returns the gradient w.r.t. the stage input
      (False for the first stage: nobody consumes it, so it is not computed).
    loss_fn: `loss_fn(logits, labels) -> scalar`, used by `loss_forward`.
  """

  def forward(variables, x):
    params, state = split_variables(variables)
    if input_grad:
      y, vjp, new_state = jax.vjp(
        lambda p, h: apply_train(stage, p, state, h), params, x, has_aux=True
      )
    else:
      y, vjp, new_state = jax.vjp(lambda p: apply_train(stage, p, state, x), params, has_aux=True)
    return y, new_state, vjp

  def loss_forward(variables, x, labels):
    params, state = split_variables(variables)

    def loss_of(p, *h):
      logits, new_state = apply_train(stage, p, state, h[0] if h else x)
      return loss_fn(logits, labels), new_state

    primals = (params, x) if input_grad else (params,)
    loss, vjp, new_state = jax.vjp(loss_of, *primals, has_aux=True)
    return loss, new_state, vjp

  def backward(vjp, dy):
    cotangents = vjp(dy)
    return cotangents[0], (cotangents[1] if input_grad else None)

  return StageFns(stage, jax.jit(forward), jax.jit(loss_forward), jax.jit(backward))


def make_update(tx: optax.GradientTransformation) -> Callable:
  """Jitted `update(params, opt_state, grads, **extra) -> (params, opt_state)`."""

  @jax.jit
  def update(params, opt_state, grads, **extra):
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state

  return update


def make_eval_step(model_apply: Callable) -> Callable:
  """Jitted `(variables, batch, mask) -> (loss_sum, correct_sum, count)` in eval mode.

  With per-position labels (`[B, T]`, a language model) every position counts once:
  `count` is tokens, so `loss_sum / count` is nats per token, `exp` of it perplexity.
  """

  @jax.jit
  def eval_step(variables, batch, mask):
    logits = model_apply(variables, batch['image'], train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
    correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
    # The mask is per example; broadcast it over the positions of each.
    mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (losses.ndim - 1)), losses.shape)
    return (losses * mask).sum(), (correct * mask).sum(), mask.sum()

  return eval_step
