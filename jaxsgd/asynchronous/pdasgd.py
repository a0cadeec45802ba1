r"""PD-ASGD: forward and backward workers with layer-wise partial updates.

Teguemne Fokam et al. (2024). The model is cut into L = `config.stages` layer
groups ("layers"); layer ℓ's parameters and optimizer state live in their own
`VersionedStore`. `algorithm.n_fwd` forward workers and `algorithm.n_bwd`
backward workers (any ratio), each on its own lane, share them:

    forward worker f (own batch stream):     backward worker b:
      loop:                                    loop:
        Get(tokens)           # the bound        r = Get(queue)
        for ℓ = 0 .. L−1:     # a task each      for ℓ = L−1 .. 0:            # a task each
          (v_ℓ, w_ℓ) = layer_ℓ.read()              g_ℓ, δ = r.vjp_ℓ(δ)        # forward's weights
          h, vjp_ℓ = f_ℓ(w_ℓ, h)                   layer_ℓ ← U(layer_ℓ, g_ℓ)  # at the task's end
        Put(queue, (vjp, v, loss))               Put(tokens)

so a forward may see layers at different versions (they are being updated),
and each layer's update lands as soon as its gradient exists, before the
backward moves on to ℓ − 1:

    w_ℓ ← w_ℓ − η g_ℓ(w^fwd),   staleness_ℓ = writes to layer ℓ since the forward read v_ℓ

`algorithm.updates='block'` (the paper's ablation) applies all layers' updates
together at the end of the backward. Two backward workers may update a layer at
once: an update is a read-modify-write at one instant (under a per-layer lock on
the real clock), so none is lost. The update is dispatched at the end of the
layer's backward task, whose duration includes it (cost model: backward +
update). With every lane an OS process of its own (`lane_processes`), the update
is a named task on the shared model's lane, run in the layer's turn
(`SharedParams.update_on`): queued, never lost.

**The bound.** `algorithm.max_inflight` = Q tokens (default n_fwd + n_bwd): a
forward takes a token before it starts and the backward of that batch returns
it when done, so at most Q batches are at any time in a forward, queued, or in
a backward. Forward workers cannot run unboundedly ahead; Q = 1 gives strictly
alternating forward and backward (with 1:1, layer-wise or block updates: sequential
SGD).

Per-layer staleness is recorded in each store; with fixed costs and n_bwd ≥ 2,
layer-wise updates give lower staleness than block updates (the later layers'
updates land earlier): `tests/asynchronous/test_pdasgd.py` derives one case by hand.

Workers are numbered forward first (0 .. n_fwd − 1), then backward; they are
the indices of `cost.worker_speeds` and `cost.failures`. A failed forward
worker queues nothing after its failure time (a forward it was running is
dropped); a failed backward worker hands the next batch it takes back to the
queue and stops (a backward in progress is finished: its layers are already
being updated). Reads of a layer and the residuals handed from a forward to a
backward worker are copies between devices (transfer tasks over the links on
the virtual clock when links are costed).

References:
  C. Teguemne Fokam, K. K. Nazeer, L. König, D. Kappel, A. Subramoney.
  Asynchronous Stochastic Gradient Descent with Decoupled Backpropagation and
  Layer-Wise Updates. 2024. arXiv:2410.05985.
"""

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxsgd import models as models_lib
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.asynchronous import common
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute, Get, Process, Put
from jaxsgd.pipeline.session import PlacedStages, sequential_roles
from jaxsgd.scheduler.store import VersionedStore

UPDATES = ('layer', 'block')
TOKEN = 'token'


@dataclasses.dataclass(frozen=True)
class PdSettings:
  n_fwd: int = 1
  n_bwd: int = 2
  updates: str = 'layer'
  max_inflight: int | None = None  # None: n_fwd + n_bwd

  @property
  def num_workers(self) -> int:
    return self.n_fwd + self.n_bwd

  @property
  def bound(self) -> int:
    return self.max_inflight or self.num_workers


def worker_name(settings: PdSettings, w: int) -> str:
  """Workers are numbered forward first, then backward."""
  n_fwd = settings.n_fwd
  return f'forward worker {w}' if w < n_fwd else f'backward worker {w - n_fwd}'


