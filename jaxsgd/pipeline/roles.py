"""One stage's jitted computations, for the role it plays in a pipeline policy.

Built on `jaxsgd.models.stage_functions` (layer 3). Every role gets the same calls:

    forward(variables, x, labels)          -> (y, loss, new_state, vjp)
    backward(vjp, dy)                      -> (grads, dx)
    recompute(variables, x, labels, dy)    -> (grads, dx)   # forward again, then backward
    stale_backward(kept, variables, x, labels, dy) -> (grads, dx)  # stale_graph roles
    delta_backward(vjp, dy, grads_own)     -> (grads_own + vjp((dy, 0)), None)
    update(params, opt_state, grads)       -> (params, opt_state)

with `y` None for the model's last stage (its output is the loss), `loss` None
for a stage without a loss, `dy` None for a stage that receives no gradient
from downstream, and `dx` None when the role sends nothing upstream. In a role
whose delayed backward is 'stale_graph', `forward`'s last output is not a vjp but
the activations `stale_backward` reads (`jaxsgd.pipeline.stale_graph`). The
backward's cotangent per loss kind:

    'none':  vjp(dy)                     the stage is inside a backprop chain
    'head':  vjp(1)                      the model's classifier and loss
    'aux':   vjp((dy or 0, 1))           stage output and its auxiliary loss

Each jitted call is traced once per stage (`jitted` lists them for checks).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.models import Stage
from jaxsgd.pipeline import stale_graph as stale_graph_lib

LOSS_KINDS = ('none', 'head', 'aux')
SEND_KINDS = ('none', 'total', 'own')
DELAYED_BACKWARDS = ('stored', 'stale_graph', 'recompute')


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
    delayed_backward: the Jacobian a delayed backward (delay > 0) takes of batch
      t − delay's forward, w_t being the current weights, w_{t−d} the forward's:
        'stored':      J f(w_{t−d}; h_{t−d}): the forward's vjp residuals (DDG's paper);
        'stale_graph': each operation's Jacobian at (its input activations of the
                       forward, w_t): PyTorch's autograd through a kept graph after
                       in-place updates, the public DDG code (`stale_graph`);
        'recompute':   J f(w_t; h_{t−d}): the forward run again from the stored input.
      All three backpropagate the same error signal of batch t − delay.
  """

  loss: str = 'none'
  receives_delta: bool = False
  sends_delta: str = 'none'
  delay: int = 0
  delayed_backward: str = 'stored'

  @property
  def backward_form(self) -> str:
    """`delayed_backward`, or 'stored' when nothing is delayed (they coincide then)."""
    return self.delayed_backward if self.delay > 0 else 'stored'

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
  stale_backward: Callable
  delta_backward: Callable
  update: Callable
  # -> (name, jitted function) pairs, for trace counting; a call, so that a driver whose
  # stages are named tasks run in lane processes does not build them for it
  traced: Callable[[], tuple]

  @property
  def jitted(self) -> tuple:
    """(name, jitted function) pairs, for trace counting."""
    return self.traced()


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
  kept_forward, stale_backward = _stale_graph_fns(stage, role.loss, loss_fn, cotangent, sends)
  if role.backward_form == 'stale_graph':
    forward = jitted_forward = kept_forward

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
    'stale_backward': stale_backward,
    'delta_backward': jax.jit(delta_backward),
    'update': stages_lib.make_update(tx),
  }
  return RoleFunctions(
    forward,
    jitted['backward'],
    jitted['recompute'],
    stale_backward,
    jitted['delta_backward'],
    jitted['update'],
    functools.partial(tuple, jitted.items()),
  )


def _stale_graph_fns(
  stage: Stage, loss: str, loss_fn: Callable, cotangent: Callable, sends: bool
) -> tuple[Callable, Callable]:
  """Jitted `forward` keeping the activations, and `stale_backward` through them at the
  current weights (`jaxsgd.pipeline.stale_graph`)."""

  def outputs(params, state, x, labels):
    if loss == 'aux':
      (y, logits), new_state = stages_lib.apply_train(
        stage, params, state, x, method=Stage.forward_with_aux
      )
      return (y, loss_fn(logits, labels)), new_state
    out, new_state = stages_lib.apply_train(stage, params, state, x)
    return (loss_fn(out, labels) if loss == 'head' else out), new_state

  kept_forward, kept_backward = stale_graph_lib.stale_graph(outputs)

  def forward(variables, x, labels):
    params, state = stages_lib.split_variables(variables)
    (out, new_state), kept = kept_forward(params, state, x, labels)
    y, value = {'none': (out, None), 'head': (None, out), 'aux': out}[loss]
    return y, value, new_state, kept

  def backward(kept, variables, x, labels, dy):
    params, state = stages_lib.split_variables(variables)
    grads, (_, dx, _) = kept_backward(kept, params, state, x, labels, cotangent=cotangent(dy))
    return grads, (dx if sends else None)

  return jax.jit(forward), jax.jit(backward)


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
