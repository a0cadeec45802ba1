"""The real clock across processes: every compute lane of a cluster is an OS process.

    executor = ProcessExecutor(LanePlacement.parse('stage0@cores=0; stage1@cores=1'))
    try:
      timeline = executor.run(session.cluster, session.processes())
      variables = session.variables()        # fetched from the lanes (`fetch`)
    finally:
      executor.close()                       # ends every lane process

The policies are the same as under the other clocks; only their `Compute`s must name
their functions (`tasks.Task`: a recipe and a name), which each lane process builds
from the same picklable settings — a closure is refused. The lanes are a `LanePool`
(`lanes/`, docs/engine.md): one Ray actor per lane, pinned to its cores (or given a
GPU), on this host or another. A cluster lane goes to the placement lane of the same
name: the cluster's name up to its first ' (' without spaces ('stage 0 (cpu:0)' →
`stage0`, 'worker 1' → `worker1`); a placement missing one is refused, naming them.
Without a placement every lane gets its own core, round-robin over this host's cores.

A task's result stays in its lane; the process gets `Handle`s (values with no arrays
— None, an empty dict — come back as themselves, since policies test them). A `Send`
between lanes is a transfer task on the link lane whose copy goes lane to lane
(`LanePool.move`), never through the driver; its record spans the copy as the lanes
made it, from when the value existed on the sending lane to when it arrived on the
receiving lane (which takes it in as part of its next call that reads it: that shows in
the gap before that call). `fetch` brings values to the driver at
logging points; `deferred` wraps a lane's scalar for `Run.report` (fetched when read).

Running ahead: once a task has finished on arguments of the same shapes, its handles
are known at its start (`LanePool.early`) and the process goes on at once while the
lane computes — as the in-process real clock goes on while its devices compute — as
long as its lane then has at most `run_ahead` unfinished tasks (this one included);
beyond that the process waits for room: its task is dispatched once an end heard on the
lane makes it, and the process goes on then, so a lane never has more than `run_ahead`
tasks run ahead queued (with a bound of 1, a parameter server's workers', the process
waits for its own task instead, dispatched at once: `executor.waits_for_room`). A task
marked `Compute(..., ahead=False)` is always dispatched at once and waited for (as every
task with `run_ahead=0`). The end of a task the process went on
without is not needed at once: its lane holds the reply while `HOLD_WHILE_QUEUED` (2)
calls are queued behind it and sends it with its next one, or before it waits for a copy
with one call or none behind it (`LanePool.start(ahead=True)`),
so the driver wakes once for several ends, and hears of room while the lane still runs
its last queued call: the tasks that waited for room reach it before it runs dry. (When
a process at the bound waited for its own task instead, the lane sent every end only
once its queue was empty and idled for the driver's round trip every `run_ahead` + 1
tasks: 5-10 % of an iteration of 2-8 ms tasks.) A `Ready` that waits for such a task
asks its lane for the end at once (`LanePool.hasten`). Unbounded, the
driver raced through a whole run's schedule in its first seconds: every queued task
kept its arguments' handles alive, so no lane freed anything (each lane of a DDG K=2
run grew by ~300 MB/s, to 3 GB in 300 steps), every task wrote to freshly faulted
memory (~1,300 page faults, ~2 ms, on a 1.5 ms forward) and every wait looked through
thousands of tasks.

Faults: a task that raises, or a lane process that dies (SIGKILL), raises `LaneError`
naming the lane and its host from the executor's wait (within ~25 ms of the death);
the run stops, every process is closed and every lane process ended.

Lost workers (`tolerate_lost=True`): a lane whose every process has an `on_lost`
(`core.Process`: asynchronous workers) may be lost instead. When it dies or a task of
it raises, what was pending on it or being copied from it is dropped, and a new lane
process is started in its place (`LanePool.replace`, the same placement): its processes
start again from their `on_rejoin(reason)` states (an ASGD worker asks the server for
the current parameters), and the values sent to it that it had not taken are dropped
from its channels (a process whose `on_rejoin` says it holds nothing of the lost lane
goes on where it is). A lane whose task failed only for a value of another lane's lost
process (`LaneError.lost_input`) keeps its process (`LanePool.reset`): its processes start
again all the same. Where its processes have no `on_rejoin`, or no new process starts,
the lane is removed (`LanePool.remove`), its processes are closed and each
`on_lost(reason)` runs in its place (an ASGD worker's tells the server to stop waiting
for it); messages sent to it later are dropped. Messages from such a lane are delivered
only once their copy has landed (`LanePool.move(landed=True)`), so a loss never leaves
half a message. Each loss is in `lost` (lane, host, when, why, when replaced). Any
other lane's failure still stops the run.

Emulated tasks (`emulate=CostModel`, `config.executor='emulated'`): the same lanes,
placement, driver and running ahead, but a lane does not compute a `Compute`: it waits
exactly the task's priced duration and returns zeros of its outputs' shapes and dtypes
(`lanes/runtime.py`), so every message between lanes still moves a payload of its real
size. The duration is drawn here, at dispatch, by the cost model's sampler
(`CostModel.sampler().duration(kind, stage, lane)`), the code the virtual clock prices
its tasks with: both clocks price a task alike (with straggler noise, a lane's n-th task
draws the n-th number of that lane's stream on both, since a lane runs its tasks in the
order dispatched). Emulated tasks wait rather than compute, so lanes need no cores of
their own: K lanes run on fewer cores, and the run measures the schedule and the
executor (the driver, Ray, the copies) against the virtual clock's model of them.

Checkpoints: `between_events` (if set, `algorithms.resume`) is called after every op
the driver dispatches, as on the in-process real clock. There the run is saved at a
*drained point*: `snapshot()` first waits until every dispatched task has finished and
every copy has landed (the processes they resume are queued, not advanced), so what is
left is data — the processes' `LoopState`s, the queue of processes ready to go on (with
the values they go on with), channel items and waiters, the timeline, the wall time —
and `Handle`s, which `scheduler.snapshot` saves as their values, exported by their
lanes, and puts back on the same lanes when `run(..., resume=...)` goes on from it. The
driver's order depends only on the programs and on which task ends first, so a
deterministic schedule (staged BP, DDG, local) resumes bit-identical to an
uninterrupted run, as on the other clocks.

Signals: Ctrl-C or SIGTERM of the driver ends the run and every lane process (and the
Ray cluster the run started) within seconds. A run that checkpoints saves first on
SIGTERM: at its next drained point, after which `Run.maybe_save` raises
`errors.Preempted` (exit 143) and the same command resumes it; one that does not
raises `errors.Preempted` at once.
"""

