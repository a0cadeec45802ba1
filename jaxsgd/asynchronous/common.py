"""What the asynchronous algorithms share: lanes, worker speeds and failures, reporting.

Every asynchronous policy (ASGD/DC-ASGD, LPP-SGD, PD-ASGD) is a set of scheduler
processes on the lanes of a `Cluster` (see `jaxsgd.scheduler`). This module holds
the pieces they have in common:

- `check_cost` / `worker_costs` / `make_executor`: the `config.cost` sub-config
  with two fields of their own, `worker_speeds` (one speed factor per worker) and
  `failures` (`(worker, time)` pairs: from that simulated or wall second on, the
  worker stops);
- `lane_devices`: lanes on devices (real clock: round-robin over `jax.devices()`;
  virtual clock: every lane computes on the first device, since only simulated
  time depends on the lanes and the bits do not depend on the device);
- `SharedParams`: a `VersionedStore` of `(params, opt_state)` whose optimizer
  updates are read-modify-writes at one instant (under a lock on the real clock),
  so concurrent workers never lose an update;
- `StepCounter` / `run_reporter`: count the applied steps (exactly
  `train_steps`), report them to the `Run` and say when the run is done;
  `WorkerLog`: failures and push times;
- `train` ends with `jaxsgd.scheduler.outputs.write_outputs`: the summary fields
  (`mean_staleness`, `staleness_histogram`, per-worker/layer staleness, failed
  workers, `sim_time`, utilization).
"""

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxsgd.scheduler import costs as costs_lib
from jaxsgd.scheduler import outputs
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute
from jaxsgd.scheduler.costs import TRANSFER
from jaxsgd.scheduler.pipeline import KINDS, StageParams
from jaxsgd.scheduler.real import RealExecutor
from jaxsgd.scheduler.store import VersionedStore
from jaxsgd.scheduler.virtual import VirtualExecutor
from jaxsgd.training import optimizers

OWN_COST_FIELDS = ('worker_speeds', 'failures')


class _Stop:
  def __repr__(self):
    return 'STOP'


STOP = _Stop()  # The message that ends a process waiting on a channel.


class WorkersFailedError(RuntimeError):
  """Every worker of a role failed: the run cannot reach `train_steps`."""


