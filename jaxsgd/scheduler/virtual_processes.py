"""The process executor's schedule on the virtual clock: lanes as processes, simulated.

`LaneProcessModel(run_ahead=N)` (`cost.host`: a process executor's host profile) is
`VirtualExecutor` with
the schedule of the process executor (`process.py`), whose driver lets a process go on
once its task is dispatched and its lanes compute behind it:

      start_task(p, op)    → if op may run ahead (`op.ahead`, N ≥ 2) and its lane
                             already has N unfinished tasks: op waits for room, and is
                             started again once an end heard there makes it; else queue
                             op on its lane, and if it runs ahead or is a copy: compute
                             op's result now and resume(p, result) at once
      a task starts        when its lane is free and every task that put what it reads
                           on its lane has ended (the task that made it there, or the
                           copy that sent it there); a lane waits for its next task's
                           inputs, as a lane process waits for its imports, and lanes
                           sharing hardware take it in dispatch order among the lanes
                           whose next task can start (one lane's wait does not hold the
                           device: a lane process waiting for an import does not); a
                           sender's copies on one queue (`copies_on_sender`) run one at a
                           time (one export thread), the earliest whose value exists
                           first, each holding it for its export (`cost.export`; without
                           it, the whole copy) and then going on over its socket; otherwise
                           copies to different lanes go on their own links
      a task that reads    another compute lane's result (not sent to it) first pays a
                           copy over the link, as a lane process imports a handle
      a task that starts   first takes in (`cost.take_in`, on its lane, before its cost)
                           each message copied to its lane that it is the first there to
                           read — its imports, and what was sent there — however early
                           the copy arrived, as a lane process takes in a copy at the
                           first call that reads it; with `copies_on_sender` the
                           take-in holds the lane's interpreter, the queue of its
                           copies: it waits for the copy in progress, and the lane's
                           next copy waits for it (`_interpreter`); at a task's end the
                           lane's next task, if it can start, takes in before the
                           copies of the result (`_finish`)
      a task ends          → its lane sends its end, after the ends it holds; it holds
                           instead the end of a task whose process went on at dispatch
                           while `HOLD_WHILE_QUEUED` (2) of the lane's next tasks have
                           reached it (`_reply`), unless a `Ready` asked for it
                           (`_hasten`, `driver_latency` after the `Ready`), as a lane
                           process holds such a reply while that many calls are queued;
                           and sends what it holds if its next task, come, waits for an
                           input made elsewhere (`_next_waits_for_input`) with fewer than
                           two calls behind it, as a lane process does before it waits
                           for a copy

With a simulated driver (the host profile's `driver`: seconds per event, `driver_latency`: each
message's way), the process executor's driver thread is one more FIFO resource:

      start_task(p, op)    → the driver handles the dispatch (FIFO, `driver` s; then
                           `TaskRecord.dispatched`), then as above; op reaches its lane
                           `driver_latency` later (it and the copies it imports start no
                           earlier)
      a task's end         → reaches the driver `driver_latency` after its lane sent it,
                           is heard once the driver has handled it (FIFO, `driver` s):
                           only then does its lane count one unfinished task fewer and a
                           process that waited for it go on (`TaskRecord.heard`); a
                           copy's end is not heard

The driver's time per event is one figure, whether the event woke it or came while it
was busy with another. Held ends reach the driver together, so this model sees the cost
of holding (those ends are heard later) but not what holding saves: the driver's
process executor measured ~0.6 ms of CPU per task woken by each end against ~0.1 ms for
ends that come together (`benchmarks/driver_cpu.py`), CPU taken from the lanes' cores
where the driver shares them.

Results are tracked by array identity (a weak reference per leaf): what a task made,
where it is (and which copy put it on each lane it was sent to), and whether it exists
yet. A task waits only for tasks dispatched before it, and each lane runs its tasks in
dispatch order, so the earliest queued task can always start once the tasks before it
end: running ahead cannot deadlock. A value computed by the driver from a running
task's result (outside any task) is not tracked: such policies take their lane-process
forms in this mode (`SharedSettings.lane_processes`), where every computation is a task.

A queued task carries its `_Job` (`VirtualExecutor`'s `extra`): what it waits for, its
result if its process went on with it, and whether it has ended. Tasks in flight are not
data: a run of this schedule takes no checkpoint.
"""