import collections
import contextlib
import dataclasses
import logging
import time

import jax
import numpy as np

from jaxsgd.errors import Preempted
from jaxsgd.scheduler.core import Channel, Cluster, Compute, Process, Send
from jaxsgd.scheduler.copy_load import COPIES, CopiesByLoad, refuse_placed_copies
from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.executor import RUN_AHEAD, Executor, ReadyWait, waits_for_room
from jaxsgd.scheduler.lanes import Handle, LaneError, LanePlacement, LanePool, sigterm_received
from jaxsgd.scheduler.lanes.pool import saving_on_sigterm
from jaxsgd.scheduler.placement import lane_name
from jaxsgd.scheduler.tasks import Task
from jaxsgd.scheduler.timeline import TaskRecord, Timeline
from jaxsgd.scheduler.transfer import HostInputs


_HEAR_LANES_S = 0.005  # while processes are ready, finished tasks are looked for this often
# Seconds in which no lane finished anything before the run says what it waits for (then
# after twice as long again, and so on): a task may rightly take that long, so it is said,
# not raised; a stuck run is then one a reader can see into (`waiting_report`).
STALL_REPORT_S = 60.0


class ProcessExecutor(Executor):
  """Runs each compute lane's tasks in a lane process of a `LanePool`.

  Args:
    placement: where each lane process runs (None: one core each, round-robin).
    address: a running Ray cluster (`host:port`) to place the lanes on; None starts
      one on this machine for the executor's lifetime.
    pool: an open `LanePool` to use instead (not closed by `close`; its lane names
      must cover the cluster's).
    run_ahead: resume a process with a task's handles before the task ends when they
      are known (`LanePool.early`) and its lane then has at most this many unfinished
      tasks, this one included; 0 (or False): never. 4: a stage's forward, backward
      and update of one iteration, and the next forward (docs/engine.md).
    verbose: print the placement (lane, host, pid, cores, device) when the lanes start.
    tolerate_lost: a lane whose processes all have `on_lost` (asynchronous workers)
      may be lost without stopping the run (module docstring); False: any lost lane
      stops it.
    emulate: a cost model: every task waits its priced duration instead of computing
      (module docstring); None: tasks compute.
    copies: where the lanes' copy threads run: 'own' — as the placement puts them (a
      lane's `copies=`, else its own cores); 'auto' — moved once, by the load the run
      measures, from a lane whose cores bound the run to one whose cores wait
      (`copy_load.CopiesByLoad`; the placement may then name no lane's `copies=`), and
      the driver's threads pinned by the same load, where that takes them off the
      busiest cores of their host (`placement.driver_toward_idle`), until the run ends.
    steady_from_batch: the driver's CPU is counted apart from the first task of this
      batch on (`steady_cpu_seconds`, `driver_cpu_per_task`): the run's start left out.
    stall_report_s: after this many seconds (positive) in which no lane finished a
      task, a warning says what the run waits for (`waiting_report`), again once the
      quiet has lasted twice as long, and so on; None: never.
  """

  clock = 'real (processes)'
  handle_type = Handle  # the run's values in lanes: a checkpoint saves them (`snapshot`)

  def __init__(
    self,
    placement: LanePlacement | None = None,
    *,
    address: str | None = None,
    pool: LanePool | None = None,
    run_ahead: int = RUN_AHEAD,
    verbose: bool = True,
    tolerate_lost: bool = False,
    emulate: CostModel | None = None,
    copies: str = 'own',
    steady_from_batch: int | None = None,
    stall_report_s: float | None = STALL_REPORT_S,
  ):
    if copies not in COPIES:
      raise ValueError(f'copies: one of {", ".join(COPIES)} expected, got {copies!r}.')
    if stall_report_s is not None and not stall_report_s > 0:  # (NaN too)
      raise ValueError(
        f'stall_report_s: a positive number of seconds or None expected, got {stall_report_s!r}.'
      )
    if copies == 'auto' and placement is not None:
      refuse_placed_copies(placement, placement.names)
    self.placement, self.address, self.pool = placement, address, pool
    self.copies = copies
    self.copies_by_load: CopiesByLoad | None = None  # what it measured and moved ('auto')
    self.cost_model = emulate
    if emulate is not None:
      self.clock = 'real (emulated tasks)'
    self._sampler = None
    self._owns_pool = pool is None
    self.run_ahead, self.verbose, self.tolerate_lost = run_ahead, verbose, tolerate_lost
    self.dispatch_seconds = 0.0  # host time spent starting tasks (for benchmarks)
    self.dispatch_cpu_seconds = 0.0  # of it, the driver thread's CPU
    self.dispatched = 0
    # The driver's CPU (every thread of its process: dispatch, hearing events and running
    # the policy, its connections' readers and writers) over the last `run`: the host's
    # whole cost per task, where `dispatch_seconds` holds only the dispatch. And the same
    # from the first task of batch `steady_from_batch` on: its CPU and the tasks
    # dispatched since.
    self.run_cpu_seconds = 0.0
    self.steady_from_batch = steady_from_batch
    self.steady_cpu_seconds, self.steady_dispatched = 0.0, 0
    self._steady_mark: tuple[float, int] | None = None
    self.lost: list[LostLane] = []
    self.between_events = None  # called after every op dispatched (checkpoints)
    self.on_sigterm = None  # with checkpoints: SIGTERM asks for a save, then a stop
    self.pauses: list[float] = []  # seconds each checkpoint's drain and save held the run
    self.stall_report_s = stall_report_s

  # --- the lanes ---------------------------------------------------------------------------
  def run(
    self, cluster: Cluster, processes: list[Process], *, resume: dict | None = None
  ) -> Timeline:
    """As `Executor.run` (`resume`: a decoded `snapshot()`, module docstring); the
    lane processes are ended if it raises (else by `close`). The timeline's lane names
    (trace rows, `utilization` keys) are not the cluster's: each names the device its
    lane process ran on, the lane and its host, `stage 0 (stage0: cuda:0 on 10.0.0.2)`
    where the cluster has `stage 0 (cpu:0)` (`_lane_labels`)."""
    try:
      self._lane_names = self._map_lanes(cluster)
      with contextlib.ExitStack() as stack:
        if self.on_sigterm is not None:
          stack.enter_context(saving_on_sigterm(self.on_sigterm))
        began, self._steady_mark = time.process_time(), None
        self.run_cpu_seconds, self.steady_cpu_seconds, self.steady_dispatched = 0.0, 0.0, 0
        try:
          timeline = super().run(cluster, processes, resume=resume)
        finally:
          if self.copies_by_load is not None:  # (not pinned in what the driver does next)
            self.copies_by_load.put_driver_back()
        ended = time.process_time()
        self.run_cpu_seconds = ended - began
        if self._steady_mark is not None:
          self.steady_cpu_seconds = ended - self._steady_mark[0]
          self.steady_dispatched = self.dispatched - self._steady_mark[1]
      timeline.lane_names = self._lane_labels(cluster)
      self._put_copies_back()
      return timeline
    except BaseException as error:
      if self.pool is not None:  # a pool that goes on (not ours) keeps no trace of the run
        for copy in getattr(self, '_copies', ()):
          self.pool.forget_exports(copy.exports)
        # (not after Ctrl-C or SIGTERM: a call to a lane would hear the signal again)
        if isinstance(error, Exception):
          with contextlib.suppress(Exception):  # (the run's own error is the one to raise)
            self._put_copies_back()
      self.close()
      if isinstance(error, KeyboardInterrupt) and sigterm_received():
        raise Preempted(
          'SIGTERM: stopped; every lane process was ended. Nothing was saved (this run '
          'was given no checkpoints), so running the command again starts over.'
        ) from None
      raise

  def driver_cpu_per_task(self) -> float | None:
    """The driver's CPU seconds per task of the last run: from `steady_from_batch` on
    where a task of it was dispatched, else over the whole run; None before any task."""
    if self.steady_dispatched:
      return self.steady_cpu_seconds / self.steady_dispatched
    if self.dispatched and self.run_cpu_seconds:
      return self.run_cpu_seconds / self.dispatched
    return None

  def _put_copies_back(self) -> None:
    """A pool that goes on (not ours) starts its next run with the copy threads as
    placed, not where this run's load moved them (`CopiesByLoad.put_back`)."""
    if not self._owns_pool and self.copies_by_load is not None:
      self.copies_by_load.put_back()

  def close(self) -> None:
    """Ends every lane process this executor started (idempotent)."""
    if self._owns_pool and self.pool is not None:
      pool, self.pool = self.pool, None
      pool.close()

  def _map_lanes(self, cluster: Cluster) -> dict[int, str]:
    names = {i: lane_name(spec.name) for i, spec in enumerate(cluster.lanes) if spec.link is None}
    if len(set(names.values())) != len(names):
      names = {i: f'{name}.{i}' for i, name in names.items()}
    if self.pool is not None and getattr(self, '_lane_names', None) == names:
      return names  # opened already, for a resumed run's values (`restore_handle`)
    if self.pool is None:
      placement = self.placement or LanePlacement.spread(names.values())
      placement.check_run(list(names.values()), every_lane=True)
      self.pool = LanePool(placement, address=self.address, verbose=self.verbose)
    else:  # a pool given may hold other runs' lanes too, but must hold all of this one's
      self.pool.placement.check_run(list(names.values()), every_lane=True, others_allowed=True)
    return names

  def _lane_labels(self, cluster: Cluster) -> list[str]:
    """The lanes' names in the run's outputs (trace rows, `utilization`): each compute
    lane's with the device its lane process ran on, the lane and its host
    (`stage 0 (stage0: cuda:0 on 10.0.0.2)`), not the driver's stand-in device that the
    policy named it by (`stage 0 (cpu:0)`: a GPU lane was reported as `cpu:0`); a link's
    from its ends."""
    labels = []
    for i, spec in enumerate(cluster.lanes):
      if spec.link is not None:  # links come after the lanes they join
        source, destination = spec.link
        labels.append(f'link {labels[source]} → {labels[destination]}')
        continue
      lane = self._lane_names[i]
      info = self.pool.info[lane]
      base = spec.name
      if spec.device is not None and base.endswith(f' ({spec.device})'):
        base = base[: -len(f' ({spec.device})')]
      labels.append(f'{base} ({lane}: {info["device"]} on {info["host"]})')
    return labels

  # --- the clock's hooks (`executor.py`) ---------------------------------------------------
  def now(self) -> float:
    return time.time() - self._t0  # lanes report time.time() too

  def begin(self) -> None:
    self._t0 = time.time()
    self._ready = collections.deque()
    self._pending = {}
    self._pending_on = collections.Counter()  # lane -> its entries in `_pending`
    self._resumed = set()
    self._ready_waits: dict = {}  # a pending task -> the `Ready`s that wait for it
    # compute lane -> (process, op) of the tasks that wait for room on it (`start_task`)
    self._parked: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self.lost = []
    self._lost_lanes: set[int] = set()
    self._copies: list[_Copy] = []  # copies on their way, recorded once done
    self._heard_now()
    self._lanes_by_name = {name: i for i, name in self._lane_names.items()}
    for lane, tasks in self.cluster.tasks.items():  # each lane builds its own, at once
      self.pool.prepare(self._lane_names[lane], [t for t in tasks if isinstance(t, Task)])
    self._sampler = None if self.cost_model is None else self.cost_model.sampler()
    self.copies_by_load = None
    if self.copies == 'auto':
      refuse_placed_copies(self.pool.placement, self._lane_names.values())
      self.copies_by_load = CopiesByLoad(self.pool, self._lane_names)
    lanes = collections.defaultdict(list)
    for process in self.processes:
      lanes[process.lane].append(process)
    self._expendable = {
      lane
      for lane, processes in lanes.items()
      if self.tolerate_lost and all(p.on_lost is not None for p in processes)
    }

  def execute(self) -> None:
    if self._resume is not None:
      self._ready.extend(self._load(self._resume))
    else:
      self._ready.extend((p, None) for p in self.processes)
    self._heard_now()  # (the lanes' builds and a resumed run's values were sent)
    while self.failure is None:
      self._advance_ready()
      try:
        if not self._pending:
          self.pool.settle()  # copies still on their way (and their sources) end here
          self._record_copies(final=True)
          return
        # While processes are still ready, only look: they go on after.
        timeout = 0 if self._ready else self._until_stall_report()
        finished = self.pool.wait_any(list(self._pending), timeout=timeout)
        self._record_copies()
      except LaneError as error:
        self._lose(error)  # a lost worker, tolerated; else it stops the run
        self._heard_now()  # (a new lane process may have taken its time to start)
        continue
      if finished is None:
        self._maybe_report_stall()
        continue
      self._finished(finished)

  def _heard_now(self) -> None:
    """The run went on (a lane finished something, a lost lane was dealt with, a
    checkpoint was saved): the quiet that a stall report counts starts again."""
    self._heard_at = time.monotonic()  # (or the run's start)
    self._quiet_for = self.stall_report_s  # seconds of quiet before the next report

  def _until_stall_report(self) -> float | None:
    """How long to wait for a lane before saying what the run waits for (None: for
    ever, with no report)."""
    if self._quiet_for is None:
      return None
    return max(0.0, self._heard_at + self._quiet_for - time.monotonic())

  def _maybe_report_stall(self) -> None:
    """Says what the run waits for once no lane has finished anything for
    `_quiet_for` seconds, and waits twice as long for the next report."""
    if self._quiet_for is None:  # (ready processes that keep one another going report too)
      return
    quiet = time.monotonic() - self._heard_at
    if quiet >= self._quiet_for:
      while self._quiet_for <= quiet:  # (a report that came late is not said again at once)
        self._quiet_for *= 2
      try:
        report = self.waiting_report(quiet)
      except Exception as error:  # pylint: disable=broad-except  (a report never stops a run)
        report = f'lanes: no lane has finished anything for {quiet:.1f} s ({error!r})'
      logging.warning('%s', report)

  def waiting_report(self, quiet_s: float) -> str:
    """What the run waits for, after `quiet_s` seconds in which no lane finished
    anything: each lane's unfinished tasks (oldest first, with how long ago each was sent
    and the lanes whose moved values its call takes in), then the moves waited for
    whole, with the lane's process, which `py-spy dump --pid` can look into; the tasks
    waiting for room on a lane; the processes waiting on a channel or for a value."""
    now, pids = time.time(), self.pool.pids()
    waiting = collections.defaultdict(list)
    for pending, (process, _, op) in self._pending.items():
      what = _what(op)
      if pending.source is not None:
        what = f'a copy from {pending.source} ({what})'
      if pending.sent is not None:
        what += f', sent {now - pending.sent:.1f} s ago'
      sources = sorted({self.pool.lane_at(address) for _, address in pending.imports})
      if sources:  # (moved to its lane for this call, which takes them in first)
        what += f', taking in values of {", ".join(sources)}'
      waiting[pending.lane].append((pending.sent or now, f'{what}, for {process.name}'))
    lines = [f'lanes: no lane has finished anything for {quiet_s:.1f} s; the run waits for:']
    for name in sorted(waiting):
      lines.append(f'  {name} (pid {pids.get(name, "?")}):')
      lines += [f'    {what}' for _, what in sorted(waiting[name])]
    for lane, parked in sorted(self._parked.items()):
      for process, op in parked:
        lines.append(f'  {process.name}: {_what(op)} waits for room on {self._lane_names[lane]}')
    for process in self.processes:
      if not process.done and process.waiting_on is not None:
        lines.append(f'  {process.name}: waits on {process.waiting_on}')
    for waits in self._ready_waits.values():
      for wait in waits:
        lines.append(f'  {wait.process.name}: waits for a value to be made (Ready)')
    return '\n'.join(lines)

  def _finished(self, finished) -> None:
    """Dispatches the tasks that waited for the room this end makes on its lane, then
    records the task and resumes its process (unless it ran ahead)."""
    self._heard_now()
    process, lane, op = self._forget_pending(finished)
    heard = self.now()  # (before the dispatches it makes room for)
    self._start_parked(lane)
    start, end = finished.started - self._t0, finished.ended - self._t0
    # dispatched: when the driver sent the call (`Pending.sent`; a landed move has none)
    dispatched = None if finished.sent is None else finished.sent - self._t0
    self.record(
      TaskRecord(lane, op.kind, start, end, op.stage, op.batch, heard, dispatched, finished.cpu)
    )
    if self.copies_by_load is not None:
      placed = self.copies_by_load.finished(lane, finished.cpu, heard)
      if placed is not None and self.verbose:
        print(placed, flush=True)
    if finished in self._resumed:
      self._resumed.discard(finished)
    else:
      self.task_finished(process, _driver_view(finished.result()))
    for waiting in self._ready_waits.pop(finished, ()):
      if waiting.ended(finished):
        self.resume(waiting.process, waiting.value)

  def _unfinished_on(self, lane: int) -> int:
    """The tasks dispatched on compute lane `lane` whose end the executor waits for. (Not
    the pool's count: a task dropped with a lost lane whose value it read stays there
    until its own lane replies, and a process waiting for room must not wait for it.)
    Counted as they come and go, not over `_pending` at each dispatch: that grew with
    the lanes."""
    return self._pending_on[lane]

  def _add_pending(self, pending, process: Process, lane: int, op: Compute) -> None:
    self._pending[pending] = (process, lane, op)
    self._pending_on[lane] += 1

  def _forget_pending(self, pending) -> tuple:
    """Takes `pending` out of `_pending`: its `(process, lane, op)`."""
    entry = self._pending.pop(pending)
    self._pending_on[entry[1]] -= 1
    return entry

  def _start_parked(self, lane: int) -> None:
    """Dispatches the tasks waiting for room on `lane`, first come first, while it has
    room (`start_task`)."""
    parked = self._parked.get(lane)
    while parked and self._unfinished_on(lane) < self.run_ahead:
      process, op = parked.popleft()
      self.start_task(process, lane, op)

  def when_ready(self, process: Process, value) -> None:
    """`Ready`: `process` goes on with `value` once every task still pending that made a
    handle in it has finished (a value moved to its lane exists once its copy is sent:
    the lane that reads it waits for it)."""
    making = {(p.lane, p.key): p for p in self._pending if p.source is None}
    tasks = {
      making[h.lane, h.key[0]]
      for h in _handles(value)
      if isinstance(h.key, tuple) and (h.lane, h.key[0]) in making
    }
    if not tasks:
      self.resume(process, value)
      return
    waiting = ReadyWait(process, value, tasks)
    for task in tasks:
      self._ready_waits.setdefault(task, []).append(waiting)
      self.pool.hasten(task)  # (its lane may hold its end while it has calls queued)

  def _record_copies(self, final: bool = False) -> None:
    """Records each copy whose exports are done, from when its value existed on the
    source lane to when it arrived on the receiving lane (`LanePool.exported`); its
    taking-in is part of the receiving lane's next call that reads it. `final`: a copy
    that never got that far (its source lane was lost) is recorded as sent, from the
    driver's clock."""
    if not self._copies:
      return
    waiting = []
    for copy in self._copies:
      span = self.pool.exported(copy.exports) if copy.exports else None
      if span is not None:
        start, end = span[0] - self._t0, span[1] - self._t0
      elif final or not copy.exports:  # (nothing was exported: every value was there)
        start, end = copy.issued, copy.sent
        self.pool.forget_exports(copy.exports)  # (part of it may have been seen done)
      else:
        waiting.append(copy)
        continue
      op = copy.op
      self.record(TaskRecord(copy.lane, op.kind, start, max(start, end), op.stage, op.batch))
    self._copies = waiting

  def _advance_ready(self) -> None:
    """Advances the ready processes until none is, or — while tasks are pending — for
    `_HEAR_LANES_S` at most, so that a finished task is heard even if processes never
    stop being ready. Running ahead, they can keep one another going without waiting for
    any lane: once PD-ASGD's steps were all claimed, its forward and backward workers
    passed tokens forever while the update that would end the run waited, unheard, for
    its lane (and the forward lane filled with unused passes)."""
    deadline = time.monotonic() + _HEAR_LANES_S
    while self._ready and self.failure is None:
      self.advance(*self._ready.popleft())
      if self.between_events is not None:
        self._drained_at = None
        self.between_events()
        if self._drained_at is not None:  # a checkpoint was taken: drained, then saved
          self.pauses.append(time.perf_counter() - self._drained_at)
          self._heard_now()
      if self._pending and time.monotonic() > deadline:
        return

  def resume(self, process: Process, value) -> None:
    self._ready.append((process, value))

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    spec = self.cluster.lanes[lane]
    if lane in self._lost_lanes:
      raise RuntimeError(f'{process.name}: yielded a Compute on a lost lane ({spec.name}).')
    if spec.link is not None:  # a Send's copy: lane to lane, not through the driver
      value, channel = op.args
      target = self._lane_names[channel.lane]
      if spec.link[0] in self._expendable:  # delivered once it has all landed
        _, landed = self.pool.move(value, target, landed=True)
        self._add_pending(landed, process, lane, op)
        return
      issued, exports = self.now(), []
      moved = self.pool.move(value, target, exports=exports)
      self._copies.append(_Copy(lane, op, issued, self.now(), exports))
      self.resume(process, moved)
      return
    task = op.fn.fn if isinstance(op.fn, HostInputs) else op.fn  # a lane takes host arrays
    if not isinstance(task, Task):
      raise TypeError(
        f'{process.name} yielded Compute({op.fn!r}); the process executor runs named '
        'tasks only (tasks.Task: a recipe and a name), which each lane builds itself.'
      )
    name = self._lane_names[lane]
    unfinished = self._unfinished_on(lane)
    if waits_for_room(op.ahead, self.run_ahead, unfinished):
      self._parked[lane].append((process, op))  # (dispatched once an end makes room)
      return
    if self._steady_mark is None and _in_steady_state(op.batch, self.steady_from_batch):
      self._steady_mark = (time.process_time(), self.dispatched)
    start, start_cpu = time.perf_counter(), time.thread_time()
    emulated = {}  # the task's priced duration, drawn as the virtual clock draws it
    if self._sampler is not None:
      emulated['seconds'] = self._sampler.duration(op.kind, op.stage, lane)
    ahead = op.ahead and unfinished < self.run_ahead  # (this one to come)
    pending = self.pool.start(name, task, op.args, ahead=ahead, **emulated)
    self._add_pending(pending, process, lane, op)
    early = self.pool.early(pending) if ahead else None
    self.dispatch_seconds += time.perf_counter() - start
    self.dispatch_cpu_seconds += time.thread_time() - start_cpu
    self.dispatched += 1
    if early is not None:  # the process goes on; the lane computes meanwhile
      self._resumed.add(pending)
      self.task_finished(process, _driver_view(early))

  def send(self, process: Process, op: Send) -> None:
    if op.channel.lane in self._lost_lanes:
      return  # nobody is left to read it
    super().send(process, op)

  # --- checkpoints at a drained point (module docstring) -----------------------------------
  def snapshot(self) -> dict:
    """The run between two ops, once every dispatched task has finished and every copy
    landed, in the in-process real clock's form (`RealExecutor.snapshot`)."""
    began = time.perf_counter()
    while self._pending:
      self._finished(self.pool.wait_any(list(self._pending)))
    self.pool.settle()
    self._record_copies(final=True)
    self._drained_at = began
    return self.drained_snapshot(self._ready)

  def save_handles(self, handles: list) -> list:
    """Each handle's value, exported by its lane (`LanePool.save`; `scheduler.snapshot`)."""
    return self.pool.save(handles)

  def restore_handle(self, cluster: Cluster, lane: str, payload: tuple) -> Handle:
    """A saved value put back on lane `lane` (a resumed run's: `scheduler.snapshot`)."""
    if self.pool is None or getattr(self, '_lane_names', None) is None:
      self._lane_names = self._map_lanes(cluster)
    return self.pool.restore(lane, payload)

  def _load(self, saved: dict) -> list:
    """The saved run put back (`load_drained`), the wall clock going on from its time."""
    self._t0 = time.time() - saved['now']
    return self.load_drained(saved)

  # --- lost workers -----------------------------------------------------------------------
  def _lose(self, error: LaneError) -> None:
    """Drops the lane `error` names if its loss is tolerated (module docstring); else
    raises `error`."""
    lane = self._lanes_by_name.get(error.lane)
    if lane not in self._expendable:
      raise error
    reason, lost_at = str(error), self.now()
    if self._replace(lane, error, reason, lost_at):
      return
    self._expendable.discard(lane)
    self._lost_lanes.add(lane)
    if self.copies_by_load is not None:
      self.copies_by_load.dropped(lane)
    if self.pool.has_process(error.lane):  # (a failed `replace` may have removed it)
      self.pool.remove(error.lane)
    closed = []
    self._drop_work_of(lane, error.lane)
    for process in self.processes:
      if process.lane == lane and not process.done:
        self._end(process)
        closed.append(process.name)
        process.program, process.done = process.on_lost(reason), False
        self._ready.append((process, None))
    self.lost.append(LostLane(error.lane, error.host, lost_at, reason, tuple(closed)))
    logging.warning(
      '%s; the run goes on without it (a lost worker is tolerated).', reason.rstrip('.')
    )

  def _replace(self, lane: int, error: LaneError, reason: str, lost_at: float) -> bool:
    """Starts a new lane process in place of lost `lane`, or keeps its process where only
    a value it took in was lost with another lane's (`LaneError.lost_input`: its own is
    sound, `LanePool.reset`), and its processes again from their `on_rejoin` states
    (module docstring); False if they have none or no new process could be started (the
    lane is then dropped, `_lose`)."""
    processes = [p for p in self.processes if p.lane == lane and not p.done]
    if not processes or any(p.on_rejoin is None for p in processes):
      return False
    kept = error.lost_input is not None and error.lane not in self.pool.dead_lanes()
    try:
      if kept:
        self.pool.reset(error.lane)
      else:
        self.pool.replace(error.lane)
    except (LaneError, ValueError, RuntimeError) as failure:
      logging.warning('%s; no new lane process in its place: %s', reason, failure)
      return False
    stranded = self._drop_work_of(lane, error.lane)
    # Values sent there are void with a replaced process; a kept one still holds them,
    # but its processes start again and will not take them.
    for channel in self.cluster.channels:
      if channel.lane == lane:
        stays = [item for item in channel.items if not _handles(item)]  # a STOP stays
        channel.items.clear()
        channel.items.extend(stays)
    for process in processes:
      state = process.on_rejoin(reason)
      if state is None and id(process) in stranded:
        raise RuntimeError(
          f'{process.name}: on_rejoin returned None (it goes on where it is), but it waited '
          f'for a task on lost lane {error.lane} that was dropped with it: nothing would '
          'wake it. A process that computes on its lane must start again from a state.'
        )
      if state is None:  # it holds nothing of the lost lane: it goes on where it is
        continue
      self._detach(process)
      process.restart(state)
      process.done = False
      self._ready.append((process, None))
    if not kept and self.copies_by_load is not None:
      self.copies_by_load.replaced(error.lane)
    names = tuple(p.name for p in processes)
    self.lost.append(LostLane(error.lane, error.host, lost_at, reason, names, self.now(), kept))
    pid, reason = self.pool.info[error.lane]['pid'], reason.rstrip('.')
    if kept:
      logging.warning('%s; its process (pid %s) goes on, its work started again.', reason, pid)
    else:
      logging.warning('%s; a new lane process (pid %s) took its place.', reason, pid)
    return True

  def _drop_work_of(self, lane: int, name: str) -> set[int]:
    """Forgets the tasks pending on lost lane `lane` (`name`) and the copies from it; the
    transfer processes of those copies end; of the processes waiting for room on it, those
    of other lanes end too (the lane's own are ended or started again by the caller).
    Returns the ids of the lane's own processes that waited for a task dropped here (for
    room, or for its end)."""
    stranded = set()
    for process, _ in self._parked.pop(lane, ()):
      if process.lane != lane:
        self._end(process)
      else:
        stranded.add(id(process))
    for pending, (process, _, _) in list(self._pending.items()):
      if name in (pending.lane, pending.source):
        self._forget_pending(pending)
        if pending in self._resumed:
          self._resumed.discard(pending)
        elif process.lane == lane:
          stranded.add(id(process))
        for waiting in self._ready_waits.pop(pending, ()):
          if waiting.process.lane != lane:  # (one of the lost lane's is restarted or closed)
            raise RuntimeError(
              f'{waiting.process.name}: waits (Ready) for a task of lost lane {name}.'
            )
        if process.lane != lane:  # a transfer process on a link from it
          self._end(process)
    for process, _ in list(self._ready):  # copies from or to it, not started yet
      link = self.cluster.lanes[process.lane].link
      if link is not None and lane in link:
        self._end(process)
    return stranded

  def _end(self, process: Process) -> None:
    """Closes `process` wherever it is: waiting on a channel, or ready to go on."""
    self._detach(process)
    process.close()

  def _detach(self, process: Process) -> None:
    """Takes `process` off the channel or the tasks it waits on and out of the ready
    queue."""
    if process.waiting_on is not None:
      process.waiting_on.waiters.remove(process)
      process.waiting_on = None
    for task, waits in list(self._ready_waits.items()):
      waits[:] = [w for w in waits if w.process is not process]
      if not waits:
        del self._ready_waits[task]
    self._ready = collections.deque((p, v) for p, v in self._ready if p is not process)
    for lane, parked in self._parked.items():  # (a process may compute on another lane)
      self._parked[lane] = collections.deque((p, op) for p, op in parked if p is not process)

  def needs_transfer(self, value, channel: Channel) -> bool:
    target = self._lane_names[channel.lane]
    return any(isinstance(h, Handle) and h.lane != target for h in _handles(value))

  def message_bytes(self, value) -> int:
    return LanePool.nbytes(value)

  # --- values for the driver ---------------------------------------------------------------
  def fetch(self, value):
    """`value` with every handle replaced by its value (numpy), fetched from its lane."""
    return jax.tree.map(
      lambda leaf: self.pool.fetch(leaf) if isinstance(leaf, Handle) else leaf,
      value,
      is_leaf=lambda x: isinstance(x, Handle),
    )

  def deferred(self, value):
    """A lane's scalar as an array-like fetched when first read (for `Run.report`); one
    in a lane that may be lost is exported to the driver at once (`LanePool.keep`), so
    that the report reads it even if the lane is lost before."""
    if not isinstance(value, Handle):
      return value
    kept = None  # (outside a run, nothing is expendable)
    if getattr(self, '_lanes_by_name', {}).get(value.lane) in getattr(self, '_expendable', ()):
      kept = self.pool.keep(value)
    return LaneValue(self, value, kept)


