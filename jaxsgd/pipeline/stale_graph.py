r"""Backpropagating through a kept forward after the weights changed in place.

What PyTorch's autograd computes when a module keeps a forward's graph, the optimizer
then updates the parameters in place (`p.data.add_(…)`, as `torch.optim.SGD` did in
the public DDG code, github.com/slowbull/DDG), and only later `output.backward(δ)` runs:
every operation's backward reads the tensors it saved at forward time. The activations
it saved are the forward's; a parameter it saved (the weight of a matmul or a
convolution, BatchNorm's scale) is the parameter tensor itself, whose storage now holds
the current weights (an update through `.data` does not bump the version counter, so
autograd does not refuse it). Each operation's vector-Jacobian product is therefore
evaluated at (its inputs from the forward, the current weights):

    y = x W:        grad_W = x_fwdᵀ δ          grad_x = δ W_nowᵀ
    y = relu(u):    grad_u = δ ⊙ [u_fwd > 0]
    y = u · γ (BN): grad_γ = Σ δ ⊙ u_fwd       grad_u = δ γ_now

`stale_graph(fn)` gives that backward for a JAX function `fn(params, *args) ->
(outputs, aux)`. Its jaxpr (inner `jit`s inlined) is split into *weight* values,
computed from `params` alone (the parameters and their reshapes and casts, which
PyTorch sees as views of the updated parameter), and *activations*, everything that
depends on an argument:

    forward(params, *args)                        -> ((outputs, aux), kept)
    backward(kept, params_now, *args, cotangent)  -> (grads of params, cts of args)

(`kept`: every activation an operation reads; `args` give only shapes to `backward`.)

`backward` recomputes the weight values from `params_now` and walks the operations in
reverse, each one's vjp taken at (kept activations, current weight values). With
`params_now` equal to the forward's parameters it is the ordinary backward.

A weight-only computation (reshape, cast, broadcast) counts as a view of the parameter,
current, as PyTorch's `.t()` and `expand` are. Inner `jit`s are inlined; any other
operation that holds a jaxpr (`custom_jvp` activations, `checkpoint`) is one operation,
and one that takes both weights and activations is refused (its inside would be re-run).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore


@dataclasses.dataclass(frozen=True)
class _Graph:
  """`fn`'s jaxpr and which of its variables are weights (functions of params alone)."""

  closed: jcore.ClosedJaxpr
  num_params: int
  weights: frozenset
  kept: tuple  # the activations some operation reads, in a fixed order
  out_tree: object


def stale_graph(fn: Callable) -> tuple[Callable, Callable]:
  """`(forward, backward)` of `fn(params, *args) -> (outputs, aux)`; see the module docstring.

  `forward(params, *args) -> ((outputs, aux), kept)`;
  `backward(kept, params_now, *args_like, cotangent=ct) -> (grads of params, cts of args)`,
  where `args_like` only gives the arguments' shapes (their values are not read), `ct`
  has the structure of `outputs` (`aux`, e.g. updated BatchNorm statistics, is not
  differentiated), and integer arguments get a None cotangent. Both trace `fn`: call
  them inside `jax.jit`.
  """

  def forward(params, *args):
    graph = _trace(fn, params, args)
    env = _bind_inputs(graph, params, args)
    for eqn in graph.closed.jaxpr.eqns:
      _write(env, eqn.outvars, _apply(eqn, [_read(env, v) for v in eqn.invars]))
    outputs = [_read(env, v) for v in graph.closed.jaxpr.outvars]
    return jax.tree.unflatten(graph.out_tree, outputs), tuple(env[v] for v in graph.kept)

  def backward(kept, params_now, *args_like, cotangent):
    graph = _trace(fn, params_now, args_like)
    jaxpr = graph.closed.jaxpr
    env = _bind_inputs(graph, params_now, None)
    env.update(zip(graph.kept, kept))
    for eqn in jaxpr.eqns:  # The weight values, from the current parameters.
      if set(eqn.outvars) <= graph.weights:
        _write(env, eqn.outvars, _apply(eqn, [_read(env, v) for v in eqn.invars]))
    cts = {}
    out_cts = graph.out_tree.children()[0].flatten_up_to(cotangent)
    for var, ct in zip(jaxpr.outvars, out_cts):  # The leaves of `outputs` come first.
      _accumulate(cts, var, ct)
    for eqn in reversed(jaxpr.eqns):
      outs = [cts.pop(v, None) if isinstance(v, jcore.Var) else None for v in eqn.outvars]
      if all(ct is None for ct in outs):
        continue
      for var, ct in zip(eqn.invars, _eqn_vjp(eqn, [_read(env, v) for v in eqn.invars], outs)):
        _accumulate(cts, var, ct)
    grads = [_zero_if_none(cts.get(v), v) for v in jaxpr.invars[: graph.num_params]]
    arg_cts = [
      _zero_if_none(cts.get(v), v) if _inexact(v.aval) else None
      for v in jaxpr.invars[graph.num_params :]
    ]
    _, args_tree = jax.tree.flatten(args_like)
    return (
      jax.tree.unflatten(jax.tree.structure(params_now), grads),
      jax.tree.unflatten(args_tree, arg_cts),
    )

  return forward, backward


