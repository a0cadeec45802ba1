"""What the asynchronous algorithms share: lanes, worker speeds and failures, reporting.

Every asynchronous policy (ASGD/DC-ASGD, LPP-SGD, PD-ASGD) is a set of scheduler
processes on the lanes of a `Cluster` (see `jaxsgd.scheduler`). This module holds
the pieces they have in common:

- `fold_update` / `backward_forward_ratio`: views of a measured cost table;
- `copy`: a value moved to another lane's device (a costed transfer task or inline);
- `SharedParams`: a `VersionedStore` of `(params, opt_state)` whose optimizer
  updates are read-modify-writes at one instant (under a lock on the real clock),
  so concurrent workers never lose an update;
- `StepCounter` / `run_reporter`: count the applied steps (exactly
  `train_steps`), report them to the `Run` and say when the run is done;
  `WorkerLog`: failures (`cost.failures`) and push times;
- `staleness_by_lane` / `staleness_metrics`: what a session reports.

The config glue (settings, executors, the summary) is in `jaxsgd.algorithms.workers`.
"""

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Channel, Cluster, Compute, Get, LoopState, Put
from jaxsgd.scheduler.costs import TRANSFER
from jaxsgd.pipeline.session import StageParams
from jaxsgd.scheduler.store import VersionedStore


class _Stop:
  def __repr__(self):
    return 'STOP'

  def __reduce__(self):
    return 'STOP'  # Pickled by name: a checkpoint's STOP is this one.


STOP = _Stop()  # The message that ends a process waiting on a channel.
_TURN = 'turn'  # The token of a shared store's turn to update (`SharedParams.update_on`).


class WorkersFailedError(RuntimeError):
  """Every worker of a role failed: the run cannot reach `train_steps`."""


def fold_update(table: dict, num_stages: int) -> dict:
  """Adds each stage's update time to its backward task (the update is applied at
  one instant at the task's end, so the task must pay for it)."""
  folded = dict(table)
  for k in range(num_stages):
    folded[(k, 'backward')] = table[(k, 'backward')] + table[(k, 'update')]
  return folded


def backward_forward_ratio(table: dict) -> float:
  """Total backward time over total forward time of a measured (or given) table."""
  forward = sum(v for (_, kind), v in table.items() if kind == 'forward')
  backward = sum(v for (_, kind), v in table.items() if kind == 'backward')
  return backward / forward if forward else math.nan


def share_devices(cluster: Cluster, lane_to_device) -> None:
  """Lane i of `cluster` runs on simulated device `lane_to_device[i]`: lanes mapped to one
  device share it, so the virtual clock runs their tasks one at a time, first come first
  served (`LaneSpec.shares`), as two processes on one GPU take turns at its queue."""
  for lane, device in enumerate(lane_to_device):
    cluster.lanes[lane] = dataclasses.replace(cluster.lanes[lane], shares=f'device {device}')


# --- copies -------------------------------------------------------------------------------------
def copy(
  cluster: Cluster,
  value,
  source: int,
  destination: int,
  device,
  *,
  costed: bool,
  batch: int | None = None,
):
  """Generator returning `value` on `device` (the lane `destination`'s).

  With costed links (virtual clock) the copy is a transfer task on the link
  `source → destination`; otherwise it is dispatched inline (asynchronously).
  """
  if not costed or source == destination:
    return transfer.to_device(value, device)
  link = cluster.link(source, destination)
  return (
    yield Compute(
      transfer.to_device,
      (value, device),
      kind=TRANSFER,
      lane=link,
      batch=batch,
      nbytes=transfer.nbytes(value),
    )
  )


