r"""LPP-SGD: Hogwild! workers sharing a replica per device; replicas averaged across devices.

The baseline of PD-ASGD ("Hogwild! scaled on multiple devices", Teguemne Fokam
et al. 2024). D = `algorithm.devices` replicas w_d; W = `algorithm.workers_per_device`
Hogwild! workers share each one. Worker (d, j) repeats, on its own batch stream:

    v, w = replica_d.read()                    # at its task's start
    g = ∇L(w; ξ)                               # forward + backward tasks
    replica_d ← replica_d − η g                # full step, or
    replica_d ← replica_d − η (g ⊙ 1_{P_j})    # partitioned step: only its own slice P_j
                                               # changes (its optimizer state too)

applied at one instant at the end of its task, to the replica as it is *then*
(a read-modify-write under a per-replica lock on the real clock, so no update is
lost; the staleness is the number of writes to the replica since `v`; with every
lane an OS process of its own, a named task on the replica's lane in the replica's
turn: see `LppSession`). The flat parameter vector is cut into W contiguous slices
P_0..P_{W−1}. During the first `algorithm.warmup_steps` steps every step is full;
afterwards each worker alternates full and partitioned steps.

Averaging (non-blocking, keep-local merge): once `algorithm.averaging_freq`
updates of replica d have been applied since its last snapshot (every update
during the first and the last `warmup_steps` steps of the run, the paper's
"first and last epochs") and its previous round has been merged, replica d
sends a snapshot s_d to the averaging collective and its workers go on. Round r
averages the D snapshots of round r, w̄ = mean_d s_d (an `average` task whose
simulated duration is a ring all-reduce of the parameter bytes:
2 (D − 1) (link_latency + bytes / (D · link_bandwidth))), and each replica merges

    w_d ← w̄ + (w_d − s_d)

i.e. the average replaces the snapshot and the updates the device made while
the collective ran are kept (DaSGD's keep-local merge). Plain replacement
w_d ← w̄ would discard those updates; with a zero-time collective both are the
same (w_d = s_d). Only parameters are averaged: the optimizer state and any
BatchNorm statistics stay per replica. Evaluation uses the mean of the replicas.

Elastic workers (`LppSettings.replica_lanes`: lane processes with
`tolerate_lost_workers`): a worker or a replica whose lane process dies or raises is
replaced by a new lane process and goes on (`ProcessExecutor`, lost workers). Each
replica then lives on a lane of its own (`replica d`) with its *updater*, the one
process that computes there: workers send their gradients (copied whole, or not at all)
as requests, and the updater applies them in the order they land, answers each worker
with its step, joins averaging rounds (its snapshot copied whole to the averaging lane)
and merges their means. A replaced worker begins the step it was computing or awaiting
again on its next batch (a request that had landed is applied). A replaced replica is
healed from a live peer: it takes that replica's parameters and optimizer state, the
requests its lost lane held are answered as lost (their workers go on) and a merge of a
snapshot taken before the healing is dropped. With one replica there is no peer: its
loss ends the run (with checkpoints, the same command resumes it). BatchNorm statistics
live in the workers' lanes, so a model with any is refused.

The W workers of a device time-share it: each worker lane runs at 1/W of the
device's speed (`cost.speeds` / W), so a device's throughput does not
grow with W; Hogwild! buys asynchrony, not FLOPs.

References:
  C. Teguemne Fokam, K. K. Nazeer, L. König, D. Kappel, A. Subramoney.
  Asynchronous Stochastic Gradient Descent with Decoupled Backpropagation and
  Layer-Wise Updates. 2024. arXiv:2410.05985 (the LPP-SGD baseline).
  B. Recht, C. Re, S. Wright, F. Niu. Hogwild!. NeurIPS 2011. arXiv:1106.5730.
  Q. Zhou et al. DaSGD: Squeezing SGD Parallelization Performance in Distributed
  Training Using Delayed Averaging. 2020. arXiv:2006.00441 (the keep-local merge).
"""

import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsgd import optimizers
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.asynchronous import common
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.lanes import LaneError
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Put, Send
from jaxsgd.pipeline.session import PlacedStages, sequential_roles
from jaxsgd.scheduler.store import VersionedStore
from jaxsgd.scheduler.tasks import Task, TaskRecipe
from jaxsgd.spmd import timing