import collections
import math
import weakref

import jax

from jaxsgd.scheduler import snapshot as snapshot_lib
from jaxsgd.scheduler.core import Compute, Process
from jaxsgd.scheduler.costs import TRANSFER, CostModel
from jaxsgd.scheduler.executor import RUN_AHEAD, ReadyWait, holds_ends, waits_for_room
from jaxsgd.scheduler.timeline import TaskRecord
from jaxsgd.scheduler.virtual import VirtualExecutor


class LaneProcessModel(VirtualExecutor):
  """The virtual clock with the process executor's schedule (module docstring): a process
  goes on at its task's dispatch while its lane has at most `run_ahead` unfinished tasks,
  and waits for room on it before that."""

  def __init__(self, cost_model: CostModel, *, run_ahead: int = RUN_AHEAD, **hardware):
    """`run_ahead`: the process executor's bound (`executor.RUN_AHEAD`; 0: every process
    waits for its task, as that executor's then). `hardware`: `VirtualExecutor`'s
    `lane_hardware` and `copies_on_sender`."""
    if run_ahead < 0:
      raise ValueError(f'run_ahead: unfinished tasks per lane >= 0, got {run_ahead!r}.')
    self.run_ahead = run_ahead
    super().__init__(cost_model, **hardware)

  def begin(self) -> None:
    super().begin()
    self._unfinished: dict[int, int] = {}  # compute lane -> its unfinished tasks
    self._made: dict[int, _Made] = {}  # id of a result leaf -> where, by which task
    self._driver_free = 0.0  # when the simulated driver has handled every event so far
    self._held: dict[int, list] = {}  # compute lane -> the ends it holds (`_reply`)
    # compute lane -> (process, op) of the tasks that wait for room on it (`_start_ahead`),
    # and the ops given room, counted on their lane already (`_heard`)
    self._parked: dict[int, collections.deque] = {}
    self._given_room: set[int] = set()
    self._take_in_waiting: dict = {}  # a lane's interpreter -> hardware whose task waits
    # A copy holds its sender's interpreter for its export alone (`_exported`).
    self._copies_let_go = self.copies_on_sender and self.cost_model.export is not None

  def snapshot(self) -> dict:
    raise snapshot_lib.NotResumableError(
      'checkpoint: a run-ahead schedule (cost.host) keeps tasks in flight.'
    )

  # --- the driver -----------------------------------------------------------------------
  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    if self.cost_model.simulates_driver:
      self._on_driver(self._dispatched, process, lane, op)  # the driver dispatches it
    else:
      self._start_ahead(process, lane, op)

  def _on_driver(self, fn, *args) -> None:
    """Runs `fn(*args)` once the simulated driver has handled this event: one host
    thread, `cost_model.driver` seconds per event, events in the order they arrive (a
    FIFO single server; the host profile's `driver`)."""
    self._driver_free = max(self._now, self._driver_free) + self.cost_model.driver
    self._at(self._driver_free, fn, *args)

  def _dispatched(self, process: Process, lane: int, op: Compute) -> None:
    """The driver has dispatched `op`: its process goes on as running ahead says, and
    the task reaches its lane `driver_latency` later."""
    latency = self.cost_model.driver_latency
    self._start_ahead(process, lane, op, arrives=self._now + latency if latency else None)

  def _task_ended(self, process, op, lane, start, result, job: '_Job') -> None:
    """What reads the task's result may start at once (lanes take their inputs from one
    another); its lane sends its end now (`_reply`) or holds it (a task its process went
    on without, while two of the lane's next tasks have reached it) until its next reply.
    A copy's end is heard at once: the process executor does not wait for it."""
    job.done = True
    record = (lane, op.kind, start, self._now, op.stage, op.batch)
    if self.cluster.lanes[lane].link is not None:
      self.record(TaskRecord(*record))
      self._heard(process, job, lane, result)
      return
    end = (process, job, lane, result, record)
    if job.ahead and holds_ends(job.queued_behind) and not job.hastened:  # held
      self._held.setdefault(lane, []).append(end)
      job.held = True
      return
    self._reply(lane, end)

  def _reply(self, lane: int, *ends: tuple) -> None:
    """Compute lane `lane` sends the ends it held, then `ends`, in order: each is heard
    at once, or with a simulated driver once it has reached the driver and waited for
    its turn. A lane holds the end of a task its process went on without while two calls
    have reached it behind it (`LaneRuntime._answer`: the lane process sends it with the
    next end it sends at once)."""
    for process, job, _, result, record in [*self._held.pop(lane, ()), *ends]:
      job.held = False
      if not self.cost_model.simulates_driver:
        self.record(TaskRecord(*record))
        self._heard(process, job, lane, result)
        continue
      heard = (self._heard, process, job, lane, result, record)  # recorded when heard
      if self.cost_model.driver_latency:
        self._at(self._now + self.cost_model.driver_latency, self._on_driver, *heard)
      else:
        self._on_driver(*heard)

  def _hasten(self, job: '_Job') -> None:
    """The driver's request for `job`'s end has reached its lane (a `Ready` waits for
    it): held, it is sent now with those held before it; not ended yet, it will be sent
    at its end."""
    if job.held:
      self._reply(job.lane)
    elif not job.done:
      job.hastened = True

  def _heard(self, process: Process | None, job: '_Job', lane: int, result, record=None) -> None:
    """The driver hears that `job` has ended on `lane` (when its lane sent the end, or
    once the simulated driver has handled it: `record`, the task's first `TaskRecord`
    fields, is then recorded with when it was heard and dispatched): the lane has one task
    fewer unfinished — room for the first task waiting for it there, dispatched now — and
    a process that waited for the task goes on with its result."""
    if record is not None:
      self.record(TaskRecord(*record, self._now, job.dispatched))
    if self.cluster.lanes[lane].link is None:
      self._unfinished[lane] -= 1
      parked = self._parked.get(lane)
      if parked and self._unfinished[lane] < self.run_ahead:  # room for the first waiting
        waiting, waiting_op = parked.popleft()
        # Its room is taken now, as the process executor dispatches it now: a dispatch the
        # simulated driver handles before this one's does not take it.
        self._unfinished[lane] += 1
        self._given_room.add(id(waiting_op))
        self.start_task(waiting, lane, waiting_op)
    if not job.ahead:
      self._note(job, lane, result)  # its process sees it only now
    job.result = None  # the process has it; the executor keeps no result of an ended task
    if process is not None and not job.ahead:
      self.task_finished(process, result)
    readies, job.readies = job.readies, None
    for waiting in readies or ():
      if waiting.ended(id(job)):
        self.resume(waiting.process, waiting.value)

  def when_ready(self, process: Process, value) -> None:
    """`Ready`: `process` goes on with `value` once the driver has heard the end of every
    compute task that made an array in it (as the process executor's `when_ready`)."""
    jobs = {}
    for made in map(self._made_of, _arrays(value)):
      if made is not None and made.job.readies is not None:
        jobs[id(made.job)] = made.job
    if not jobs:
      self.resume(process, value)
      return
    waiting = ReadyWait(process, value, set(jobs))
    latency = self.cost_model.driver_latency
    for job in jobs.values():
      job.readies.append(waiting)
      if job.lane is not None:  # its lane may hold its end: asked for at once
        if latency:
          self._at(self._now + latency, self._hasten, job)
        else:
          self._hasten(job)

  # --- the lanes ------------------------------------------------------------------------
  def _start_ahead(
    self, process: Process, lane: int, op: Compute, arrives: float | None = None
  ) -> None:
    """Queues `op` behind the tasks whose results it reads (and the copies of those made
    on other lanes); the process goes on now if the lane may run that far ahead.
    `arrives`: when the task reaches its lane (`driver_latency`); neither it nor the
    copies it needs can start before."""
    spec = self.cluster.lanes[lane]
    given_room = id(op) in self._given_room
    self._given_room.discard(id(op))
    unfinished = self._unfinished.get(lane, 0)
    if spec.link is None and not given_room:
      if waits_for_room(op.ahead, self.run_ahead, unfinished):  # (room: `_heard`)
        self._parked.setdefault(lane, collections.deque()).append((process, op))
        return
    leaves = _arrays(op.args)
    message = []
    if arrives is not None:  # the dispatch on its way to the lane: a job that ends then
      message = [_Job([])]
      self._at(arrives, self._arrived, message[0])
    imports = self._imports(leaves, lane, message) if spec.link is None else []
    job = _Job(imports + message)
    job.dispatched = self._now  # (recorded with a simulated driver: its driver sent it now)
    job.message = message[0] if message else None
    reads_at = lane if spec.link is None else spec.link[0]  # a copy reads at its source
    owed = {id(copy): copy for copy in imports}  # copies this task takes in, if first
    for made in map(self._made_of, leaves):
      if made is not None:  # what put it where this task reads it
        waits = made.at.get(reads_at, ())
        if reads_at == made.lanes[0] or not waits:
          waits = (made.job, *waits)
        job.inputs += [j for j in waits if not j.done]
        if spec.link is None:  # the copies that brought it here, not yet taken in
          copies = [*made.at.get(reads_at, ())]
          if made.lanes[0] == reads_at:  # (made here by a copy: a Send's new arrays)
            copies.append(made.job)
          owed.update((id(copy), copy) for copy in copies if copy.owes)
    if spec.link is None:
      self._unfinished[lane] = self._unfinished.get(lane, 0) + (not given_room)
      job.owed = list(owed.values())
      job.lane = lane
      job.readies = []  # (heard when it ends: `_heard`)
    elif self.cost_model.take_in is not None:  # a Send: its receiver's first reader takes it in
      job.owes = self.cost_model.take_in_time(op.nbytes, op.arrays)
    job.ahead = spec.link is not None or (op.ahead and self._unfinished[lane] <= self.run_ahead)
    if job.ahead:
      job.result = op.fn(*op.args)
      self._note(job, lane, job.result)
    self._enqueue((process, lane, op, job))
    if job.ahead:
      self.resume(process, job.result)

  def _imports(self, leaves: list, lane: int, message: list) -> list:
    """The copies `leaves` need to reach compute lane `lane`: one per lane they were made
    on, queued now on its link (a lane process imports each handle a task reads), each
    after the task's `message` has reached the lane, if one is on its way."""
    sources: dict[int, list] = {}  # lane made on -> [(array, its _Made)]
    for leaf in leaves:
      made = self._made_of(leaf)
      if made is not None and lane not in made.lanes:
        sources.setdefault(made.lanes[0], []).append((leaf, made))
    copies = []
    for source, arrays in sources.items():
      link = self.cluster.link(source, lane)
      nbytes = sum(a.nbytes for a, _ in arrays) if self.cost_model.prices_bytes else 0
      copy = _Job([made.job for _, made in arrays if not made.job.done] + message)
      copy.result = ()
      copy.owes = self.cost_model.take_in_time(nbytes, len(arrays))
      if not math.isfinite(self.cost_model.link_bandwidth):
        nbytes = 0  # (a free link: its bytes cost nothing)
      moved = Compute(None, kind=TRANSFER, lane=link, nbytes=nbytes, arrays=len(arrays))
      self._enqueue((None, link, moved, copy))
      copies.append(copy)
    return copies

  def _next_startable(self, hardware, queue) -> int | None:
    """The earliest queued task whose inputs have ended and that is its lane's next (each
    lane runs its tasks in order), or the earliest such copy (a lane process exports in
    one thread, in the order asked, but parks an export whose value is not made yet: it
    holds up no copy behind it): a lane whose next task waits for a result does not hold
    up another lane sharing the hardware (two lane processes on one core; a lane process
    waiting for an import does not occupy its device). None if every lane's next task and
    every copy waits for a task still running; each such task then starts `hardware`
    again when it ends (`_Job.blocked`). A task that takes in waits for its lane's
    interpreter, and a sender's copies for a take-in waiting for theirs
    (`_interpreter`)."""
    if hardware in self._take_in_waiting:
      return None  # a take-in waits for this interpreter: it goes first
    seen, lanes = set(), self.cluster.lanes
    for index, (_, lane, _, job) in enumerate(queue):
      if lane in seen:
        continue  # not the next of its lane
      if lanes[lane].link is None:
        seen.add(lane)
      missing = next((j for j in job.inputs if not j.done), None)
      if missing is not None:
        missing.blocked[hardware] = None  # started again when `missing` ends
        continue
      interpreter = self._interpreter(lane)
      if interpreter in self._busy and any(copy.owes for copy in job.owed):
        self._take_in_waiting[interpreter] = hardware  # started again when it is free
        continue
      return index
    return None

  def _compute(self, queued: tuple):
    """The result computed when the process ran ahead, else computed now; the copies it
    is the first on its lane to read are taken in now (`_duration`). The job lets go of
    its inputs, which have ended: kept, a chain of jobs would keep every result alive."""
    job = queued[3]
    result = job.result if job.result is not _NOT_YET else super()._compute(queued)
    job.inputs = ()
    for copy in job.owed:  # each taken in once, by the first task that reads it
      job.take_in += copy.owes
      copy.owes = 0.0
    job.owed = ()
    interpreter = self._interpreter(queued[1])
    if job.take_in and interpreter is not None:  # the take-in holds it, the task not
      self._take_in_waiting.pop(interpreter, None)
      self._busy.add(interpreter)
      self._at(self._now + job.take_in, self._take_in_ended, interpreter)
    return result

  def _duration(self, queued: tuple) -> float:
    """The task's cost, after the copies it takes in (a copy's own: its link's)."""
    job = queued[3]
    if self.cluster.lanes[queued[1]].link is not None:
      return super()._duration(queued)
    return job.take_in + super()._duration(queued)

  def _finish(self, process, op, lane, start, result, job: '_Job') -> None:
    """`VirtualExecutor._finish`, where a lane process's next call goes first: at a
    task's end it replies to the driver, wakes the export thread for its result, and
    its call thread, still holding the interpreter, takes its next call if one is
    queued and takes in what that reads (`LaneRuntime._run_calls`, `_made`); the copies
    run after that take-in, then whatever the end sets going (what a process dispatches
    on hearing of it reaches the lane later). Started after the copies (as the lane ran
    before it replied first), a parameter server's update waited for its copy of the
    parameters to a worker, and the server idled 1.5 ms between updates where its lane
    process idled 0.5. (Not `super()._finish`: it frees the hardware after the next
    task may have taken it.)"""
    hardware, interpreter = self._hardware(lane), self._interpreter(lane)
    job.queued_behind = self._calls_arrived(hardware, lane)  # (before the next starts)
    next_waits = self._next_waits_for_input(hardware, lane, job)
    if job.holding:  # (a copy past its export holds nothing: `_exported`)
      self._busy.discard(hardware)
    if interpreter is not None:
      job.done = True
      self._start_if_free(hardware)
      self._hand_interpreter(interpreter)  # the copies the end woke
    self._task_ended(process, op, lane, start, result, job)
    # The next call is one of those that arrived: it waits with the others behind it.
    if next_waits and not holds_ends(job.queued_behind - 1) and lane in self._held:
      self._reply(lane)  # it waits, its queue short: what it held goes now (`send_held`)
    self._start_if_free(hardware)
    self._arrived(job)  # lanes whose next task read this one's result
    if self.cluster.lanes[lane].link is not None and job.holding:  # its sender's interpreter
      job.holding = False
      self._hand_interpreter(hardware)

  def _next_waits_for_input(self, hardware, lane: int, ending: '_Job') -> bool:
    """Whether compute lane `lane`'s next task, as `ending` ends there, has reached it
    and waits for an input made elsewhere (a copy not yet come, or the task on another
    lane that makes it): its call thread then waits, and sends the ends it holds first
    (`LaneRuntime.send_held`)."""
    if self.cluster.lanes[lane].link is not None:
      return False
    for _, queued_lane, _, job in self._queued.get(hardware, ()):
      if queued_lane == lane:
        arrived = job.message is None or job.message.done
        waits = [j for j in job.inputs if not j.done and j is not job.message and j is not ending]
        return arrived and bool(waits)
    return False

  def _calls_arrived(self, hardware, lane: int) -> int:
    """How many tasks of compute lane `lane` are queued behind the one ending whose
    dispatch has reached the lane (a lane process holds an end while `HOLD_WHILE_QUEUED`
    calls are in its queue, whatever they wait for)."""
    if self.cluster.lanes[lane].link is not None:
      return 0
    return sum(
      queued_lane == lane and (job.message is None or job.message.done)
      for _, queued_lane, _, job in self._queued.get(hardware, ())
    )

  def _occupy(self, hardware, seconds: float, running: tuple) -> None:
    """`VirtualExecutor._occupy`; a copy lets go of its sender's interpreter once its
    export is done (`_exported`)."""
    export = self._export_seconds(running)
    if export is not None:
      self._at(self._now + export, self._exported, hardware, running[-1])
    super()._occupy(hardware, seconds, running)

  def _export_seconds(self, running: tuple) -> float | None:
    """The seconds of a running copy's export (`cost.export`), after which it lets go of
    its sender; None for a task, or without that figure (a copy holds it to its end)."""
    op, lane = running[1], running[2]
    if not self._copies_let_go or self.cluster.lanes[lane].link is None:
      return None
    return self.cost_model.export_time(op.nbytes, op.arrays)

  def _exported(self, hardware, job: '_Job') -> None:
    """A copy's sender has written it (`cost.export`: its export thread's time): the
    sender's interpreter and copies' queue (`hardware`) are free for its take-ins and
    next copy while the copy goes on over the socket to its receiver, as a lane process's
    export thread, blocked in a socket write, lets its other threads run. Held for the
    whole copy, a parameter server's update took in its gradient only once the copy of
    the parameters to a worker had ended: every second update (ASGD M=8) started 2.8 ms
    after the one before, where its lane process took 2.0-2.5 ms
    (`benchmarks/results/schedule_error.md`)."""
    if job.holding:
      job.holding = False
      self._busy.discard(hardware)
      self._hand_interpreter(hardware)

  # --- a lane process's interpreter -----------------------------------------------------
  def _interpreter(self, lane: int) -> tuple | None:
    """What compute lane `lane`'s take-ins share with its copies (`copies_on_sender`): the
    queue of its copies. A lane process exports (its export thread) and takes in (its
    call thread, before a task) in one Python interpreter, whose lock lets one of them run
    at a time; its device computes beside both. None without `copies_on_sender` (each
    copy on a link of its own), or for a link."""
    if not self.copies_on_sender or self.cluster.lanes[lane].link is not None:
      return None
    return ('copies', lane)

  def _take_in_ended(self, interpreter: tuple) -> None:
    self._busy.discard(interpreter)
    self._hand_interpreter(interpreter)

  def _hand_interpreter(self, interpreter: tuple) -> None:
    """If `interpreter` is free: a task whose take-in waits for it starts first, then the
    next copy."""
    if interpreter in self._busy:
      return
    waiting = self._take_in_waiting.pop(interpreter, None)
    if waiting is not None:
      self._start_if_free(waiting)
    self._start_if_free(interpreter)

  def _arrived(self, job: '_Job') -> None:
    """`job` is done (a task ended, or a dispatched task reached its lane): the lanes
    whose next task waited for it may start."""
    job.done = True
    for waiting in job.blocked:
      self._start_if_free(waiting)

  # --- where results are ----------------------------------------------------------------
  def _made_of(self, leaf) -> '_Made | None':
    made = self._made.get(id(leaf))
    return made if made is not None and made.ref() is leaf else None

  def _note(self, job: '_Job', lane: int, result) -> None:
    """Records where `result`'s arrays are (a copy's: at its destination as well) and
    that `job` makes them."""
    spec = self.cluster.lanes[lane]
    where = lane if spec.link is None else spec.link[1]
    made_here = self._made
    for leaf in _arrays(result):
      key, made = id(leaf), self._made_of(leaf)
      if made is None:
        ref = weakref.ref(leaf, lambda dead, key=key: _forget(made_here, key, dead))
        made_here[key] = _Made(ref, [where], job)
      else:  # the same array, sent on (a copy to its device)
        # Readers on `where` wait for this copy (and the other unfinished copies to
        # `where`: one array object stands for every copy of it, so which one brought a
        # reader its message is not known; waiting for all is never early); readers
        # elsewhere do not (the sender's next task, a copy to a third lane).
        copies = made.at.get(where)  # (a copy still owing its take-in stays)
        made.at[where] = [j for j in copies if not j.done or j.owes] + [job] if copies else [job]
        if where not in made.lanes:
          made.lanes.append(where)


