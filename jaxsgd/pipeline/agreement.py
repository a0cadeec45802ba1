r"""Gradient agreement: each block's local gradient against the true (backprop) gradient.

Laskin et al. (2020) find that the gradient a block gets from local losses agrees
less with the gradient backprop would give it the earlier the block is. For batch t,
with θ_k^t the weights block k ran batch t's forward with (its snapshot at its
iteration t), the probe computes, per block k:

    g_true_k  = ∇_{θ_k} L(f_{K−1}(… f_0(x_t; θ_0^t) …; θ_{K−1}^t), y_t)     backprop
    g_local_k = ∇_{θ_k} Σ_{(s, e) ∋ k} L_e(h_{e−1} = f_{e−1}(… f_s(sg(h_{s−1})) …))
    cos_k     = ⟨g_local_k, g_true_k⟩ / (‖g_local_k‖ ‖g_true_k‖)     (θ_k without its head)

where (s, e) are the loss groups of the roles (`loss_groups`): the loss at block
e − 1 (its auxiliary head's, or the model's) reaches blocks s … e − 1. g_local_k is
exactly the gradient of batch t that the pipeline applies to block k (pipelined
variants apply its parts at different iterations, each through batch t's forward),
so cos_k compares what the block learns from batch t with what backprop would have
taught it from the same forward.

A diagnostic: it runs outside the schedule (no simulated time; on the real clock it
delays the last block's lane) every `every` iterations, on the last block's device.

References:
  M. Laskin, L. Metz, S. Nabarro, M. Saroufim, B. Noune, C. Luschi,
  J. Sohl-Dickstein, P. Abbeel. Parallel Training of Deep Networks with Local
  Updates. 2020. arXiv:2012.03837.
"""

import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsgd.models import Stage
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.pipeline.roles import StageRole
from jaxsgd.scheduler import transfer


def loss_groups(roles: Sequence[StageRole]) -> tuple[tuple[int, int], ...]:
  """`(start, end)` per loss: the loss at block end − 1 reaches blocks start … end − 1.

  A block passes a gradient it received on upstream only if it sends its 'total'
  input gradient and does not split its backward; its own loss's, if it sends any.
  """
  groups = []
  for last, role in enumerate(roles):
    if role.loss == 'none':
      continue
    start = last
    while start > 0 and _passes_up(roles[start], own=start == last):
      start -= 1
    groups.append((start, last + 1))
  return tuple(groups)


def _passes_up(role: StageRole, own: bool) -> bool:
  if role.sends_delta == 'none':
    return False
  return own or (role.sends_delta == 'total' and not role.split_backward)


def make_cosines(
  stages: Sequence[Stage], roles: Sequence[StageRole], loss_fn: Callable = stages_lib.cross_entropy
) -> Callable:
  """Jitted `(params per block, state per block, x, labels) -> cos_k per block` (K,)."""
  groups = loss_groups(roles)

  def outputs(params, states, x, upto):
    h, hs = x, []
    for k in range(upto):
      h, _ = stages_lib.apply_train(stages[k], params[k], states[k], h)
      hs.append(h)
    return hs

  def true_loss(params, states, x, labels):
    return loss_fn(outputs(params, states, x, len(stages))[-1], labels)

  def local_loss(params, states, x, labels):
    total = 0.0
    for start, end in groups:
      h = x if start == 0 else jax.lax.stop_gradient(outputs(params, states, x, start)[-1])
      for k in range(start, end):
        if k == end - 1 and roles[k].loss == 'aux':
          (h, logits), _ = stages_lib.apply_train(
            stages[k], params[k], states[k], h, method=Stage.forward_with_aux
          )
        else:
          h, _ = stages_lib.apply_train(stages[k], params[k], states[k], h)
          logits = h
      total += loss_fn(logits, labels)
    return total

  @jax.jit
  def cosines(params, states, x, labels):
    true = jax.grad(true_loss)(params, states, x, labels)
    local = jax.grad(local_loss)(params, states, x, labels)
    return jnp.stack([_cosine(_block(t), _block(l)) for t, l in zip(true, local)])

  return cosines


def _block(params) -> jax.Array:
  """A block's parameters without its auxiliary head, as one vector."""
  return jnp.concatenate(
    [
      jnp.ravel(leaf)
      for name, tree in sorted(params.items())
      if not name.startswith('aux_')
      for leaf in jax.tree.leaves(tree)
    ]
  )


def _cosine(a, b):
  return jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


class AgreementProbe:
  """Collects the weights of batch t's forward from every block; measures cos_k.

  Args:
    cosines: `make_cosines(...)` of the pipeline.
    num_stages: K.
    device: where the measurement runs.
    every: measure batches t = 0, every, 2·every, …
  """

  def __init__(self, cosines: Callable, num_stages: int, device, every: int):
    self._cosines, self._num, self._device, self.every = cosines, num_stages, device, every
    self._pending: dict[int, dict] = {}  # t -> {k: (params, state), 'batch'}
    self._measured: list[tuple[int, jax.Array]] = []  # not yet on the host
    self.history: list[tuple[int, np.ndarray]] = []  # (t, cos per block), on the host
    self._lock = threading.Lock()  # Real-clock stage threads record concurrently.

  def wants(self, t: int) -> bool:
    return t % self.every == 0

  def record(self, k: int, t: int, params, state, batch: dict | None = None) -> None:
    """Block k's weights for batch t (block 0 also gives the batch); measures once all
    K blocks have given theirs."""
    weights = transfer.to_device((params, state), self._device)
    with self._lock:
      entry = self._pending.setdefault(t, {})
      entry[k] = weights
      if batch is not None:
        entry['batch'] = transfer.to_device((batch['image'], batch['label']), self._device)
      if sum(isinstance(key, int) for key in entry) < self._num:
        return
      del self._pending[t]
    params, states = zip(*(entry[j] for j in range(self._num)))
    cos = self._cosines(list(params), list(states), *entry['batch'])
    with self._lock:
      self._measured.append((t, cos))

  def snapshot(self) -> dict:
    with self._lock:
      return {
        'pending': dict(self._pending),
        'measured': list(self._measured),
        'history': list(self.history),
      }

  def load(self, saved: dict) -> None:
    with self._lock:
      self._pending = dict(saved['pending'])
      self._measured = list(saved['measured'])
      self.history = list(saved['history'])

  def drain(self) -> np.ndarray | None:
    """The cosines measured since the last drain, averaged per block (None: none); syncs."""
    with self._lock:
      measured, self._measured = sorted(self._measured, key=lambda m: m[0]), []
    if not measured:
      return None
    steps, values = zip(*measured)
    values = np.asarray(transfer.to_host(list(values)), np.float64)
    self.history.extend(zip(steps, values))
    return values.mean(axis=0)

  def series(self) -> tuple[np.ndarray, np.ndarray]:
    """`(t of each measurement, cos (measurements, K))`: everything measured so far."""
    self.drain()
    if not self.history:
      return np.zeros(0, np.int64), np.zeros((0, self._num))
    steps, values = zip(*sorted(self.history, key=lambda h: h[0]))
    return np.asarray(steps), np.stack(values)
