"""One stage's jitted computations, for the role it plays in a pipeline policy.

Built on `jaxsgd.models.stage_functions` (layer 3). Every role gets the same calls:

    forward(variables, x, labels)          -> (y, loss, new_state, vjp)
    backward(vjp, dy)                      -> (grads, dx)
    recompute(variables, x, labels, dy)    -> (grads, dx)   # forward again, then backward
    delta_backward(vjp, dy, grads_own)     -> (grads_own + vjp((dy, 0)), None)
    update(params, opt_state, grads)       -> (params, opt_state)

with `y` None for the model's last stage (its output is the loss), `loss` None
for a stage without a loss, `dy` None for a stage that receives no gradient
from downstream, and `dx` None when the role sends nothing upstream. The
backward's cotangent per loss kind:

    'none':  vjp(dy)                     the stage is inside a backprop chain
    'head':  vjp(1)                      the model's classifier and loss
    'aux':   vjp((dy or 0, 1))           stage output and its auxiliary loss

Each jitted call is traced once per stage (`jitted` lists them for checks).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.models import Stage

LOSS_KINDS = ('none', 'head', 'aux')
SEND_KINDS = ('none', 'total', 'own')


@dataclasses.dataclass(frozen=True)
class StageRole:
  """What one stage does each iteration: the whole policy of a pipeline algorithm.

  Attributes:
    loss: 'none', 'head' (the model's loss; the last stage) or 'aux' (a local loss
      through the stage's auxiliary head).
    receives_delta: its backward waits for dL/dy from the next stage.
    sends_delta: what it sends to the previous stage: 'none', 'total' (dL/dx of
      everything it backpropagated) or 'own' (of its own loss only).
    delay: its backward at iteration t is for batch t − delay (pipeline fill: the
      first `delay` iterations have none). With `split_backward`, only the part
      from downstream is delayed.
    recompute: the backward recomputes the forward from the stored input with the
      current weights, instead of using the forward's stored vjp.
  """

  loss: str = 'none'
  receives_delta: bool = False
  sends_delta: str = 'none'
  delay: int = 0
  recompute: bool = False

  @property
  def split_backward(self) -> bool:
    """A local loss *and* a downstream gradient (overlapping): the own-loss backward
    runs at once on the current batch, so its input gradient goes upstream without
    waiting; the downstream part runs when its δ arrives (`delta_backward`)."""
    return self.loss == 'aux' and self.receives_delta


@dataclasses.dataclass(frozen=True)
class RoleFunctions:
  forward: Callable
  backward: Callable
  recompute: Callable
  delta_backward: Callable
  update: Callable
  jitted: tuple  # (name, jitted function) pairs, for trace counting


def role_functions(
  stage: Stage,
  role: StageRole,
  tx: optax.GradientTransformation,
  *,
  output: jax.ShapeDtypeStruct,
  loss_fn: Callable = stages_lib.cross_entropy,
) -> RoleFunctions:
  """The jitted calls of `stage` in `role`; `output` is the stage output's shape."""
  input_grad = stage.index > 0
  if role.loss == 'aux':
    forward = jitted_forward = jax.jit(_aux_forward(stage, input_grad, loss_fn))
  else:
    fns = stages_lib.make_stage_fns(stage, input_grad=input_grad, loss_fn=loss_fn)
    forward, jitted_forward = _adapt(fns, role.loss)
  cotangent = _cotangent(role.loss, output)
  sends = input_grad and role.sends_delta != 'none'

  def backward(vjp, dy):
    grads, *dx = vjp(cotangent(dy))
    return grads, (dx[0] if sends else None)

  def recompute(variables, x, labels, dy):
    return backward(forward(variables, x, labels)[3], dy)

  def delta_backward(vjp, dy, grads_own):
    """The downstream part only (loss cotangent 0), added to the own-loss gradient."""
    grads = vjp((dy, jnp.zeros((), jnp.float32)))[0]
    return jax.tree.map(jnp.add, grads_own, grads), None

  jitted = {
    'forward': jitted_forward,
    'backward': jax.jit(backward),
    'recompute': jax.jit(recompute),
    'delta_backward': jax.jit(delta_backward),
    'update': stages_lib.make_update(tx),
  }
  return RoleFunctions(
    forward,
    jitted['backward'],
    jitted['recompute'],
    jitted['delta_backward'],
    jitted['update'],
    tuple(jitted.items()),
  )


def _adapt(fns: stages_lib.StageFns, loss: str):
  """`jaxsgd.models.stage_functions` forward/loss_forward with the uniform signature."""
  if loss == 'head':

    def forward(variables, x, labels):
      value, new_state, vjp = fns.loss_forward(variables, x, labels)
      return None, value, new_state, vjp

    return forward, fns.loss_forward

  def forward(variables, x, labels):  # pylint: disable=function-redefined
    del labels
    y, new_state, vjp = fns.forward(variables, x)
    return y, None, new_state, vjp

  return forward, fns.forward


def _aux_forward(stage: Stage, input_grad: bool, loss_fn: Callable):
  """Forward through the stage and its auxiliary head; vjp of (output, local loss)."""

  def forward(variables, x, labels):
    params, state = stages_lib.split_variables(variables)

    def outputs(p, *h):
      (y, logits), new_state = stages_lib.apply_train(
        stage, p, state, h[0] if h else x, method=Stage.forward_with_aux
      )
      return (y, loss_fn(logits, labels)), new_state

    primals = (params, x) if input_grad else (params,)
    (y, loss), vjp, new_state = jax.vjp(outputs, *primals, has_aux=True)
    return y, loss, new_state, vjp

  return forward


def _cotangent(loss: str, output: jax.ShapeDtypeStruct) -> Callable:
  """`dy -> the cotangent the stage's vjp takes` (built inside the jitted backward)."""
  if loss == 'none':
    return lambda dy: dy
  if loss == 'head':
    return lambda dy: jnp.ones((), jnp.float32)
  return lambda dy: (
    jnp.zeros(output.shape, output.dtype) if dy is None else dy,
    jnp.ones((), jnp.float32),
  )
