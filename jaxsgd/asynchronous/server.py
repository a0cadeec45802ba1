r"""ASGD / Hogwild! and DC-ASGD: a parameter server and M asynchronous workers.

Update rules (η: `config.optimizer`, applied by the server the moment a push
arrives, no barrier; τ: the push's staleness, w_bak(m): the parameters worker
m pulled and computed its gradient g_m at):

    asgd (Recht et al. 2011):        w ← w − η g_m
      staleness_lr='inverse':        w ← w − η g_m / max(τ, 1)        (Zhang et al. 2016)
      staleness_lr='inverse_sqrt':   w ← w − η g_m / √max(τ, 1)
    dcasgd (Zheng et al. 2017):      w ← w − η (g_m + λ_t ⊙ g_m ⊙ g_m ⊙ (w − w_bak(m)))
      adaptive=False (DC-ASGD-c):    λ_t = λ0                                  (default 0.04)
      adaptive=True  (DC-ASGD-a):    λ_t = λ0 / √(MS_t + ε),                   (default 2)
                                     MS_t = m MS_{t−1} + (1 − m) g_m ⊙ g_m

The rules are the Optax transforms of `jaxsgd.transforms`
(`delay_compensation_server`, `scale_by_staleness`) chained before the
optimizer; λ0 = 0 is ASGD bit for bit.

Schedule (server lane 0, worker m on lane m + 1, each on its own device):

    server:                                         worker m:
      for m: pull(m); send w⁰ to m                    loop:
      while fewer than train_steps applied:             (v, w) = Get(reply[m])     # its pull
        push = Get(inbox)                               g, ℓ = grad(w; next batch of stream m)
        τ = version − push.v                            Send(inbox, (m, v, g, ℓ))  # its push
        w ← apply(w, push.g, m, τ)        (a task)
        record w_bak(m) ← w               (same call)
        Send(reply[m], (version, w))      # m's next pull
      Put(reply[m], STOP) for every m

The reply to a push *is* the worker's next pull, so its backup w_bak(m) is
recorded by the same jitted call that applies the push, and its read version
is the version that call wrote. At t = 0 every worker pulls version 0. With M
equal-speed workers and free links, round one has staleness 0, 1, …, M − 1 and
every later push exactly M − 1. Worker speeds (`cost.speeds`) and seeded
stragglers (`cost.straggler_std`) change the order; a worker past its failure
time (`cost.failures`) pushes nothing more and the others go on. BatchNorm
statistics (if any) are kept beside the versioned parameters, so they bump no
version.

References:
  B. Recht, C. Re, S. Wright, F. Niu. Hogwild!: A Lock-Free Approach to
  Parallelizing Stochastic Gradient Descent. NeurIPS 2011. arXiv:1106.5730.
  S. Zheng, Q. Meng, T. Wang, W. Chen, N. Yu, Z.-M. Ma, T.-Y. Liu. Asynchronous
  Stochastic Gradient Descent with Delay Compensation. ICML 2017.
  arXiv:1609.08326 (Algorithm 2, Eq. 10; Sec. 4 for the adaptive λ).
  W. Zhang, S. Gupta, X. Lian, J. Liu. Staleness-aware Async-SGD for Distributed
  Deep Learning. IJCAI 2016. arXiv:1511.05950.
"""

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxsgd import optimizers, transforms
from jaxsgd.asynchronous import common
from jaxsgd.models import stage_functions
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Put, Send
from jaxsgd.pipeline.session import PlacedStages, StageParams, sequential_roles
from jaxsgd.scheduler.store import Snapshot, VersionedStore
from jaxsgd.scheduler.tasks import Task, TaskRecipe

STALENESS_LR = {
  'none': None,
  'inverse': transforms.inverse_staleness,
  'inverse_sqrt': transforms.inverse_sqrt_staleness,
}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
  """The number of workers and the server's update rule."""

  num_workers: int
  staleness_lr: str = 'none'
  delay_compensation: bool = False  # DC-ASGD
  lambda0: float | None = None  # None: the paper's default (0.04 constant, 2 adaptive)
  adaptive: bool = False