class Forwarded(NamedTuple):
  """A forward's result: what its backward needs (residuals at the forward's weights)."""

  batch: int
  lane: int  # where the residuals live
  vjps: tuple  # one per layer
  versions: tuple  # the version of each layer the forward read
  loss: Any


class PdSession:
  """One run: the shared layers on lane 0, forward then backward workers on lanes 1...

  Args:
    pipeline: the model cut into layers (`PlacedStages(model, L, tx)`, every stage on
      the device of the shared model): its jitted per-layer ops.
    settings: worker counts, update mode and bound.
    streams: one host batch iterator per forward worker.
    devices: the device of each lane (1 + n_fwd + n_bwd).
    steps: a `StepCounter`; log: failures and pushes.
    costed_links: copies are transfer tasks (virtual clock with link costs).
    lane_processes: every lane is an OS process of its own (`executor='processes'`;
      the pipeline's ops must be named tasks). The layers then live in the shared
      model's process (lane 0, the lane that owns them): each update is a `Compute`
      of the layer's named update task there, holding the layer's turn from its read
      to its write (`SharedParams.update_on`), so updates queue as under the lock of
      the in-process clocks: the same versions read, the same staleness recorded,
      each layer's updates applied one after another. Values are not copied by the
      policy: the executor moves a lane's value to the lane of a task that uses it.
  """

  def __init__(
    self,
    pipeline: PlacedStages,
    settings: PdSettings,
    streams: Sequence[Iterator[dict]],
    devices: Sequence[jax.Device],
    steps: common.StepCounter,
    log: common.WorkerLog,
    *,
    costed_links: bool = False,
    lane_processes: bool = False,
  ):
    if lane_processes:  # values stay in the lane processes; the executor moves them
      devices = [None] * len(devices)
    self.settings, self.streams, self.devices, self.steps, self.log = (
      settings,
      list(streams),
      list(devices),
      steps,
      log,
    )
    self.costed, self.lane_processes = costed_links, lane_processes
    self.fetch = lambda value: value  # values for the driver (`Executor.fetch`)
    self.num_layers = pipeline.num_stages
    roles = sequential_roles(self.num_layers)
    self.ops = [pipeline.ops(k, role) for k, role in enumerate(roles)]
    self.layers, self.states = [], []
    for k, role in enumerate(roles):
      params, state = stages_lib.split_variables(pipeline.initial_variables(k, role))
      self.layers.append(common.SharedParams(f'layer {k}', params, pipeline.tx.init(params)))
      self.states.append(VersionedStore(f'layer {k} state', state))
    self.cluster = Cluster()
    self.cluster.add_lane(f'shared model ({devices[0]})', devices[0])
    for w in range(settings.num_workers):
      self.cluster.add_lane(f'{worker_name(self.settings, w)} ({devices[1 + w]})', devices[1 + w])
    self.queue = self.cluster.channel('forward results', 0)
    self.tokens = self.cluster.channel('tokens', 0)
    self.started = 0  # batches begun by forward workers
    self.alive = {'forward': settings.n_fwd, 'backward': settings.n_bwd}
    self._lock = threading.Lock()

  def processes(self) -> list[Process]:
    n_fwd = self.settings.n_fwd
    return [Process('tokens', 0, self._tokens())] + [
      Process(
        worker_name(self.settings, w), 1 + w, self._forward(w) if w < n_fwd else self._backward(w)
      )
      for w in range(self.settings.num_workers)
    ]

  # --- the processes (see the module docstring) ----------------------------------------------
  def _tokens(self):
    for _ in range(self.settings.bound):
      yield Put(self.tokens, TOKEN)

  def _forward(self, w: int):
    failed = False
    while True:
      token = yield Get(self.tokens)
      if self.steps.done or (failed := self.log.has_failed(w)):
        yield Put(self.tokens, token)
        break
      with self._lock:
        t, self.started = self.started, self.started + 1
      result = yield from self._forward_pass(w, t)
      if failed := self.log.has_failed(w):  # It queues nothing after its failure time.
        yield Put(self.tokens, token)
        break
      self.log.pushed(w)
      yield Put(self.queue, result)
    yield from self._leave('forward', failed)

  def _forward_pass(self, w: int, t: int):
    lane, device = 1 + w, self.devices[1 + w]
    batch = transfer.to_device(next(self.streams[w]), device)
    h, vjps, versions, loss = batch['image'], [], [], None
    for k in range(self.num_layers):
      snapshot = self.layers[k].read()  # The latest version, at this layer's task start.
      variables = yield from common.copy(
        self.cluster,
        stages_lib.with_state(snapshot.value.params, self.states[k].read().value),
        0,
        lane,
        device,
        costed=self.costed,
        batch=t,
      )
      labels = batch['label'] if k == self.num_layers - 1 else None
      h, loss, new_state, vjp = yield Compute(
        self.ops[k].forward, (variables, h, labels), kind='forward', stage=k, batch=t
      )
      if new_state:
        self.states[k].write(new_state)
      vjps.append(vjp)
      versions.append(snapshot.version)
    return Forwarded(t, lane, tuple(vjps), tuple(versions), loss)

  def _backward(self, w: int):
    while True:
      item = yield Get(self.queue)
      if item is common.STOP:
        return
      if self.log.has_failed(w):
        yield Put(self.queue, item)  # Another backward worker takes it.
        yield from self._leave('backward', True)
        return
      if self.steps.claim():  # Atomic: never more than train_steps passes.
        yield from self._backward_pass(w, item)
      yield Put(self.tokens, TOKEN)

  def _backward_pass(self, w: int, item: Forwarded):
    lane, device = 1 + w, self.devices[1 + w]
    vjps = yield from common.copy(
      self.cluster, item.vjps, item.lane, lane, device, costed=self.costed, batch=item.batch
    )
    dy, pending = None, []
    for k in reversed(range(self.num_layers)):
      grads, dy = yield Compute(
        self.ops[k].backward, (vjps[k], dy), kind='backward', stage=k, batch=item.batch
      )
      pending.append((k, grads))
      if self.settings.updates == 'layer' or k == 0:
        yield from self._apply(w, pending, item)
        pending = []
    self.steps.commit(None, item.loss, worker_name(self.settings, w))

  def _apply(self, w: int, pending: list, item: Forwarded):
    """Copies the gradients to the shared model and applies them, each atomically."""
    grads = yield from common.copy(
      self.cluster,
      [g for _, g in pending],
      1 + w,
      0,
      self.devices[0],
      costed=self.costed,
      batch=item.batch,
    )
    for (k, _), g in zip(pending, grads):
      if self.lane_processes:  # on lane 0, in the layer's turn
        yield from self.layers[k].update_on(
          0,
          self.ops[k].update,
          g,
          read_version=item.versions[k],
          lane=1 + w,
          batch=item.batch,
          stage=k,
        )
      else:  # here, at the instant the backward ended
        self.layers[k].apply(
          self.ops[k].update, g, read_version=item.versions[k], lane=1 + w, batch=item.batch
        )
    self.log.pushed(w)

  def _leave(self, role: str, failed: bool):
    with self._lock:
      self.alive[role] -= 1
      last = self.alive[role] == 0
    if last and role == 'backward' and failed:
      raise common.WorkersFailedError(
        f'pdasgd: every backward worker failed (cost.failures) after {self.steps.applied} '
        f'of {self.steps.steps} steps.'
      )
    if last and role == 'forward':
      for _ in range(self.settings.n_bwd):
        yield Put(self.queue, common.STOP)

  # --- what the run reports -------------------------------------------------------------------
  def variables(self):
    return models_lib.merge_variables(
      [
        {'params': self.fetch(layer.read().value.params), **self.fetch(state.read().value)}
        for layer, state in zip(self.layers, self.states)
      ]
    )

  def staleness(self) -> dict[str, np.ndarray]:
    return {f'layer {k}': layer.store.staleness() for k, layer in enumerate(self.layers)}

  def metrics(self) -> dict:
    return {
      **common.staleness_metrics(self.staleness(), 'layer'),
      'failed_workers': len(self.log.failed),
    }
