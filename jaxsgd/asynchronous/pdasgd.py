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
(`SharedParams.update_on`): queued, never lost. There a backward worker runs ahead of
its lane, so it hands each gradient to an updater of its own, which dispatches the update
once the gradient exists (`Ready`), as the in-process clocks apply it at the backward's
end; after layer 0's, the updater counts the batch's step and gives its token back.

**The bound.** `algorithm.max_inflight` = Q tokens (default n_fwd + n_bwd): a
forward takes a token before it starts and the backward of that batch returns
it when done, so at most Q batches are at any time in a forward, queued, or in
a backward. Forward workers cannot run unboundedly ahead; Q = 1 gives strictly
alternating forward and backward (with 1:1, layer-wise or block updates: sequential
SGD).

**Elastic workers** (`elastic=True`: lane processes with `tolerate_lost_workers`). A
worker whose lane process dies or raises is replaced by a new lane process and goes on
(`ProcessExecutor`, lost workers), so nothing a worker's lane held may be needed by any
other lane. Two things change, both on the shared model's lane (which is never lost):

- a forward's result (residuals and loss) is copied whole to the shared model's lane
  before it is queued (`Send`: delivered once it has all landed, or not at all), so a
  backward worker never reads a value of a lost lane;
- every layer update is a request (layer, gradient, the version its forward read)
  copied the same way to the shared model's *updater*, which applies the requests in
  the order they land, each (batch, layer) once, and counts the step when a batch's
  layer 0 is applied. A backward worker goes on to the next layer at once (it does not
  wait for its update, as on the in-process clocks, where an update is dispatched, not
  waited for), and to the next batch once the updater has applied all of this one's
  layers: requests land in any order, and one still on its way dies with its lane.