def lane_names(num_workers: int) -> list[str]:
  """The session's lanes, in order: the server's, then each worker's (in one process a
  trace row is the name and the lane's device, `worker 1 (cpu:1)`; its placement name
  `worker1`)."""
  return ['server', *(f'worker {m}' for m in range(num_workers))]


def server_gradient_transforms(settings: ServerSettings) -> list:
  """[delay compensation], [staleness scaling]: what the server does to a pushed g."""
  parts = []
  if settings.delay_compensation:
    parts.append(
      transforms.delay_compensation_server(
        settings.num_workers, settings.lambda0, settings.adaptive
      )
    )
  if STALENESS_LR[settings.staleness_lr] is not None:
    parts.append(transforms.scale_by_staleness(STALENESS_LR[settings.staleness_lr]))
  return parts


def server_optimizer(
  base: optax.GradientTransformation, settings: ServerSettings
) -> optax.GradientTransformationExtraArgs:
  """`chain([delay compensation], [staleness scaling], base)`; its update takes
  `worker_id=` and `staleness=`. (`build` uses `make_optimizer`, which also folds
  weight decay into g before these.)"""
  return optax.chain(*server_gradient_transforms(settings), base)


def make_apply(tx: optax.GradientTransformationExtraArgs, record_pulls: bool):
  """Jitted `(params, opt_state, grads, worker_id, staleness) -> (params, opt_state)`:
  the update, then (DC-ASGD) w_bak(worker) ← the new params, its next pull."""

  @jax.jit
  def apply(params, opt_state, grads, worker_id, staleness):
    updates, opt_state = tx.update(
      grads, opt_state, params, worker_id=worker_id, staleness=staleness
    )
    params = optax.apply_updates(params, updates)
    if record_pulls:
      opt_state = transforms.record_pull(opt_state, params, worker_id)
    return params, opt_state

  return apply


def apply_tasks(
  *, optimizer: optimizers.OptimizerSettings, total_steps: int, settings: ServerSettings
) -> dict:
  """`{'apply': make_apply(...)}` of the server's optimizer, built from picklable settings
  (a `TaskRecipe` factory: the same jitted update in the driver and in a lane process)."""
  tx = optimizers.make_optimizer(
    optimizer, total_steps, gradient_transforms=server_gradient_transforms(settings)
  )
  return {'apply': make_apply(tx, settings.delay_compensation)}


def named_apply(optimizer, total_steps: int, settings: ServerSettings) -> Task:
  """The server's update as a named task (`apply_tasks`)."""
  recipe = TaskRecipe.of(
    apply_tasks, optimizer=optimizer, total_steps=total_steps, settings=settings
  )
  return Task(recipe, 'apply')