def _what(op: Compute) -> str:
  """`op` as a report names it: its kind, stage and batch."""
  stage = '' if op.stage is None else f' of stage {op.stage}'
  batch = '' if op.batch is None else f', batch {op.batch}'
  return f'{op.kind}{stage}{batch}'


def _in_steady_state(batch: int | None, steady_from: int | None) -> bool:
  """Whether a task of `batch` is in `ProcessExecutor.steady_from_batch`'s steady state."""
  return steady_from is not None and batch is not None and batch >= steady_from


@dataclasses.dataclass(frozen=True)
class _Copy:
  """A `Send`'s copy on its way: its link lane and op, when the driver sent it (from
  `issued` to `sent`, its clock) and its exports' references (`LanePool.move`)."""

  lane: int
  op: Compute
  issued: float
  sent: float
  exports: list


@dataclasses.dataclass(frozen=True)
class LostLane:
  """A lane lost during a run whose loss was tolerated: which, where, when (seconds
  since the start), why, and the processes it ran; `replaced_at`: when a new lane
  process was up in its place, or its processes started again in the process it kept
  (`kept_process`: a task of it failed only for a value of another lane's lost process);
  None: the run went on without it."""

  lane: str
  host: str
  at: float
  reason: str
  processes: tuple[str, ...]
  replaced_at: float | None = None
  kept_process: bool = False


