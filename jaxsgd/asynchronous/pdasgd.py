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
the indices of `cost.speeds` and `cost.failures`. A failed forward
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
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxsgd import models as models_lib
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.asynchronous import common
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Put
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


def lane_names(settings: PdSettings) -> list[str]:
  """The session's lanes, in order: the shared model's (it applies the layer-wise
  updates), then every worker's (placement names `sharedmodel`, `forwardworker0`, ...)."""
  return ['shared model', *(worker_name(settings, w) for w in range(settings.num_workers))]


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
      # Committed to the layer's device, as its updates' outputs are: an uncommitted
      # count would make the first update compile once more than the others.
      opt_state = transfer.to_device(pipeline.tx.init(params), pipeline.device(k))
      self.layers.append(common.SharedParams(f'layer {k}', params, opt_state))
      self.states.append(VersionedStore(f'layer {k} state', state))
    self.cluster = Cluster()
    for i, name in enumerate(lane_names(settings)):
      self.cluster.add_lane(f'{name} ({devices[i]})', devices[i])
    self.queue = self.cluster.channel('forward results', 0)
    self.tokens = self.cluster.channel('tokens', 0)
    self.started = 0  # batches begun by forward workers
    self.alive = {'forward': settings.n_fwd, 'backward': settings.n_bwd}
    self._lock = threading.Lock()

  def processes(self) -> list[Process]:
    """The token pool and the workers, resumable (their loop variables are `LoopState`s)."""
    n_fwd = self.settings.n_fwd
    return [Process.resumable('tokens', 0, self._tokens, LoopState(given=0))] + [
      Process.resumable(
        worker_name(self.settings, w),
        1 + w,
        functools.partial(self._forward if w < n_fwd else self._backward, w),
        LoopState(failed=False, stopping=False, last=False, k=0),
      )
      for w in range(self.settings.num_workers)
    ]

  # --- the processes (see the module docstring) ----------------------------------------------
  # Their variables live in `s` and their steps are phases (`LoopState.enter`; a phase with a
  # yield builds its op from `s` alone), so that a checkpoint saves where each one is. With
  # lanes in processes (the real clock) nothing is checkpointed: the turn-taking updates
  # there are one phase.
  def _tokens(self, s: LoopState):
    while s.given < self.settings.bound:
      if s.enter('give'):
        yield Put(self.tokens, TOKEN)
        s.given += 1

  def _forward(self, w: int, s: LoopState):
    while not s.stopping:
      if s.enter('token'):
        s.token = yield Get(self.tokens)
        if self.steps.done or self.log.has_failed(w):
          s.failed, s.stopping = not self.steps.done, True
          break
        with self._lock:
          s.t, self.started = self.started, self.started + 1
      yield from self._forward_pass(w, s)
      if s.enter('forwarded'):
        if self.log.has_failed(w):  # It queues nothing after its failure time.
          s.failed = s.stopping = True
          break
        self.log.pushed(w)
      if s.enter('queue'):
        yield Put(self.queue, s.result)
        s.result = None
    if s.enter('give back'):
      yield Put(self.tokens, s.token)
    yield from self._leave('forward', s)

  def _forward_pass(self, w: int, s: LoopState):
    """Forward of batch `s.t`, layer by layer: `s.result` (a `Forwarded`)."""
    lane, device = 1 + w, self.devices[1 + w]
    if s.enter('batch'):
      s.batch = transfer.to_device(next(self.streams[w]), device)
      s.h, s.vjps, s.versions, s.loss, s.k = s.batch['image'], [], [], None, 0
    while s.k < self.num_layers:
      k = s.k
      if s.enter('read'):  # The latest version, at this layer's task start.
        snapshot = self.layers[k].read()
        s.version = snapshot.version
        s.variables = stages_lib.with_state(snapshot.value.params, self.states[k].read().value)
      if s.enter('copy'):
        s.variables = yield from common.copy(
          self.cluster, s.variables, 0, lane, device, costed=self.costed, batch=s.t
        )
      if s.enter('forward'):
        labels = s.batch['label'] if k == self.num_layers - 1 else None
        s.h, s.loss, new_state, vjp = yield Compute(
          self.ops[k].forward, (s.variables, s.h, labels), kind='forward', stage=k, batch=s.t
        )
        if new_state:
          self.states[k].write(new_state)
        s.vjps.append(vjp)
        s.versions.append(s.version)
        s.k, s.variables = k + 1, None
    if s.enter('result'):
      s.result = Forwarded(s.t, lane, tuple(s.vjps), tuple(s.versions), s.loss)
      s.batch = s.h = s.vjps = s.versions = s.loss = None

  def _backward(self, w: int, s: LoopState):
    while not s.stopping:
      if s.enter('take'):
        s.item = yield Get(self.queue)
        if s.item is common.STOP:
          return
        if self.log.has_failed(w):
          s.failed = s.stopping = True
          break
        s.claimed = self.steps.claim()  # Atomic: never more than train_steps passes.
      if s.claimed:
        yield from self._backward_pass(w, s)
      if s.enter('token'):
        yield Put(self.tokens, TOKEN)
        s.item = None
    if s.enter('hand back'):
      yield Put(self.queue, s.item)  # Another backward worker takes it.
    yield from self._leave('backward', s)

  def _backward_pass(self, w: int, s: LoopState):
    lane, device, item = 1 + w, self.devices[1 + w], s.item
    if s.enter('copy residuals'):
      s.vjps = yield from common.copy(
        self.cluster, item.vjps, item.lane, lane, device, costed=self.costed, batch=item.batch
      )
      s.dy, s.pending, s.k = None, [], self.num_layers - 1
    while s.k >= 0:
      k = s.k
      if s.enter('backward'):
        grads, s.dy = yield Compute(
          self.ops[k].backward, (s.vjps[k], s.dy), kind='backward', stage=k, batch=item.batch
        )
        s.pending.append((k, grads))
      if self.settings.updates == 'layer' or k == 0:
        yield from self._apply(w, s, item)
      if s.enter('next layer'):
        s.k = k - 1
    if s.enter('commit'):
      self.steps.commit(None, item.loss, worker_name(self.settings, w))
      s.vjps = s.dy = None

  def _apply(self, w: int, s: LoopState, item: Forwarded):
    """Copies the gradients `s.pending` to the shared model and applies them, each
    atomically."""
    if s.enter('copy gradients'):
      s.grads = yield from common.copy(
        self.cluster,
        [g for _, g in s.pending],
        1 + w,
        0,
        self.devices[0],
        costed=self.costed,
        batch=item.batch,
      )
    if s.enter('apply'):
      for (k, _), g in zip(s.pending, s.grads):
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
      s.pending, s.grads = [], None

  def _leave(self, role: str, s: LoopState):
    if s.enter('leave'):
      with self._lock:
        self.alive[role] -= 1
        s.last = self.alive[role] == 0
      if s.last and role == 'backward' and s.failed:
        raise common.WorkersFailedError(
          f'pdasgd: every backward worker failed (cost.failures) after {self.steps.applied} '
          f'of {self.steps.steps} steps.'
        )
      s.stops = 0
    while s.last and role == 'forward' and s.stops < self.settings.n_bwd:
      if s.enter('stop'):
        yield Put(self.queue, common.STOP)
        s.stops += 1

  # --- checkpoints --------------------------------------------------------------------------
  def snapshot(self) -> dict:
    """What a checkpoint saves of the session besides its processes (`algorithms.resume`)."""
    return {
      'layers': [layer.store.snapshot() for layer in self.layers],
      'states': [state.snapshot() for state in self.states],
      'started': self.started,
      'alive': dict(self.alive),
      'steps': self.steps.snapshot(),
      'log': self.log.snapshot(),
    }

  def load(self, saved: dict) -> None:
    for layer, value in zip(self.layers, saved['layers']):
      layer.store.load(value)
    for state, value in zip(self.states, saved['states']):
      state.load(value)
    self.started, self.alive = saved['started'], dict(saved['alive'])
    self.steps.load(saved['steps'])
    self.log.load(saved['log'])

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