class ParameterServer:
  """The server's `(params, opt_state)` in one `VersionedStore`, and its update.

  The server remembers the version of each worker's last pull and refuses a push
  from a worker that never pulled (DC-ASGD needs the backup recorded at pull time)
  or that was computed at another version than the one it pulled.
  """

  def __init__(
    self,
    tx: optax.GradientTransformationExtraArgs,
    params,
    num_workers: int,
    device: jax.Device,
    *,
    record_pulls: bool,
    apply_fn=None,
  ):
    # Committed to the device like the updates that replace it: an uncommitted leaf (Adam's
    # count) would make the first update compile a second program.
    opt_state = transfer.to_device(tx.init(params), device)
    self.store = VersionedStore('server params', StageParams(params, opt_state))
    # `apply_fn`: the same update as a named task (`named_apply`), for lane processes.
    self.apply_fn = make_apply(tx, record_pulls) if apply_fn is None else apply_fn
    self._device = device
    self._pulled: list[int | None] = [None] * num_workers
    self._worker_ids = [transfer.constant(m, device, np.int32) for m in range(num_workers)]
    self._staleness: dict[int, jax.Array] = {}  # device scalars, one per value seen

  def pull(self, worker: int) -> Snapshot:
    """Worker `worker` receives the current parameters (its backup is these)."""
    snapshot = self.store.read()
    self._pulled[worker] = snapshot.version
    return snapshot

  def update_call(self, worker: int, grads, read_version: int) -> tuple:
    """`(fn, args)` of the update task for `worker`'s push of a gradient computed at
    `read_version` (read now, at the task's start)."""
    pulled = self._pulled[worker]
    if pulled is None:
      raise ValueError(
        f'worker {worker} pushed a gradient but never pulled: the server '
        f'records w_bak({worker}) and the pulled version when a worker pulls '
        f'(DC-ASGD, Algorithm 2), so a push without a pull has no backup.'
      )
    if read_version != pulled:
      raise ValueError(
        f'worker {worker} pushed a gradient computed at version {read_version} '
        f'but its last pull was version {pulled}.'
      )
    current = self.store.read()
    staleness = self._constant(current.version - read_version)
    return self.apply_fn, (
      current.value.params,
      current.value.opt_state,
      grads,
      self._worker_ids[worker],
      staleness,
    )

  def commit(self, worker: int, value, read_version: int, *, lane: int, batch: int):
    """Writes the update task's result; the worker must pull again before pushing."""
    self._pulled[worker] = None
    return self.store.write(StageParams(*value), read_version=read_version, lane=lane, batch=batch)

  def sample_update_call(self) -> tuple:
    """The update on the initial parameters, standing in for a gradient (for timing)."""
    value = self.store.read().value
    return self.apply_fn, (
      value.params,
      value.opt_state,
      value.params,
      self._worker_ids[0],
      self._constant(0),
    )

  def _constant(self, staleness: int) -> jax.Array:
    if staleness not in self._staleness:
      self._staleness[staleness] = transfer.constant(staleness, self._device, np.int32)
    return self._staleness[staleness]


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=['grads', 'loss', 'state'],
  meta_fields=['worker', 'version', 'batch'],
)
@dataclasses.dataclass(frozen=True)
class Push:
  """A worker's gradient (copied to the server; the metadata is not an array)."""

  worker: int
  version: int
  batch: int
  grads: Any
  loss: Any
  state: Any


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=['params', 'state'],
  meta_fields=['version', 'rejoin'],
)
@dataclasses.dataclass(frozen=True)
class Pulled:
  """The parameters (and model state) a worker receives, and their version."""

  version: int
  params: Any
  state: Any
  rejoin: bool = False  # the answer to a `Rejoin`


class WorkerFailed(NamedTuple):
  worker: int


STALE = object()  # `AsgdSession._pull`: a reply sent before a worker's loss, dropped


class Rejoin(NamedTuple):
  """Worker `worker` is back (its lost lane was replaced): it waits for a pull."""

  worker: int