LOST = 'lost'  # the answer to an update request that a replica's lost lane took with it


class _Update(NamedTuple):
  """Worker `worker`'s gradient of its step `k`, computed at replica version `version`
  (elastic: a request to the replica's updater)."""

  worker: int
  k: int
  grads: Any
  version: int
  partitioned: bool
  loss: Any


class _Merge(NamedTuple):
  """Round `round`'s mean for a replica (elastic), with the replica's snapshot `sent`
  taken at its healing `generation`."""

  round: int
  generation: int
  sent: Any
  mean: Any


@dataclasses.dataclass(frozen=True)
class LppSettings:
  devices: int = 2
  workers_per_device: int = 2
  warmup_steps: int = 0
  averaging_freq: int = 4
  replica_lanes: bool = False  # elastic workers: each replica on a lane of its own

  @property
  def num_workers(self) -> int:
    return self.devices * self.workers_per_device

  @property
  def lane_names(self) -> list[str]:
    """The session's lanes, in order: worker j of replica d (`worker d.j`, placement
    name `workerd.j`), with `replica_lanes` replica d's (`replica d`), then the averaging
    collective's (none with one replica)."""
    W = self.workers_per_device
    workers = [f'worker {m // W}.{m % W}' for m in range(self.num_workers)]
    replicas = [f'replica {d}' for d in range(self.devices)] if self.replica_lanes else []
    return workers + replicas + (['allreduce'] if self.devices > 1 else [])


def partition_masks(params, parts: int) -> list:
  """`parts` boolean pytrees like `params`: contiguous slices of the flat vector."""
  leaves, treedef = jax.tree.flatten(params)
  sizes = [int(np.prod(leaf.shape)) for leaf in leaves]
  offsets = np.cumsum([0] + sizes[:-1])
  bounds = np.linspace(0, sum(sizes), parts + 1).astype(np.int64)
  masks = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    flat = [np.arange(o, o + n) for o, n in zip(offsets, sizes)]
    masks.append(
      treedef.unflatten(
        [((i >= lo) & (i < hi)).reshape(leaf.shape) for i, leaf in zip(flat, leaves)]
      )
    )
  return masks


def make_masked_update(update, init):
  """`(params, opt_state, grads, mask) -> (params, opt_state)`: a partitioned step.

  The full step `update` runs on the masked gradient g ⊙ 1_P, and its result is kept on
  the masked coordinates P only. Outside P nothing changes: neither the parameters nor
  any per-parameter optimizer state (momentum, Adam's moments: every tree in `opt_state`
  shaped like the parameters, found from `init` — the optimizer or its `init` — by
  `optax.tree_utils.tree_map_params`). Keeping only the parameters would let the moments
  outside P decay towards the zero gradient while the parameters stay, so a later step
  there would move by a shrunken momentum.

  State that is not per-parameter takes the update's value: a global step counter (Adam's
  `count`, a schedule's) advances on every step, partitioned or full. It counts the
  updates applied to the replica, which the learning-rate schedule spans; one scalar
  cannot also count each slice's own steps. So a coordinate that sat out k of the t
  steps is bias-corrected by Adam with 1 − β^t, not 1 − β^(t−k): a difference that
  vanishes as t grows. An optimizer whose state is not shaped like the parameters
  (adafactor's factored moments) is refused when the step is traced.

  `update` runs as its own (jitted) program, not inlined into one with the masking: the
  same compiled code as the full step's, so with one slice (P = everything) a
  partitioned step is the full step bit for bit; XLA would fuse one combined program
  differently, which changes the last bits.
  """

  def slice_of(state, mask):
    if state.shape != mask.shape:
      raise ValueError(
        f'LPP-SGD partitioned step: optimizer state of shape {state.shape} '
        f'for a parameter of shape {mask.shape}; the optimizer must keep '
        'per-parameter state (not factored, as adafactor does).'
      )
    return mask

  @jax.jit
  def mask_grads(grads, mask):
    return jax.tree.map(lambda g, m: jnp.where(m, g, jnp.zeros_like(g)), grads, mask)

  @jax.jit
  def keep_slice(params, opt_state, new_params, new_state, mask):
    state_mask = optax.tree_utils.tree_map_params(
      init, slice_of, new_state, mask, transform_non_params=lambda _: True
    )
    return (
      jax.tree.map(jnp.where, mask, new_params, params),
      jax.tree.map(jnp.where, state_mask, new_state, opt_state),
    )

  def masked_update(params, opt_state, grads, mask):
    new_params, new_state = update(params, opt_state, mask_grads(grads, mask))
    return keep_slice(params, opt_state, new_params, new_state, mask)

  return masked_update