# --- settings -----------------------------------------------------------------------------------
def positive_int(value, field: str) -> int:
  """`value` if it is an int >= 1, else a ValueError naming `field`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f'{field}: must be a positive integer, got {value!r}.')
  return int(value)


def choice(value, field: str, allowed: Sequence[str]) -> str:
  if value not in allowed:
    raise ValueError(f'{field}: {value!r}; allowed: {", ".join(allowed)}.')
  return value


def _split_cost(cost_config) -> tuple[dict, dict]:
  """(`config.cost` without the fields of this module, those fields)."""
  given = dict(cost_config or {})
  own = {k: given.pop(k) for k in OWN_COST_FIELDS if k in given}
  return given, own


def check_cost(cost_config, *, num_stages: int) -> dict:
  """`costs.check_settings` for policies whose lanes are not stages (stages only size
  `cost.compute`; lane speeds come from `cost.worker_speeds`).

  `cost.device_speeds` is refused: asynchronous workers take `cost.worker_speeds`.
  """
  general, _ = _split_cost(cost_config)
  cost = costs_lib.settings(general)
  if not cost['calibrate']:
    costs_lib.explicit_compute(cost, num_stages, KINDS)
  if tuple(cost['device_speeds'] or ()):
    raise ValueError('cost.device_speeds: the asynchronous algorithms set speeds per worker; '
                     'use cost.worker_speeds (one factor per worker).')
  if not isinstance(cost['reps'], int) or cost['reps'] < 1:
    raise ValueError(f'cost.reps: must be a positive integer, got {cost["reps"]!r}.')
  if not (cost['link_bandwidth'] or 0) >= 0:
    raise ValueError(f'cost.link_bandwidth: must be >= 0 (0: free), got '
                     f'{cost["link_bandwidth"]!r}.')
  costs_lib.model_from_settings(cost, {}, seed=0)  # Range checks of the other fields.
  return cost


@dataclasses.dataclass(frozen=True)
class WorkerCosts:
  speeds: tuple[float, ...]      # one factor per worker
  failures: dict[int, float]     # worker -> the (simulated or wall) second it fails


def worker_costs(cost_config, num_workers: int, what: str = 'worker') -> WorkerCosts:
  """`cost.worker_speeds` (default all 1) and `cost.failures`, checked."""
  _, own = _split_cost(cost_config)
  speeds = tuple(own.get('worker_speeds') or ()) or (1.0,) * num_workers
  if len(speeds) != num_workers:
    raise ValueError(f'cost.worker_speeds: {len(speeds)} values for {num_workers} {what}s.')
  for m, speed in enumerate(speeds):
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0:
      raise ValueError(f'cost.worker_speeds: must be > 0, got {speed!r} for {what} {m}.')
  failures = {}
  for pair in own.get('failures') or ():
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise ValueError(f'cost.failures: (worker, time) pairs expected, got {pair!r}.')
    m, time = pair
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < num_workers:
      raise ValueError(f'cost.failures: worker {m!r} is not a {what} in [0, {num_workers}).')
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not time >= 0:
      raise ValueError(f'cost.failures: the failure time of {what} {m} must be >= 0 seconds, '
                       f'got {time!r}.')
    failures[m] = min(float(time), failures.get(m, math.inf))
  return WorkerCosts(tuple(float(s) for s in speeds), failures)


def lane_devices(clock: str, num_lanes: int) -> list[jax.Device]:
  """Real clock: lane i on `jax.devices()[i % n]`; virtual: every lane on the first."""
  devices = jax.devices()
  if clock == 'virtual':
    return [devices[0]] * num_lanes
  return [devices[i % len(devices)] for i in range(num_lanes)]


def links_are_costed(cost: dict, clock: str) -> bool:
  return clock == 'virtual' and (cost['link_latency'] > 0 or bool(cost['link_bandwidth']))


def make_executor(config, measure: Callable[[dict], dict], lane_speeds: Sequence[float], *,
                  adjust: Callable[[dict], dict] = lambda table: table):
  """(executor, the measured cost table).

  Real clock: `RealExecutor(threads=True)` and `{}`. Virtual clock: the table
  `measure(cost)` returns (calibrated or explicit seconds per `(stage, kind)`),
  and a `VirtualExecutor` whose cost model uses `adjust(table)` with these lane
  speeds.
  """
  if config.clock == 'real':
    return RealExecutor(threads=True), {}
  cost = cost_settings(config)
  measured = measure(cost)
  model = costs_lib.model_from_settings(cost, adjust(measured), seed=config.seed)
  return VirtualExecutor(dataclasses.replace(model, device_speeds=tuple(lane_speeds))), measured


def cost_settings(config) -> dict:
  return costs_lib.settings(_split_cost(config.get('cost'))[0])


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


# --- copies -------------------------------------------------------------------------------------
def copy(cluster: Cluster, value, source: int, destination: int, device, *, costed: bool,
         batch: int | None = None):
  """Generator returning `value` on `device` (the lane `destination`'s).

  With costed links (virtual clock) the copy is a transfer task on the link
  `source → destination`; otherwise it is dispatched inline (asynchronously).
  """
  if not costed or source == destination:
    return transfer.to_device(value, device)
  link = cluster.link(source, destination)
  return (yield Compute(transfer.to_device, (value, device), kind=TRANSFER, lane=link,
                        batch=batch, nbytes=transfer.nbytes(value)))


# --- shared parameters --------------------------------------------------------------------------
class SharedParams:
  """`(params, opt_state)` in a `VersionedStore`, updated by atomic read-modify-writes.

  `apply` reads the current value, dispatches the jitted update and writes the
  result at one instant; the lock makes that instant atomic on the real clock
  (the update is dispatched asynchronously, so the lock is held only for the
  dispatch). Two workers updating one store therefore never lose an update.
  """

  def __init__(self, name: str, params, opt_state):
    self.store = VersionedStore(name, StageParams(params, opt_state))
    self._lock = threading.Lock()

  def read(self):
    return self.store.read()

  def apply(self, update: Callable, grads, *args, read_version: int, lane: int | None = None,
            batch: int | None = None):
    """`(params, opt_state) ← update(params, opt_state, grads, *args)`, recorded as a
    gradient computed at `read_version`."""
    with self._lock:
      current = self.store.read().value
      params, opt_state = update(current.params, current.opt_state, grads, *args)
      return self.store.write(StageParams(params, opt_state), read_version=read_version,
                              lane=lane, batch=batch)

  def replace_params(self, fn: Callable, *args):
    """`params ← fn(params, *args)` (not a gradient update: no staleness recorded)."""
    with self._lock:
      current = self.store.read().value
      self.store.write(current._replace(params=fn(current.params, *args)))


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

  @property
  def done(self) -> bool:
    return self.applied >= self.steps

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


def run_reporter(run, executor, *, variables: Callable[[], Any],
                 metrics: Callable[[], dict]) -> StepCounter:
  """A `StepCounter` of `config.train_steps` that reports every step to `run`
  (with the simulated time on the virtual clock)."""
  virtual = executor.clock == 'virtual'
  batch_size = run.config.batch_size

  def on_step(step, loss, who):
    run.report(step, loss=loss, variables=variables, samples=step * batch_size,
               sim_time=executor.now() if virtual else None, extra=metrics, stage=who)

  return StepCounter(run.config.train_steps, on_step)


class WorkerLog:
  """When workers fail (`cost.failures`) and when each pushed its updates."""

  def __init__(self, names: Sequence[str], failures: dict[int, float], now: Callable[[], float]):
    self.names, self.failures, self.now = list(names), dict(failures), now
    self.failed: dict[int, float] = {}           # worker -> when it noticed
    self.pushes: list[list[float]] = [[] for _ in names]
    self._lock = threading.Lock()

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

  def summary(self) -> dict:
    return {'failed_workers': [
        {'worker': self.names[m], 'index': m, 'failure_time': self.failures[m],
         'stopped_at': at, 'pushes': len(self.pushes[m]),
         'last_push': max(self.pushes[m], default=None)} for m, at in sorted(self.failed.items())],
            'pushes_per_worker': {self.names[m]: len(p) for m, p in enumerate(self.pushes)}}


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


def train_session(run, executor, measured: dict, log: WorkerLog,
                  make_session: Callable[[StepCounter], Any], *, title: str,
                  extra: Callable[[Any], dict]) -> dict:
  """Runs the session `make_session(steps)` builds and returns the summary extras.

  `steps` reports every applied step to `run`; the session must provide
  `cluster`, `processes()`, `variables()`, `metrics()` and `staleness()`.
  """
  session = None
  steps = run_reporter(run, executor, variables=lambda: session.variables(),
                       metrics=lambda: session.metrics())
  session = make_session(steps)
  timeline = executor.run(session.cluster, session.processes())
  if not steps.done:
    raise WorkersFailedError(f'{run.config.algorithm.name}: the run stopped after '
                             f'{steps.applied} of {steps.steps} steps: the workers that could '
                             f'go on failed ({log.summary()["failed_workers"]}).')
  summary = {**extra(session), **log.summary()}
  if measured:
    summary['backward_forward_ratio'] = backward_forward_ratio(measured)
    logging.info('%s: measured backward/forward time ratio %.2f.', title,
                 summary['backward_forward_ratio'])
  return outputs.write_outputs(run, timeline, session.staleness(), executor=executor,
                       epochs=steps.applied * run.config.batch_size / run.dataset.num_train,
                       title=title, extra=summary)


def check_whole_model_workers(config, num_workers: int) -> None:
  """Checks shared by the algorithms whose workers each compute whole-model
  gradients (ASGD, DC-ASGD, LPP-SGD): optimizer, one stage, cost settings."""
  optimizers.check_optimizer(config.optimizer)
  if config.stages != 1:
    raise ValueError(f'stages: {config.algorithm.name} computes whole-model gradients on '
                     f'each worker; use stages=1, got {config.stages}.')
  if config.clock == 'virtual':
    check_cost(config.get('cost'), num_stages=1)
  worker_costs(config.get('cost'), num_workers)