class AsgdSession:
  """One run: the server on lane 0, worker m on lane m + 1, their channels.

  Args:
    pipeline: the model as one stage (`PlacedStages(model, 1, ...)`): its jitted
      forward and backward compute a worker's gradient.
    server: the parameter server (its store lives on `devices[0]`).
    state: the model state (BatchNorm statistics), kept beside the versioned store.
    streams: one host batch iterator per worker.
    devices: the device of each lane (`1 + M` of them).
    steps: a `StepCounter` (the run ends when it is done).
    log: when workers fail and when they push.
  """

  def __init__(
    self,
    pipeline: PlacedStages,
    server: ParameterServer,
    state,
    streams: Sequence[Iterator[dict]],
    devices: Sequence[jax.Device],
    steps: common.StepCounter,
    log: common.WorkerLog,
  ):
    self.pipeline, self.server, self.streams, self.steps, self.log = (
      pipeline,
      server,
      list(streams),
      steps,
      log,
    )
    self.ops = pipeline.ops(0, sequential_roles(1)[0])
    self.fetch = lambda value: value  # `train_session` sets the executor's
    self.model_state = VersionedStore('server model state', state)
    self.num_workers = len(self.streams)
    self.devices = list(devices)
    self.cluster = Cluster()
    for i, name in enumerate(lane_names(self.num_workers)):
      self.cluster.add_lane(f'{name} ({devices[i]})', devices[i])
    # The server's first update waits for a worker's first gradient: declared, it is
    # built beside the workers' tasks (`Cluster.declare_tasks`).
    self.cluster.declare_tasks(0, [server.apply_fn])
    for m in range(self.num_workers):
      self.cluster.declare_tasks(1 + m, [self.ops.forward, self.ops.backward])
    self.inbox = self.cluster.channel('pushes', 0)
    self.replies = [
      self.cluster.channel(f'pulls of worker {m}', 1 + m) for m in range(self.num_workers)
    ]

  def processes(self) -> list[Process]:
    """The server and the workers, resumable: their loop variables are `LoopState`s. A
    worker's loss can be survived (`on_lost`, with `tolerate_lost_workers`)."""
    server = LoopState(
      first=0, live=list(range(self.num_workers)), push=None, call=None, stop=0, rejoin=None
    )
    workers = [
      Process.resumable(
        f'worker {m}',
        1 + m,
        functools.partial(self._worker, m),
        LoopState(k=0, failed=False, rejoining=False, awaiting_rejoin=False),
      )
      for m in range(self.num_workers)
    ]
    for m, worker in enumerate(workers):
      worker.on_lost = functools.partial(self._lost, m)
      worker.on_rejoin = functools.partial(self._rejoin, m, worker)
    return [Process.resumable('server', 0, self._server, server)] + workers

  # --- the processes (see the module docstring) ------------------------------------------------
  # Their variables live in `s` and every yield is a phase (`LoopState.enter`), so that a
  # checkpoint saves where each one is and a resumed run yields the same op again.
  def _server(self, s: LoopState):
    while s.first < self.num_workers:  # Every worker pulls version 0 first.
      yield from self._reply(s, s.first)
      s.first += 1
    while not self.steps.done:
      if s.enter('get'):
        message = yield Get(self.inbox)
        if isinstance(message, WorkerFailed):
          s.live.remove(message.worker)
          if not s.live:
            raise common.WorkersFailedError(
              f'asgd: every worker failed (cost.failures) or was lost after '
              f'{self.steps.applied} of {self.steps.steps} steps.'
            )
          continue
        if isinstance(message, Rejoin):
          s.rejoin = message.worker
        else:
          s.push = message
          s.call = self.server.update_call(message.worker, message.grads, message.version)
      if getattr(s, 'rejoin', None) is not None:  # a replaced worker waits for the parameters
        if s.enter('rejoin reply'):
          snapshot = self.server.pull(s.rejoin)
          state = self.model_state.read().value
          pulled = Pulled(snapshot.version, snapshot.value.params, state, rejoin=True)
          yield Send(self.replies[s.rejoin], pulled)
          s.rejoin = None
        continue
      yield from self._apply(s)
      if not self.steps.done:
        yield from self._reply(s, s.push.worker)
    while s.stop < self.num_workers:
      if s.enter('stop'):
        yield Put(self.replies[s.stop], common.STOP)
        s.stop += 1

  def _reply(self, s: LoopState, worker: int):
    if s.enter('reply'):
      # Resumed here, the pull is read again: the same, since only this process writes
      # the store and the model state, and the Send (made before the checkpoint) is not
      # made again.
      snapshot = self.server.pull(worker)
      yield Send(
        self.replies[worker],
        Pulled(snapshot.version, snapshot.value.params, self.model_state.read().value),
      )

  def _apply(self, s: LoopState):
    if s.enter('apply'):
      push = s.push
      value = yield Compute(*s.call, kind='update', stage=0, batch=self.steps.applied)
      s.call = None

      def commit():
        self.server.commit(
          push.worker, value, push.version, lane=1 + push.worker, batch=self.steps.applied
        )
        if push.state:
          self.model_state.write(push.state)

      self.steps.commit(commit, push.loss, f'worker {push.worker}')

  def _pull(self, m: int, s: LoopState):
    """Worker `m`'s 'rejoin' and 'pull' phases: a new lane process first asks for the
    parameters; then the server's reply. Returns it (`common.STOP`: the run is over),
    `STALE` for a reply to be dropped, or None where the pull phase is already past (a
    resumed worker)."""
    if getattr(s, 'rejoining', False) and s.enter('rejoin'):  # (older checkpoints: no field)
      yield Put(self.inbox, Rejoin(m))
      s.rejoining = False
    if not s.enter('pull'):
      return None
    pulled = yield Get(self.replies[m])
    if pulled is not common.STOP and getattr(s, 'awaiting_rejoin', False) and not pulled.rejoin:
      # The server's reply to a push made before the loss, sent once the new lane was up:
      # the answer to the `Rejoin` follows and supersedes it (the server checks a push
      # against the last pull it sent).
      return STALE
    s.awaiting_rejoin = False
    return pulled

  def _worker(self, m: int, s: LoopState):
    device = self.devices[1 + m]
    while not s.failed:
      pulled = yield from self._pull(m, s)
      if pulled is common.STOP:
        return
      if pulled is STALE:
        continue
      if pulled is not None:
        if self.log.has_failed(m):
          s.failed = True
          break
        s.pulled = pulled
        s.batch = transfer.for_task(next(self.streams[m]), device)
      if s.enter('forward'):
        variables = stage_functions.with_state(s.pulled.params, s.pulled.state)
        s.forward = yield Compute(
          transfer.HostInputs(self.ops.forward),  # the host batch goes in with the call
          (variables, s.batch['image'], s.batch['label']),
          kind='forward',
          stage=0,
          batch=s.k,
        )
        s.batch = None
      if s.enter('backward'):
        _, loss, new_state, vjp = s.forward
        grads, _ = yield Compute(
          self.ops.backward, (vjp, None), kind='backward', stage=0, batch=s.k
        )
        s.forward = None
        if self.log.has_failed(m):  # Its pushes stop at its failure time.
          s.failed = True
          break
        self.log.pushed(m)
        s.push = Push(m, s.pulled.version, s.k, grads, loss, new_state)
      if s.enter('push'):
        yield Send(self.inbox, s.push, batch=s.k)
        s.k, s.push = s.k + 1, None
    if s.enter('failed'):
      yield Put(self.inbox, WorkerFailed(m))

  # --- checkpoints --------------------------------------------------------------------------------
  def snapshot(self) -> dict:
    """What a checkpoint saves of the session besides its processes (`algorithms.resume`)."""
    return {
      'server': self.server.store.snapshot(),
      'pulled': list(self.server._pulled),  # pylint: disable=protected-access
      'model_state': self.model_state.snapshot(),
      'steps': self.steps.snapshot(),
      'log': self.log.snapshot(),
    }

  def load(self, saved: dict) -> None:
    self.server.store.load(saved['server'])
    self.server._pulled = list(saved['pulled'])  # pylint: disable=protected-access
    self.model_state.load(saved['model_state'])
    self.steps.load(saved['steps'])
    self.log.load(saved['log'])

  def _rejoin(self, m: int, worker: Process, reason: str) -> LoopState:
    """Worker m's lane was replaced by a new lane process (`ProcessExecutor`): it starts
    again from its next batch by asking the server for the current parameters (a
    gradient it was computing is dropped, never applied); past the last step, it ends."""
    del reason
    k = worker.state.k if worker.state is not None else 0
    go_on = not self.steps.done
    return LoopState(k=k, failed=not go_on, rejoining=go_on, awaiting_rejoin=go_on)

  def _lost(self, m: int, reason: str):
    """Worker m's lane was lost (`ProcessExecutor(tolerate_lost=True)`): the server goes
    on with the others, as after a failure (`cost.failures`)."""
    self.log.lose(m, reason)
    yield Put(self.inbox, WorkerFailed(m))

  # --- what the run reports ----------------------------------------------------------------------
  def variables(self):
    fetch = self.fetch  # values in lane processes come to the driver (`Executor.fetch`)
    return {
      'params': fetch(self.server.store.read().value.params),
      **fetch(self.model_state.read().value),
    }

  def staleness(self) -> dict[str, np.ndarray]:
    lanes = {1 + m: f'worker {m}' for m in range(self.num_workers)}
    return common.staleness_by_lane(self.server.store, lanes)

  def metrics(self) -> dict:
    return {
      **common.staleness_metrics(self.staleness(), 'worker'),
      'failed_workers': len(self.log.failed),
      'lost_workers': len(self.log.lost),
    }