def partitioned_steps(update, tx, parts: int) -> list:
  """`parts` functions `(params, opt_state, grads) -> (params, opt_state)`: the
  partitioned step on each slice (`make_masked_update` of `update`, the full step under
  `tx`; each mask made from the parameters' shapes, once per shape and device). Named
  tasks when `update` is one (the stage's named update): a lane that owns a replica
  then builds them from the same settings.

  With one slice (W = 1) the slice is the whole parameter vector and the partitioned
  step is the full step itself, `update`: the masks would select every coordinate, at
  the cost of two more passes over the parameters and the optimizer state (a masked
  step took ~3× a full step's time in lanes, MLP 1024, SGD)."""
  if parts == 1:
    return [update]
  if isinstance(update, Task):
    return [
      Task(
        TaskRecipe.of(partitioned_step_tasks, update=update, part=j, parts=parts),
        'partitioned_update',
      )
      for j in range(parts)
    ]
  masked = make_masked_update(update, tx)
  return [_on_slice(masked, j, parts) for j in range(parts)]


def partitioned_step_tasks(*, update: Task, part: int, parts: int) -> dict:
  """`{'partitioned_update': ...}` of `partitioned_steps` (a `TaskRecipe` factory)."""
  return {'partitioned_update': _on_slice(_masked_update_of(update), part, parts)}


@functools.lru_cache(maxsize=None)
def _masked_update_of(update: Task):
  """The named `update` masked (one per process), its optimizer rebuilt from the settings
  of the update's recipe (`pipeline.session.stage_tasks`: `optimizer`, `total_steps`)."""
  settings = dict(update.recipe.kwargs)
  return make_masked_update(
    update, optimizers.make_optimizer(settings['optimizer'], settings['total_steps'])
  )


def _on_slice(masked_update, part: int, parts: int):
  masks = {}

  def step(params, opt_state, grads):
    leaves = jax.tree.leaves(params)
    # A traced step (`jax.eval_shape`: an emulated lane's outputs) has no device to put
    # its mask on, nor one on host arrays (a CPU lane's copies): the mask goes in as it is.
    concrete = isinstance(leaves[0], jax.Array) and not isinstance(leaves[0], jax.core.Tracer)
    device = next(iter(leaves[0].devices())) if concrete else None
    key = (jax.tree.structure(params), tuple(np.shape(leaf) for leaf in leaves), device)
    if key not in masks:
      mask = partition_masks(params, parts)[part]
      masks[key] = mask if device is None else jax.device_put(mask, device)
    return masked_update(params, opt_state, grads, masks[key])

  return step


def averaging_tasks() -> dict:
  """`{'mean': _mean, 'merge': keep_local_merge}`: the averaging as named tasks (a
  `TaskRecipe` factory) for lanes in processes of their own."""
  return {'mean': _mean, 'merge': keep_local_merge}


AVERAGING = TaskRecipe.of(averaging_tasks)


@jax.jit
def _mean(trees):
  return jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs) / len(xs), *trees)


@jax.jit
def keep_local_merge(params, sent, mean):
  """w̄ + (w − s): the average replaces the snapshot; later local updates stay."""
  return jax.tree.map(lambda w, s, a: a + (w - s), params, sent, mean)


def averaging_calls(params, num_replicas: int) -> dict:
  """The lane-process form's averaging tasks on `params`, as a cost profile times them:
  `(0, 'average')` the mean of `num_replicas` snapshots, `(0, 'merge')` one keep-local
  merge, each argument a copy of its own (one buffer passed D times would be read from
  cache, not memory). Timed, not priced as an update: their reads and writes differ."""
  copy = lambda: jax.tree.map(jnp.copy, params)
  return {
    (0, 'average'): (_mean, ([copy() for _ in range(num_replicas)],)),
    (0, 'merge'): (keep_local_merge, (copy(), copy(), copy())),
  }