# --- shared parameters --------------------------------------------------------------------------
class SharedParams:
  """`(params, opt_state)` in a `VersionedStore`, updated by atomic read-modify-writes.

  `apply` reads the current value, dispatches the jitted update and writes the
  result at one instant; the lock makes that instant atomic on the real clock
  (the update is dispatched asynchronously, so the lock is held only for the
  dispatch). Two workers updating one store therefore never lose an update.

  With lanes in processes of their own (`executor='processes'`) the value lives in
  the lane that owns the store and the driver cannot call the update: `update_on`
  and `replace_on` are the same read-modify-writes as `Compute`s of named tasks on
  that lane. From the read to the write a process holds the store's *turn* (one
  token in a FIFO channel), so concurrent updates queue in the order they asked
  and none is lost; readers see the last written version, as with `apply`.
  """

  def __init__(self, name: str, params, opt_state):
    self.store = VersionedStore(name, StageParams(params, opt_state))
    self._lock = threading.Lock()
    self._turn: Channel | None = None  # made by the first `update_on` / `replace_on`

  def read(self):
    return self.store.read()

  def apply(
    self,
    update: Callable,
    grads,
    *args,
    read_version: int,
    lane: int | None = None,
    batch: int | None = None,
  ):
    """`(params, opt_state) ← update(params, opt_state, grads, *args)`, recorded as a
    gradient computed at `read_version`."""
    with self._lock:
      current = self.store.read().value
      params, opt_state = update(current.params, current.opt_state, grads, *args)
      return self.store.write(
        StageParams(params, opt_state), read_version=read_version, lane=lane, batch=batch
      )

  def replace_params(self, fn: Callable, *args):
    """`params ← fn(params, *args)` (not a gradient update: no staleness recorded)."""
    with self._lock:
      current = self.store.read().value
      self.store.write(current._replace(params=fn(current.params, *args)))

  def update_on(
    self,
    owner: int,
    update: Callable,
    grads,
    *,
    read_version: int,
    lane: int,
    batch: int,
    stage: int = 0,
  ):
    """Generator: `apply(update, grads, ...)` as a `Compute` on lane `owner` (a named
    task there), holding the store's turn from the read to the write."""
    yield Get(self._turn_on(owner))
    version = yield from self.update_alone(
      owner, update, grads, read_version=read_version, lane=lane, batch=batch, stage=stage
    )
    yield Put(self._turn, _TURN)
    return version

  def update_alone(
    self,
    owner: int,
    update: Callable,
    grads,
    *,
    read_version: int,
    lane: int,
    batch: int,
    stage: int = 0,
  ):
    """Generator: `update_on` without the turn, for the store's only writer (an elastic
    run's updater, on lane `owner`); one yield, the `Compute`."""
    current = self.store.read().value
    params, opt_state = yield Compute(
      update,
      (current.params, current.opt_state, grads),
      kind='update',
      stage=stage,
      batch=batch,
      lane=owner,
    )
    return self.store.write(
      StageParams(params, opt_state), read_version=read_version, lane=lane, batch=batch
    )

  def replace_on(self, owner: int, fn: Callable, *args, kind: str, batch: int | None = None):
    """Generator: `replace_params(fn, *args)` as a `Compute` on lane `owner`, holding
    the store's turn."""
    yield Get(self._turn_on(owner))
    yield from self.replace_alone(owner, fn, *args, kind=kind, batch=batch)
    yield Put(self._turn, _TURN)

  def replace_alone(self, owner: int, fn: Callable, *args, kind: str, batch: int | None = None):
    """Generator: `replace_on` without the turn, for the store's only writer; one yield."""
    current = self.store.read().value
    params = yield Compute(fn, (current.params, *args), kind=kind, stage=0, batch=batch, lane=owner)
    self.store.write(current._replace(params=params))

  def _turn_on(self, owner: int) -> Channel:
    if self._turn is None:
      self._turn = Channel(f'{self.store.name}: turn to update', owner)
      self._turn.items.append(_TURN)  # free
    return self._turn


# --- lost workers (`ProcessExecutor(tolerate_lost=True)`) -----------------------------------
def state_at(phase: str, state: LoopState, *fields: str) -> LoopState:
  """A new state holding `fields` of `state`, from which a program starts at `phase`
  (a replaced worker's `on_rejoin`)."""
  new = LoopState(**{name: getattr(state, name) for name in fields})
  new.phase = phase
  return new


def lost_for_good(algorithm: str, who: str, reason: str):
  """`on_lost` of a worker the run cannot go on without once no new lane process took
  its place: the run stops, saying why."""
  raise WorkersFailedError(
    f'{algorithm}: {who} was lost and no new lane process took its place '
    f'({reason.rstrip(".")}); a checkpoint (checkpoint_every) lets the same command resume '
    'the run.'
  )
  yield  # (a generator, as `on_lost` must be)


# --- reporting ----------------------------------------------------------------------------------
class StepCounter:
  """Counts applied steps, at most `steps`; `on_step(step, loss, who)` after each.

  `commit(apply, loss, who)` applies and counts one step atomically (one lock, so
  exactly `steps` updates are applied whatever the interleaving of the real
  clock's threads); once the run is done it applies nothing and returns None.
  """

  def __init__(self, steps: int, on_step: Callable[[int, Any, str], None] | None = None):
    self.steps, self.on_step = steps, on_step
    self.applied = 0
    self.claimed = 0
    self._lock = threading.RLock()

  def claim(self) -> bool:
    """Reserves one of the `steps` for work that applies updates over several tasks
    (PD-ASGD's layer-wise backward); False once all are reserved. A claimed step
    must be committed, so no more than `steps` steps' updates are ever applied."""
    with self._lock:
      if self.claimed >= self.steps:
        return False
      self.claimed += 1
      return True

  def release(self) -> None:
    """Gives back a claimed step that will never be committed (the lane applying it was
    lost with the update), so that another update takes it."""
    with self._lock:
      self.claimed -= 1

  @property
  def done(self) -> bool:
    return self.applied >= self.steps

  def snapshot(self) -> dict:
    return {'applied': self.applied, 'claimed': self.claimed}

  def load(self, saved: dict) -> None:
    self.applied, self.claimed = saved['applied'], saved['claimed']

  def commit(self, apply: Callable[[], Any] | None, loss, who: str) -> int | None:
    with self._lock:
      if self.done:
        return None
      if apply is not None:
        apply()
      self.applied += 1
      if self.on_step is not None:
        self.on_step(self.applied, loss, who)
      return self.applied