class LaneValue:
  """A value in a lane, fetched on first `np.asarray` (the report's logging point)."""

  def __init__(self, executor: ProcessExecutor, handle: Handle, kept=None):
    self._executor, self._handle, self._value = executor, handle, None
    self._kept = kept  # `LanePool.keep`'s reference, for a lane that may be lost
    self.lost = False  # its lane was lost before it was exported: NaN, known as lost

  def is_ready(self) -> bool:
    """Whether reading it now costs no wait: fetched already, one number that came with
    its task's reply (`LanePool.scalar`: a loss), or its lane is idle. A
    fetch runs after every call sent to the lane before it; the loss checks between
    logging points (`Run.check_losses`) read only ready values, so that they never wait
    for a lane that has tasks queued. They did: with run-ahead, one ASGD worker's lane
    held a dozen queued batches, each check waited for all of them, and meanwhile the
    other worker's next task was not started (its backward began 2.4 s after its
    forward ended, and it pushed 2 of 60 updates)."""
    pool = self._executor.pool
    if self._value is not None or pool is None:
      return True
    if self._kept is not None:
      return pool.kept_ready(self._kept)
    return pool.scalar(self._handle) is not None or pool.idle(self._handle.lane)

  def __array__(self, dtype=None, copy=None):
    del copy
    if self._value is None:
      pool = self._executor.pool
      if self._kept is not None:
        kept = pool.kept(self._kept)
        self.lost = kept is None
        self._value = np.asarray(np.nan if self.lost else kept)
      else:
        scalar = None if pool is None else pool.scalar(self._handle)
        value = self._executor.fetch(self._handle) if scalar is None else scalar
        self._value = np.asarray(value)
      self._handle = self._kept = None
    return self._value if dtype is None else self._value.astype(dtype)

  def __float__(self):
    return float(self.__array__())


def _handles(value) -> list:
  return [
    leaf
    for leaf in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, Handle))
    if isinstance(leaf, Handle)
  ]


_EMPTY = {'NoneType': lambda: None, 'dict': dict, 'tuple': tuple, 'list': list}


def _driver_view(result):
  """Handles of values without arrays (None, {}) as those values: policies test them
  (`dx is not None`, `{**state}`), and there is nothing in the lane to refer to."""
  if isinstance(result, tuple):
    parts = [_driver_view(part) for part in result]
    return type(result)(*parts) if hasattr(result, '_fields') else tuple(parts)  # a NamedTuple
  if isinstance(result, Handle) and result.nbytes == 0 and ' leaves #' in result.description:
    kind, _, rest = result.description.partition('(')
    if rest.startswith('0 leaves') and kind in _EMPTY:
      return _EMPTY[kind]()
  return result