def _trace(fn, params, args) -> _Graph:
  leaves, tree = jax.tree.flatten((params, args))
  num_params = len(jax.tree.leaves(params))
  shapes = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in leaves]

  def flat_fn(*flat):
    p, a = jax.tree.unflatten(tree, flat)
    return fn(p, *a)

  with jax.disable_jit():  # Inline inner jits: their insides are operations too.
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*shapes)
  jaxpr = closed.jaxpr
  weights = set(jaxpr.invars[:num_params]) | set(jaxpr.constvars)
  for eqn in jaxpr.eqns:
    inputs = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    if all(v in weights for v in inputs):
      weights.update(eqn.outvars)
    elif any(v in weights for v in inputs) and any(
      True for _ in jcore.jaxprs_in_params(eqn.params)
    ):
      # Its inside would be re-run at the current weights, activations included.
      raise NotImplementedError(
        f'stale_graph: a {eqn.primitive.name!r} operation (it holds a jaxpr) takes both '
        f'weights and activations; only jit calls are inlined.'
      )
  kept, seen = [], set()
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jcore.Var) and v not in weights and v not in seen:
        seen.add(v)
        kept.append(v)
  return _Graph(closed, num_params, frozenset(weights), tuple(kept), jax.tree.structure(out_shape))


def _bind_inputs(graph: _Graph, params, args) -> dict:
  jaxpr = graph.closed.jaxpr
  env = dict(zip(jaxpr.constvars, graph.closed.consts))
  env.update(zip(jaxpr.invars[: graph.num_params], jax.tree.leaves(params)))
  if args is not None:
    env.update(zip(jaxpr.invars[graph.num_params :], jax.tree.leaves(args)))
  return env


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _write(env, outvars, values):
  for var, value in zip(outvars, values):
    if not isinstance(var, jcore.DropVar):
      env[var] = value


def _apply(eqn, invals) -> list:
  # As `jax.extend.core.jaxpr_as_fun` evaluates an equation (jax 0.10).
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _eqn_vjp(eqn, invals, out_cts) -> list:
  """The cotangents of `eqn`'s inputs (None: not differentiable), its vjp taken at `invals`."""
  wrt = [i for i, v in enumerate(eqn.invars) if isinstance(v, jcore.Var) and _inexact(v.aval)]
  outputs = [i for i, v in enumerate(eqn.outvars) if _inexact(v.aval)]
  if not wrt or not outputs:
    return [None] * len(eqn.invars)

  def partial_eqn(*diff):
    values = list(invals)
    for i, value in zip(wrt, diff):
      values[i] = value
    outs = _apply(eqn, values)
    return [outs[i] for i in outputs]

  _, pullback = jax.vjp(partial_eqn, *[invals[i] for i in wrt])
  cts = [
    out_cts[i]
    if out_cts[i] is not None
    else jnp.zeros(eqn.outvars[i].aval.shape, eqn.outvars[i].aval.dtype)
    for i in outputs
  ]
  result = [None] * len(eqn.invars)
  for i, ct in zip(wrt, pullback(cts)):
    result[i] = ct
  return result


def _accumulate(cts: dict, var, ct) -> None:
  if ct is None or not isinstance(var, jcore.Var) or isinstance(var, jcore.DropVar):
    return
  cts[var] = ct if var not in cts else cts[var] + ct


def _inexact(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_if_none(ct, var):
  return jnp.zeros(var.aval.shape, var.aval.dtype) if ct is None else ct
