r"""`ddg`: decoupled parallel backpropagation with delayed gradients (Huo et al., 2018).

The network is cut into K modules on K lanes (`config.stages`). Module k
(1-indexed) has delay d_k = K − k: at iteration t it runs the forward of batch t
and the backward of batch t − d_k, with the error gradient δ that module k + 1
sent at an earlier iteration, then updates its weights. Nobody waits for a full
backward pass (no backward locking); the last module has no delay.

Update rule (paper form, `algorithm.variant='paper'`, the default), module k:

    w_k^{t+1} = w_k^t − η · OptaxUpdate( J_{w_k}f_k(w_k^{t−d_k}; h_{k−1}^{t−d_k})ᵀ δ_k^{t−d_k} )

the Jacobian taken at the weights of the forward of batch t − d_k: the stored
`jax.vjp` residuals of that forward (module k keeps d_k of them).

The public code's form (`variant='stale_graph'`; github.com/slowbull/DDG, PyTorch)
keeps each forward's autograd graph and calls `output.backward(δ)` d_k iterations
later, after `optimizer.step()` has changed the weights in place (through `p.data`).
Every operation's backward then reads the activations it saved in the forward and
the parameters as they are now (`jaxsgd.pipeline.stale_graph`): for a layer
h = φ(u), u = x W, that receives δ = ∂L/∂h of batch t − d_k,

    e = δ ⊙ φ'(u^{t−d_k})          u, x: the forward's activations (old)
    grad_W = (x^{t−d_k})ᵀ e        the forward's input
    grad_x = e (W^t)ᵀ              the current weight

so inside a module of several layers, and in the δ sent upstream, the current
weights replace the forward's. The forward is never run again.

The recompute form (`variant='recompute'`; no published code) keeps only the
input h_{k−1}^{t−d_k} and runs the forward again at the current weights before
backpropagating: J_{w_k}f_k(w_k^t; h_{k−1}^{t−d_k})ᵀ δ_k^{t−d_k}, activations
included; it costs a forward more per backward, and the virtual clock charges it.

In all three forms the update of module k uses the input and the error signal of
batch t − d_k: its recorded staleness is d_k (`staleness_*/stage{k}`). The
stale-graph and recompute forms take their Jacobian (partly) at the current
weights; `weight_staleness_mean/stage{k}` reports the age of those weights (0).

Schedule (0-indexed stage k = module k + 1, delay d = K − 1 − k):

    for t in 0, 1, ...:                              # stage k, in parallel with the others
      h = forward_k(w_k, batch t's input) ; send h → stage k + 1 ; keep vjp_t
      if t < d: continue                             # pipeline fill: skip the first d backwards
      δ = receive from stage k + 1                   # its input-gradient of batch t − d
      g, dx = vjp_{t−d}(δ) ; send dx → stage k − 1
      w_k ← update(w_k, g)                           # staleness d (writes since the forward)

    K = 3, stage 0:  F0 F1 F2 B0 F3 B1 F4 B2 ...     (d = 2)
           stage 1:     F0 F1 B0 F2 B1 F3 B2 ...     (d = 1)
           stage 2:        F0 B0 F1 B1 F2 B2 ...     (d = 0)

The pipeline is never flushed: epochs follow each other in one stream; at the
end of training, the d_k backwards still in flight are dropped. K = 1 is BP
exactly. Run with `clock='virtual'` to see the parallel speed-up of the schedule
on a simulated cluster (calibrated per stage on this machine).

References:
  Z. Huo, B. Gu, Q. Yang, H. Huang. Decoupled Parallel Backpropagation with
  Convergence Guarantee. ICML 2018. arXiv:1804.10574 (Algorithm 1, Eq. (8)–(10)).
"""

import dataclasses
import logging

from jaxsgd.algorithms import pipelined
from jaxsgd.algorithms.settings import SharedSettings, derived, section
from jaxsgd.pipeline import StageRole, sequential_roles

VARIANTS = ('paper', 'stale_graph', 'recompute')
_DELAYED_BACKWARD = {'paper': 'stored', 'stale_graph': 'stale_graph', 'recompute': 'recompute'}


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `ddg`, and the shared fields (`shared`)."""

  variant: str = 'paper'
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """The whole run is checkpointed (`algorithms.resume`): on the virtual clock between
    any two events, on the real clock at a drained point, in one process or on lanes."""
    return True


def roles(num_stages: int, variant: str = 'paper') -> tuple[StageRole, ...]:
  """Staged BP's roles with delay K − 1 − k at stage k (0-indexed); `variant` picks
  how a delayed backward takes its Jacobian (see the module docstring)."""
  return tuple(
    dataclasses.replace(role, delay=num_stages - 1 - k, delayed_backward=_DELAYED_BACKWARD[variant])
    for k, role in enumerate(sequential_roles(num_stages))
  )


def validate(config, model) -> Settings:
  settings = section(config.algorithm, Settings, 'algorithm', ignore=('name',))
  if settings.variant not in VARIANTS:
    raise ValueError(
      f'algorithm.variant: {settings.variant!r} is not a DDG variant; '
      f'allowed: {", ".join(VARIANTS)}.'
    )
  shared = pipelined.validate_pipeline(config, model)
  if shared.stages == 1:
    logging.warning(
      'stages=1: DDG with one stage has no stages to decouple and trains as backprop (bp) '
      'does; set stages >= 2 (e.g. --config.stages=4) for DDG.'
    )
  return dataclasses.replace(settings, shared=shared)


def train(run, settings: Settings) -> dict:
  return pipelined.train_roles(
    run,
    settings.shared,
    roles(settings.shared.stages, settings.variant),
    title='ddg: staleness per stage',
    resumable=settings.resumable,
  )