_NOT_YET = object()  # a task's result, not computed yet


class _Job:
  """A task of a run-ahead schedule: the tasks it waits for (`inputs`), its result once
  computed, whether its process went on with it at dispatch (`ahead`), whether it has
  ended, and the hardware whose next task waits for it (`blocked`, in order). Taking in:
  a copy `owes` the seconds its receiving lane spends taking it in, until a task there
  reads it; a compute task's `owed` are the copies it may be the first to read, and its
  `take_in` the seconds it paid for them at its start. `readies`: while a compute task's
  end is not heard yet, the `Ready`s waiting for it (None once heard, and for a copy).
  `holding`: whether it holds its hardware (a copy: its sender's, until exported);
  `dispatched`: when its driver sent it (`TaskRecord.dispatched`)."""

  __slots__ = (
    'inputs',
    'result',
    'ahead',
    'done',
    'blocked',
    'take_in',
    'owed',
    'owes',
    'readies',
    'holding',
    'dispatched',
    'message',
    'lane',
    'queued_behind',
    'held',
    'hastened',
  )

  def __init__(self, inputs: list):
    self.inputs, self.result, self.ahead, self.done, self.blocked = (
      inputs,
      _NOT_YET,
      False,
      False,
      {},
    )
    self.take_in, self.owed, self.owes, self.readies = 0.0, (), 0.0, None
    self.holding = True  # its hardware (a copy: its sender's interpreter, until exported)
    self.dispatched = None  # when its driver sent it (seconds)
    self.message = None  # the dispatch on its way to the lane (`driver_latency`), if any
    self.lane = None  # a compute task's lane
    # How many calls its lane had queued behind it when it ended; whether it holds its
    # end; whether the driver asked for it.
    self.queued_behind, self.held, self.hastened = 0, False, False


class _Made:
  """Where a result array is (the lane that made it first, then those it was sent to), the
  task that made it (`job`) and, per lane it was sent to, the copies that put it there
  (`at`, the first lane included: a copy sent back): a task reads it once what put it
  on its lane has ended."""

  __slots__ = ('ref', 'lanes', 'job', 'at')

  def __init__(self, ref, lanes: list, job: _Job):
    self.ref, self.lanes, self.job, self.at = ref, lanes, job, {}


def _forget(made: dict, key: int, dead) -> None:
  entry = made.get(key)
  if entry is not None and entry.ref is dead:
    del made[key]


def _arrays(tree) -> list:
  """The arrays among `tree`'s leaves (what a task reads or makes)."""
  return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