A replaced forward worker keeps its token and computes its batch again (a result that
had landed is queued as it is); a replaced backward worker takes the batch it held from
its first layer again — its residuals are on the shared model's lane — and sends every
layer's update again: the updater drops the ones it has applied, so no update is lost
or applied twice (each layer's version count equals the steps). A worker that held
nothing of its lane (waiting for a token or a batch) goes on where it was. BatchNorm
statistics live in the forward workers' lanes, so a model with any is refused.

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
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Put, Ready, Send
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


class UpdateRequest(NamedTuple):
  """Layer updates a backward worker asks the updater for (`elastic`): `grads[i]` for
  layer `layers[i]`, computed at the version `versions[i]` its forward read; `loss` with
  layer 0's (the batch's step)."""

  worker: int
  batch: int
  layers: tuple
  grads: tuple
  versions: tuple
  loss: Any


# A backward worker's phases while it holds a batch: replaced there, it starts the batch
# again (`_rejoin_backward`).
_BACKWARD_PASS = ('copy residuals', 'backward', 'request', 'next layer', 'answer')
# A forward worker's phases while its batch is in its own lane (`_rejoin_forward`).
_FORWARD_PASS = ('batch', 'read', 'copy', 'forward', 'result', 'forwarded')


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
    elastic: lost workers are replaced and rejoin (module docstring; lane processes).
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
    elastic: bool = False,
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
    self.costed, self.lane_processes, self.elastic = costed_links, lane_processes, elastic
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
    if lane_processes:  # a backward worker's first task waits for a forward's first ones
      self.cluster.declare_tasks(0, [ops.update for ops in self.ops])  # (`_updates`)
      for w in range(settings.num_workers):
        kind = 'forward' if w < settings.n_fwd else 'backward'
        self.cluster.declare_tasks(1 + w, [getattr(ops, kind) for ops in self.ops])
    self.queue = self.cluster.channel('forward results', 0)
    self.tokens = self.cluster.channel('tokens', 0)
    if elastic:
      self.landing = [
        self.cluster.channel(f'landed result of forward worker {f}', 0)
        for f in range(settings.n_fwd)
      ]
      self.updates = self.cluster.channel('layer updates', 0)
      self.answers = [  # the batches whose updates the updater has all (`_backward_pass`)
        self.cluster.channel(f'updates of backward worker {b} received', 0)
        for b in range(settings.n_bwd)
      ]
    self.handed: list = []  # lane processes: each backward worker's gradients (`_updates`)
    if lane_processes and not elastic:
      self.handed = [
        self.cluster.channel(f'gradients of backward worker {b}', 1 + settings.n_fwd + b)
        for b in range(settings.n_bwd)
      ]
    self.applied_parts: set[tuple[int, int]] = set()  # (batch, layer) applied (elastic)
    self.started = 0  # batches begun by forward workers
    self.alive = {'forward': settings.n_fwd, 'backward': settings.n_bwd}
    self._lock = threading.Lock()

  def processes(self) -> list[Process]:
    """The token pool and the workers, resumable (their loop variables are `LoopState`s)."""
    n_fwd = self.settings.n_fwd
    workers = [
      Process.resumable(
        worker_name(self.settings, w),
        1 + w,
        functools.partial(self._forward if w < n_fwd else self._backward, w),
        LoopState(failed=False, stopping=False, last=False, k=0),
      )
      for w in range(self.settings.num_workers)
    ]
    shared = [Process.resumable('tokens', 0, self._tokens, LoopState(given=0))]
    for b, _ in enumerate(self.handed):  # (placed with their workers: lost with them)
      lane = 1 + n_fwd + b
      shared.append(
        Process.resumable(
          f'updates of backward worker {b}', lane, functools.partial(self._updates, b), LoopState()
        )
      )
    if self.elastic:
      shared.append(Process.resumable('updater', 0, self._updater, LoopState(i=0)))
      for w, worker in enumerate(workers):
        rejoin = self._rejoin_forward if w < n_fwd else self._rejoin_backward
        worker.on_rejoin = functools.partial(rejoin, w, worker)
        worker.on_lost = functools.partial(common.lost_for_good, 'pdasgd', worker.name)
    return shared + workers

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
      if self.elastic:  # the result goes to the shared model's lane, whole or not at all
        if s.enter('land'):
          yield Send(self.landing[w], s.result, batch=s.t)
          s.result = None
        if s.enter('landed'):
          s.result = yield Get(self.landing[w])
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
          if self.elastic:  # the last one to leave stops the updater
            yield from self._leave('backward', s)
          yield from self._stop_updates(w, s)
          return
        if self.log.has_failed(w):
          s.failed = s.stopping = True
          break
        s.claimed = self.steps.claim()  # Atomic: never more than train_steps passes.
      if s.claimed:
        yield from self._backward_pass(w, s)
      if s.enter('token'):
        if not (self.handed and s.claimed):  # (else its updates give the token back)
          yield Put(self.tokens, TOKEN)
        s.item = None
    if s.enter('hand back'):
      yield Put(self.queue, s.item)  # Another backward worker takes it.
    yield from self._stop_updates(w, s)
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
    # Elastic: the batch is held until the updater has applied all its updates. A
    # worker's tasks run ahead of it, so without this a worker replaced while its last
    # batch's updates were still being computed or copied in its lost lane would have
    # gone on to the next, and those updates were lost (the run never ended when one was
    # layer 0's: the step was never counted).
    while self.elastic and s.enter('answer'):
      if (yield Get(self.answers[w - self.settings.n_fwd])) == item.batch:
        break  # (an earlier answer left by a replaced worker's batch sent twice is dropped)
    if s.enter('commit'):
      if not (self.elastic or self.handed):  # (else at layer 0's update: the updater's, `_updates`)
        self.steps.commit(None, item.loss, worker_name(self.settings, w))
      s.vjps = s.dy = None

  def _apply(self, w: int, s: LoopState, item: Forwarded):
    """Copies the gradients `s.pending` to the shared model and applies them, each
    atomically (elastic: asks the updater to; on lane processes: hands them to the
    worker's updater, `_updates`)."""
    if self.elastic:
      if s.enter('request'):
        layers = tuple(k for k, _ in s.pending)
        request = UpdateRequest(
          w,
          item.batch,
          layers,
          tuple(g for _, g in s.pending),
          tuple(item.versions[k] for k in layers),
          item.loss if 0 in layers else None,
        )
        yield Send(self.updates, request, batch=item.batch)
        self.log.pushed(w)
        s.pending = []
      return
    if self.handed:
      if s.enter('hand on'):
        yield Put(self.handed[w - self.settings.n_fwd], (item, tuple(s.pending)))
        s.pending = []
      return
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
    if s.enter('apply'):  # here, at the instant the backward ended
      for (k, _), g in zip(s.pending, s.grads):
        self.layers[k].apply(
          self.ops[k].update, g, read_version=item.versions[k], lane=1 + w, batch=item.batch
        )
      self.log.pushed(w)
      s.pending, s.grads = [], None

  def _updates(self, b: int, s: LoopState):
    """Backward worker b's layer updates on lane processes: each (layer, gradient) it
    hands on is applied once the gradient exists (`Ready`), in the order handed on; once
    the batch's layer 0 is, its step is counted and its token given back.

    The worker runs ahead of its lane (`ProcessExecutor`): it dispatched its next layer's
    backward before this one's had ended. An update dispatched as soon (taking the layer's
    turn and naming its version) queued on the shared model's lane before its gradient
    existed: it held up the updates behind it there, and a forward dispatched meanwhile
    read the layer at that version and waited for the whole backward (PD-ASGD 1:7 on
    emulated lanes: 46 such waits, 2.7 s of a 7.0 s run). Here, as on the in-process
    clocks, an update is dispatched when its gradient exists, and the worker's backwards
    still run ahead."""
    w = self.settings.n_fwd + b
    while True:
      if s.enter('get'):
        s.handed = yield Get(self.handed[b])
        if s.handed is common.STOP:
          return
      item, pending = s.handed
      if s.enter('ready'):
        yield Ready(tuple(g for _, g in pending))
      if s.enter('apply'):
        for k, g in pending:
          yield from self.layers[k].update_on(
            0,
            self.ops[k].update,
            g,
            read_version=item.versions[k],
            lane=1 + w,
            batch=item.batch,
            stage=k,
          )
        self.log.pushed(w)
      if pending[-1][0] == 0 and s.enter('step'):
        self.steps.commit(None, item.loss, worker_name(self.settings, w))
        yield Put(self.tokens, TOKEN)
      s.handed = None

  def _stop_updates(self, w: int, s: LoopState):
    if self.handed and s.enter('stop updates'):
      yield Put(self.handed[w - self.settings.n_fwd], common.STOP)

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
    if s.last and role == 'backward' and self.elastic and s.enter('stop updater'):
      yield Put(self.updates, common.STOP)  # no backward worker waits for an answer now

  def _updater(self, s: LoopState):
    """The shared model's updater (`elastic`): applies each landed request's layers in
    the order they land, each (batch, layer) once; layer 0's counts the batch's step; once
    all of a batch's are applied it answers the backward worker (`_answers`,
    `_backward_pass`).
    It runs until the last backward worker has left, so that a worker replaced after the
    last step, sending its batch again, is still answered."""
    while True:
      if s.enter('get'):
        s.request, s.i, s.applied_any = (yield Get(self.updates)), 0, False
        if s.request is common.STOP:
          return
      while s.i < len(s.request.layers):
        r, k = s.request, s.request.layers[s.i]
        if (r.batch, k) not in self.applied_parts and s.enter('update'):
          yield from self.layers[k].update_alone(
            0,
            self.ops[k].update,
            r.grads[s.i],
            read_version=r.versions[s.i],
            lane=1 + r.worker,
            batch=r.batch,
            stage=k,
          )
          self.applied_parts.add((r.batch, k))
          s.applied_any = True
          if k == 0:
            self.steps.commit(None, r.loss, worker_name(self.settings, r.worker))
        s.i += 1
      if self._answers(s.request, s.applied_any) and s.enter('answer'):
        yield Put(self.answers[s.request.worker - self.settings.n_fwd], s.request.batch)
      s.request = None

  def _answers(self, request: UpdateRequest, applied_any: bool) -> bool:
    """Whether the updater answers `request`'s worker that its batch is done: once every
    layer of the batch is applied, by the request that completed it or one with layer 0
    (a worker sends layer 0 last; a replaced one sends its batch again). Requests from one
    lane may land out of order: answered at layer 0 while layer 1's was still on its way,
    a worker went on, and when its lane died that update was lost with it."""
    done = all((request.batch, k) in self.applied_parts for k in range(self.num_layers))
    return done and (applied_any or 0 in request.layers)

  # --- lost workers (`elastic`) ----------------------------------------------------------------
  def _rejoin_forward(self, w: int, worker: Process, reason: str) -> LoopState | None:
    """Forward worker w's lane was replaced: a batch it was computing (the residuals were
    in the lost lane) is computed again with the token it holds, unless its result had
    landed (then it is queued); otherwise it held nothing there and goes on."""
    del reason
    s = worker.state
    if s.phase == 'land' and self.landing[w].items:
      return common.state_at('landed', s, 'failed', 'stopping', 'last', 'k', 'token', 't')
    if (
      s.phase in _FORWARD_PASS
      or s.phase == 'land'
      or (s.phase == 'landed' and worker.waiting_on is not None)
    ):  # (a copy still on its way when the lane died was dropped with it)
      return common.state_at('batch', s, 'failed', 'stopping', 'last', 'k', 'token', 't')
    return None

  def _rejoin_backward(self, w: int, worker: Process, reason: str) -> LoopState | None:
    """Backward worker w's lane was replaced: a batch it held is taken from its first
    layer again (its residuals landed on the shared model's lane; the updater drops the
    updates it already applied); otherwise it held nothing there and goes on."""
    del w, reason
    s = worker.state
    if s.phase in _BACKWARD_PASS and getattr(s, 'claimed', False):
      return common.state_at(
        'copy residuals', s, 'failed', 'stopping', 'last', 'k', 'item', 'claimed'
      )
    return None

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
      'applied_parts': sorted(self.applied_parts),
    }

  def load(self, saved: dict) -> None:
    if self.elastic:
      self.applied_parts = set(map(tuple, saved.get('applied_parts', ())))
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