def allreduce_time(nbytes: int, num_devices: int, *, bandwidth: float, latency: float) -> float:
  """Seconds of a ring all-reduce of `nbytes` per device over links of `bandwidth`
  bytes/s (`inf`: free) and `latency` seconds (the SPMD time model's formula)."""
  return timing.ring_allreduce_time(nbytes, num_devices, bandwidth=bandwidth, latency=latency)


class LppSession:
  """One run: worker (d, j) on lane d·W + j, the averaging collective on the last lane.

  With lanes in processes of their own (`lane_processes`, `executor='processes'`),
  replica d lives in the process of worker (d, 0), lane d·W: the lane of the device
  that holds the replica in one process. There its worker's tasks and the replica's
  updates share one queue, as a device's do, and with one worker per device (W = 1)
  the replica never moves to be read or updated. Each update — full or partitioned —
  and each keep-local merge is a `Compute` of a named task on that lane, holding the
  replica's turn from its read to its write (`SharedParams.update_on`/`replace_on`), so
  concurrent updates queue instead of being lost; a step is claimed before its update
  (`StepCounter.claim`), so no more than `train_steps` updates are applied. The mean of
  a round's snapshots is a named task on the averaging lane (`AVERAGING`). Values are
  not copied by the policy: the executor moves a lane's value to the lane that uses it.

  Args:
    pipeline: the model as one stage (its jitted forward, backward and update).
    settings: D, W, warm-up and averaging frequency.
    variables: the initial variables (every replica starts from them).
    opt_state: the optimizer's initial state.
    streams: one host batch iterator per worker (D·W).
    devices: the device of each replica (D).
    steps: a `StepCounter`; log: failures and pushes.
    lane_processes: every lane is an OS process of its own (see above; the pipeline's
      ops must be named tasks).
  """

  def __init__(
    self,
    pipeline: PlacedStages,
    settings: LppSettings,
    variables,
    opt_state,
    streams: Sequence[Iterator[dict]],
    devices: Sequence[jax.Device],
    steps: common.StepCounter,
    log: common.WorkerLog,
    *,
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
    self.lane_processes = lane_processes
    self.fetch = lambda value: value  # values for the driver (`Executor.fetch`)
    self.ops = pipeline.ops(0, sequential_roles(1)[0])
    self.masked_update = make_masked_update(self.ops.update, pipeline.tx)
    params, state = stages_lib.split_variables(variables)
    D, W = settings.devices, settings.workers_per_device
    self.partitioned = partitioned_steps(self.ops.update, pipeline.tx, W)
    self.replicas = [
      common.SharedParams(
        f'replica {d}',
        transfer.to_device(params, devices[d]),
        transfer.to_device(opt_state, devices[d]),
      )
      for d in range(D)
    ]
    self.states = [
      VersionedStore(f'model state {d}', transfer.to_device(state, devices[d])) for d in range(D)
    ]
    self.cluster = Cluster()
    names = settings.lane_names
    for m in range(D * W):
      self.cluster.add_lane(f'{names[m]} ({devices[m // W]})', devices[m // W])
    self.elastic = settings.replica_lanes
    if self.elastic:  # (module docstring: elastic workers)
      for d in range(D):  # lanes D·W .. D·W + D − 1 (`home`)
        self.cluster.add_lane(f'{names[D * W + d]} ({devices[d]})', devices[d])
      self.requests = [
        self.cluster.channel(f'requests to replica {d}', self.home(d)) for d in range(D)
      ]
      self.answers = [
        self.cluster.channel(f'answers to worker {m // W}.{m % W}', m) for m in range(D * W)
      ]
    # The averaging collective's lane (none with one replica: nothing to average).
    self.allreduce_lane = self.cluster.add_lane(names[-1]) if D > 1 else None
    self.rounds = [
      self.cluster.channel(f'snapshots of replica {d}', self.allreduce_lane)
      for d in range(D if D > 1 else 0)
    ]
    if lane_processes:
      self._declare_tasks()
    self.generation = [0] * D  # replica d healed this many times (elastic: `_heal`)
    self.outstanding: dict[int, int] = {}  # worker -> the step (its k) it awaits an answer for
    self.device_updates = [0] * D  # updates applied to each replica
    self.last_snapshot = [0] * D  # ... when it last joined a round
    self.in_flight = [False] * D  # its round is not merged yet
    self.alive = [W] * D
    self.active = set(range(D))  # replicas with live workers (evaluated, averaged)
    self.averaged_rounds = 0
    self._lock = threading.Lock()

  def processes(self) -> list[Process]:
    """The workers and the averaging, resumable (their loop variables are `LoopState`s)."""
    W = self.settings.workers_per_device
    workers = [
      Process.resumable(
        f'worker {m // W}.{m % W}',
        m,
        functools.partial(self._worker, m // W, m % W),
        LoopState(k=0, stopping=False, failed=False, last=False, due=False),
      )
      for m in range(self.settings.num_workers)
    ]
    for m, worker in enumerate(workers if self.elastic else ()):
      worker.on_rejoin = functools.partial(self._rejoin, m, worker)
      worker.on_lost = functools.partial(common.lost_for_good, 'lppsgd', worker.name)
    for d in range(self.settings.devices if self.elastic else 0):
      updater = Process.resumable(
        f'replica {d}', self.home(d), self._updater, LoopState(d=d, lost=[])
      )
      if self.settings.devices > 1:  # healed from a live peer if its lane is lost
        updater.on_rejoin = functools.partial(self._heal, d, updater)
        updater.on_lost = functools.partial(common.lost_for_good, 'lppsgd', updater.name)
      workers.append(updater)
    if self.settings.devices > 1:
      averaging = LoopState(taking=list(range(self.settings.devices)), r=-1, asking=[], void=False)
      workers.append(Process.resumable('averaging', self.allreduce_lane, self._averager, averaging))
    return workers

  # --- the processes ----------------------------------------------------------------------------
  # Their variables live in `s` and their steps are phases (`LoopState.enter`; a phase with a
  # yield builds its op from `s` alone), so that a checkpoint saves where each one is. With
  # lanes in processes (the real clock) nothing is checkpointed: the turn-taking updates
  # there are one phase.
  def _worker(self, d: int, j: int, s: LoopState):
    m = d * self.settings.workers_per_device + j
    replica, name = self.replicas[d], f'worker {d}.{j}'
    while not s.stopping:
      if s.enter('read'):
        if self.steps.done or self.log.has_failed(m):
          s.failed, s.stopping = not self.steps.done, True
          break
        snapshot = replica.read()
        s.version = snapshot.version
        s.batch = transfer.to_device(next(self.streams[m]), self.devices[d])
        s.variables = stages_lib.with_state(snapshot.value.params, self.states[d].read().value)
      if s.enter('forward'):
        s.forward = yield Compute(
          self.ops.forward,
          (s.variables, s.batch['image'], s.batch['label']),
          kind='forward',
          stage=0,
          batch=s.k,
        )
        s.variables = s.batch = None
      if s.enter('backward'):
        _, loss, new_state, vjp = s.forward
        s.grads, _ = yield Compute(
          self.ops.backward, (vjp, None), kind='backward', stage=0, batch=s.k
        )
        s.loss, s.new_state, s.forward = loss, new_state, None
        if self.log.has_failed(m):
          s.failed = s.stopping = True
          break
        s.partitioned = s.k % 2 == 1 and self.steps.applied >= self.settings.warmup_steps
      if self.elastic:  # the replica's updater applies it (`_updater`)
        if s.enter('request'):
          self.outstanding[m] = s.k
          request = _Update(m, s.k, s.grads, s.version, s.partitioned, s.loss)
          yield Send(self.requests[d], request, batch=s.k)
          s.grads = s.loss = None
        while s.enter('answer'):
          k, s.step = yield Get(self.answers[m])
          if k == s.k:  # (an answer to a request made before its lane was replaced: dropped)
            break
      elif self.lane_processes:
        if s.enter('update on lane'):
          if not self.steps.claim():  # every step is taken
            s.stopping = True
            break
          claimed = self.steps.claimed - 1  # this update's step (0-based), its label
          update = self.partitioned[j] if s.partitioned else self.ops.update
          yield from replica.update_on(
            self.home(d), update, s.grads, read_version=s.version, lane=m, batch=claimed
          )
          self._updated(d, m, s.new_state)
          s.step = self.steps.commit(None, s.loss, name)
      elif s.enter('commit'):
        s.step = self.steps.commit(
          functools.partial(self._apply, d, m, s.grads, s.version, s.new_state, s.partitioned),
          s.loss,
          name,
        )
      if s.enter('committed'):
        s.grads = s.new_state = s.loss = None
        if s.step is None:
          s.stopping = True
          break
        s.due = not self.elastic and self._snapshot_due(d, s.step)  # (elastic: `_updater`)
        s.snapshot = replica.read().value.params if s.due else None
      if s.due and s.enter('snapshot'):
        yield Put(self.rounds[d], s.snapshot)
      if s.enter('next'):
        s.k, s.due, s.snapshot = s.k + 1, False, None
    yield from self._leave(d, s)

  def _declare_tasks(self) -> None:
    """Lanes in processes: what each lane will run, built in every lane as the run begins
    (`Cluster.declare_tasks`): a worker's forward and backward; on the lane that owns a
    replica (`home`) its full and partitioned steps and, with several replicas, the merge
    of an averaging round, whose mean the averaging lane computes."""
    D, W = self.settings.devices, self.settings.workers_per_device
    for m in range(D * W):
      self.cluster.declare_tasks(m, [self.ops.forward, self.ops.backward])
    merge = [Task(AVERAGING, 'merge')] if D > 1 else []
    updates = list(dict.fromkeys([self.ops.update, *self.partitioned]))
    for d in range(D):
      self.cluster.declare_tasks(self.home(d), [*updates, *merge])
    if D > 1:
      self.cluster.declare_tasks(self.allreduce_lane, [Task(AVERAGING, 'mean')])

  def home(self, d: int) -> int:
    """The lane that owns replica d with lanes in processes: its own (elastic), else
    worker (d, 0)'s."""
    if self.settings.replica_lanes:
      return self.settings.num_workers + d
    return d * self.settings.workers_per_device

  def _rejoin(self, m: int, worker: Process, reason: str) -> LoopState | None:
    """Worker m's lane was replaced: a step it was computing (in the lost lane) or whose
    answer it awaited is begun again on its next batch (a request that had landed is
    applied; its answer, to an earlier step, is dropped); otherwise it holds nothing of
    the lost lane and goes on."""
    del reason
    s = worker.state
    if s.phase in ('read', 'forward', 'backward', 'request', 'answer'):
      return LoopState(k=s.k + 1, stopping=False, failed=False, last=False, due=False)
    return None

  def _updater(self, s: LoopState):
    """Replica d's updater (elastic), on its lane: applies its workers' updates in the
    order they land, each at the replica as it is then (the step claimed and counted
    here) and answers the worker; joins an averaging round when one is due (its snapshot
    copied whole to the averaging lane) and merges the rounds' means. Merges meant for
    the replica before it was healed are dropped."""
    d, W = s.d, self.settings.workers_per_device
    replica = self.replicas[d]
    while s.lost:  # healed (`_heal`): the requests its lost lane took with it
      if s.enter('lost'):
        m, k = s.lost[0]
        yield Put(self.answers[m], (k, LOST))
        s.lost = s.lost[1:]
    while True:
      if s.enter('get'):
        s.request = yield Get(self.requests[d])
        if s.request is common.STOP:
          return
      r = s.request
      if isinstance(r, _Merge):
        if r.generation == self.generation[d] and s.enter('merge'):
          yield from replica.replace_alone(
            self.home(d), Task(AVERAGING, 'merge'), r.sent, r.mean, kind='merge', batch=r.round
          )
          self.in_flight[d] = False
        continue
      if s.enter('claim'):
        s.step, s.due = None, False
        s.claimed = self.steps.claim()  # False once every step is taken: the worker stops
        s.label = self.steps.claimed - 1  # this update's step (0-based), its label
      if s.claimed and s.enter('update'):
        update = self.partitioned[r.worker % W] if r.partitioned else self.ops.update
        yield from replica.update_alone(
          self.home(d), update, r.grads, read_version=r.version, lane=r.worker, batch=s.label
        )
        self._updated(d, r.worker, None)
        s.step = self.steps.commit(None, r.loss, f'worker {d}.{r.worker % W}')
        s.due = s.step is not None and self._snapshot_due(d, s.step)
      if s.enter('answer'):
        if self.outstanding.get(r.worker) == r.k:
          del self.outstanding[r.worker]
        yield Put(self.answers[r.worker], (r.k, s.step))
      if s.due and s.enter('snapshot'):  # landed whole on the averaging lane, or never
        snapshot = (self.generation[d], replica.read().value.params)
        yield Send(self.rounds[d], snapshot, batch=s.step)
        s.due = False

  def _heal(self, d: int, updater: Process, reason: str) -> LoopState:
    """Replica d's lane was replaced (elastic): the replica starts again from a live
    peer's parameters and optimizer state (as a lost replica is healed from a live peer);
    the requests its lost lane took with it are answered as lost (their workers go on to
    their next batch), and a step claimed for an update lost with it is given back; its
    averaging round, if one was in flight, is void."""
    del reason
    lost_update = updater.state
    if lost_update.phase == 'update' and lost_update.claimed and lost_update.step is None:
      self.steps.release()
    peers = [e for e in sorted(self.active) if e != d]
    if not peers:
      raise common.WorkersFailedError(
        f'lppsgd: replica {d} was lost and no replica with live workers is left to heal it.'
      )
    self.replicas[d].store.write(self.replicas[peers[0]].read().value)
    self.generation[d] += 1
    self.in_flight[d] = False
    W = self.settings.workers_per_device
    lost = sorted((m, k) for m, k in self.outstanding.items() if m // W == d)
    for m, _ in lost:
      del self.outstanding[m]
    return LoopState(d=d, lost=lost)

  def _apply(self, d, m, grads, read_version, new_state, partitioned):
    W = self.settings.workers_per_device
    update = self.partitioned[m % W] if partitioned else self.ops.update
    self.replicas[d].apply(
      update, grads, read_version=read_version, lane=m, batch=self.steps.applied
    )
    self._updated(d, m, new_state)

  def _updated(self, d, m, new_state):
    if new_state:
      self.states[d].write(new_state)
    self.device_updates[d] += 1
    self.log.pushed(m)

  def _snapshot_due(self, d: int, step: int) -> bool:
    """Whether replica d joins the next averaging round now (then it is in flight).

    At most one round per replica is in flight: a snapshot taken before the
    previous round's merge landed would count that merge twice in w̄ + (w − s).
    """
    settings = self.settings
    if settings.devices < 2 or step >= self.steps.steps:
      return False
    dense = step <= settings.warmup_steps or step > self.steps.steps - settings.warmup_steps
    with self._lock:
      since = self.device_updates[d] - self.last_snapshot[d]
      if self.in_flight[d] or not (dense or since >= settings.averaging_freq):
        return False
      self.in_flight[d], self.last_snapshot[d] = True, self.device_updates[d]
      return True

  def _leave(self, d: int, s: LoopState):
    """The last worker of a device to stop ends its part in the averaging."""
    if s.enter('leave'):
      with self._lock:
        self.alive[d] -= 1
        s.last = self.alive[d] == 0
        if s.last and s.failed:
          self.active.discard(d)
    if s.last and self.settings.devices > 1 and s.enter('stop'):
      yield Put(self.rounds[d], common.STOP)
    if s.last and self.elastic and s.enter('stop updater'):
      yield Put(self.requests[d], common.STOP)  # its workers all had their answers

  def _averager(self, s: LoopState):
    while True:
      if s.enter('round'):
        s.r, s.sent, s.asking = s.r + 1, {}, list(s.taking)
      while s.asking:
        if s.enter('get'):
          message = yield Get(self.rounds[s.asking[0]])
          d = s.asking.pop(0)
          if message is common.STOP:
            s.taking.remove(d)
          else:
            s.sent[d] = message
      if s.enter('gathered'):
        if len(s.taking) < 2:
          return
        s.void = len(s.sent) < 2
        if s.void:  # A replica left: the other's round is void.
          self.in_flight = [False] * self.settings.devices
      if s.void:
        continue
      if self.lane_processes:
        if s.enter('average on lanes'):
          merged = yield from self._average_on_lanes(s.sent, s.r)
          if not merged:
            return
          self.averaged_rounds += 1
      elif s.enter('average'):
        means = yield Compute(self._allreduce, (s.sent,), kind='average', stage=0, batch=s.r)
        if self.steps.done:
          return
        for d, mean in means.items():
          self.replicas[d].replace_params(keep_local_merge, s.sent[d], mean)
          self.in_flight[d] = False
        self.averaged_rounds += 1

  def _average_on_lanes(self, sent: dict, r: int):
    """Lanes in processes: the mean on the averaging lane, each merge on the replica's
    lane in the replica's turn. Returns False if the run ended meanwhile.

    The mean is waited for (`ahead=False`) before any replica's turn is taken: running
    ahead, the merge was queued on a replica's lane, holding its turn, while the mean
    still waited for the other replica's snapshot, queued behind that lane's forward and
    backward, and the first replica's worker stood idle (0.13-0.19 s per round in a
    trace of `benchmarks/simulator_accuracy.py`, MLP 1024, batch 1024)."""
    # Elastic: each snapshot is `(generation, params)` (`_updater`), merged only into the
    # replica it was taken of (not into one healed since).
    snapshots = {d: value[1] for d, value in sent.items()} if self.elastic else sent
    mean = yield Compute(
      Task(AVERAGING, 'mean'),
      (list(snapshots.values()),),
      kind='average',
      stage=0,
      batch=r,
      ahead=False,
    )
    if self.steps.done:
      return False
    for d in sent:
      if self.elastic:  # the replica's updater merges it, in its order of requests
        yield Put(self.requests[d], _Merge(r, sent[d][0], snapshots[d], mean))
        continue
      yield from self.replicas[d].replace_on(
        self.home(d), Task(AVERAGING, 'merge'), sent[d], mean, kind='merge', batch=r
      )
      self.in_flight[d] = False
    return True

  def _allreduce(self, sent: dict) -> dict:
    """The mean of the snapshots, on every participating replica's device."""
    home = self.devices[min(sent)]
    mean = _mean([transfer.to_device(s, home) for s in sent.values()])
    return {d: transfer.to_device(mean, self.devices[d]) for d in sent}

  # --- checkpoints --------------------------------------------------------------------------------
  def snapshot(self) -> dict:
    """What a checkpoint saves of the session besides its processes (`algorithms.resume`)."""
    return {
      'replicas': [replica.store.snapshot() for replica in self.replicas],
      'states': [state.snapshot() for state in self.states],
      'device_updates': list(self.device_updates),
      'last_snapshot': list(self.last_snapshot),
      'in_flight': list(self.in_flight),
      'alive': list(self.alive),
      'active': sorted(self.active),
      'averaged_rounds': self.averaged_rounds,
      'steps': self.steps.snapshot(),
      'log': self.log.snapshot(),
      'generation': list(self.generation),
      'outstanding': sorted(self.outstanding.items()),
    }

  def load(self, saved: dict) -> None:
    if self.elastic:
      self.generation = list(saved['generation'])
      self.outstanding = dict(map(tuple, saved['outstanding']))
    for replica, value in zip(self.replicas, saved['replicas']):
      replica.store.load(value)
    for state, value in zip(self.states, saved['states']):
      state.load(value)
    self.device_updates, self.last_snapshot = saved['device_updates'], saved['last_snapshot']
    self.in_flight, self.alive = saved['in_flight'], saved['alive']
    self.active, self.averaged_rounds = set(saved['active']), saved['averaged_rounds']
    self.steps.load(saved['steps'])
    self.log.load(saved['log'])

  # --- what the run reports -----------------------------------------------------------------------
  def variables(self):
    """The mean of the replicas that still have workers (all, if none has)."""
    devices = sorted(self.active) or list(range(self.settings.devices))
    home, fetch = self.devices[devices[0]], self.fetch
    params = []
    for d in devices:
      try:
        params.append(transfer.to_device(fetch(self.replicas[d].read().value.params), home))
      except LaneError:
        if not self.elastic or d == devices[-1] and not params:
          raise
        # Its lane was lost a moment ago: the executor heals it when it hears of the loss
        # (`_heal`); this evaluation averages the others.
        logging.warning('lppsgd: replica %d left out of this evaluation (its lane was lost).', d)
    mean = params[0] if len(params) == 1 else _mean(params)
    return {'params': mean, **transfer.to_device(fetch(self.states[devices[0]].read().value), home)}

  def staleness(self) -> dict[str, np.ndarray]:
    W, result = self.settings.workers_per_device, {}
    for d, replica in enumerate(self.replicas):
      result.update(
        common.staleness_by_lane(replica.store, {d * W + j: f'worker {d}.{j}' for j in range(W)})
      )
    return result

  def metrics(self) -> dict:
    return {
      **common.staleness_metrics(self.staleness(), 'worker'),
      'averaging_rounds': self.averaged_rounds,
      'failed_workers': len(self.log.failed),
    }