def run_reporter(
  run,
  executor,
  *,
  steps: int,
  batch_size: int,
  variables: Callable[[], Any],
  metrics: Callable[[], dict],
) -> StepCounter:
  """A `StepCounter` of `steps` that reports every step to `run` (with the simulated
  time on the virtual clock)."""
  virtual = executor.clock == 'virtual'

  def on_step(step, loss, who):
    run.report(
      step,
      loss=executor.deferred(loss),  # a lane's value: fetched when the report reads it
      variables=variables,
      samples=step * batch_size,
      sim_time=executor.now() if virtual else None,
      extra=metrics,
      stage=who,
    )

  return StepCounter(steps, on_step)


class WorkerLog:
  """When workers fail (`cost.failures`) or are lost (their lane process died or raised,
  `tolerate_lost_workers`), and when each pushed its updates."""

  def __init__(self, names: Sequence[str], failures: dict[int, float], now: Callable[[], float]):
    self.names, self.failures, self.now = list(names), dict(failures), now
    self.failed: dict[int, float] = {}  # worker -> when it noticed
    self.lost: dict[int, tuple[float, str]] = {}  # worker -> (when, why)
    self.pushes: list[list[float]] = [[] for _ in names]
    self._lock = threading.Lock()

  def lose(self, worker: int, reason: str) -> None:
    """`worker`'s lane was lost (`reason`: which lane, on which host, what happened)."""
    with self._lock:
      self.lost.setdefault(worker, (self.now(), reason))

  def has_failed(self, worker: int) -> bool:
    """Whether `worker`'s failure time has come (recorded the first time it has)."""
    time = self.failures.get(worker)
    if time is None or self.now() < time:
      return False
    with self._lock:
      self.failed.setdefault(worker, self.now())
    return True

  def alive(self, workers: Sequence[int]) -> list[int]:
    return [m for m in workers if m not in self.failed]

  def pushed(self, worker: int) -> None:
    self.pushes[worker].append(self.now())

  def snapshot(self) -> dict:
    return {
      'failed': sorted(self.failed.items()),
      'pushes': [np.asarray(p, np.float64) for p in self.pushes],
    }

  def load(self, saved: dict) -> None:
    self.failed = dict(saved['failed'])
    self.pushes = [[float(t) for t in p] for p in saved['pushes']]

  def summary(self) -> dict:
    return {
      'failed_workers': [
        {
          'worker': self.names[m],
          'index': m,
          'failure_time': self.failures[m],
          'stopped_at': at,
          'pushes': len(self.pushes[m]),
          'last_push': max(self.pushes[m], default=None),
        }
        for m, at in sorted(self.failed.items())
      ],
      'lost_workers': [
        {
          'worker': self.names[m],
          'index': m,
          'lost_at': at,
          'reason': reason,
          'pushes': len(self.pushes[m]),
          'last_push': max(self.pushes[m], default=None),
        }
        for m, (at, reason) in sorted(self.lost.items())
      ],
      'pushes_per_worker': {self.names[m]: len(p) for m, p in enumerate(self.pushes)},
    }


def staleness_by_lane(store: VersionedStore, lanes: dict[int, str]) -> dict[str, np.ndarray]:
  """The staleness of `store`'s updates split by the lane (worker) that made them."""
  split = {name: [] for name in lanes.values()}
  for update in store.updates:
    split[lanes[update.lane]].append(update.staleness)
  return {name: np.asarray(values, np.int64) for name, values in split.items()}


def staleness_metrics(groups: dict[str, np.ndarray], prefix: str) -> dict[str, float]:
  """`staleness_mean/<prefix><i>` and `staleness_max/...` per group, plus the overall mean."""
  record, every = {}, []
  for i, values in enumerate(groups.values()):
    if values.size:
      record[f'staleness_mean/{prefix}{i}'] = float(values.mean())
      record[f'staleness_max/{prefix}{i}'] = int(values.max())
      every.append(values)
  if every:
    record['staleness_mean'] = float(np.concatenate(every).mean())
  return record
