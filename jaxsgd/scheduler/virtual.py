"""The virtual clock: a deterministic discrete-event simulation of a cluster.

Every task still runs its real JAX computation, but *when* it runs is decided by
simulated time. A task starts when its lane is free (FIFO among waiters); at its
start the executor calls `fn(*args)` (JAX dispatches it asynchronously and the
simulation moves on without waiting) and draws its duration from the
`CostModel`; at its end the process resumes with the result and publishes it.
Events at equal times run in the order they were scheduled, so a run depends on
nothing but the programs, the costs and the seed: same seed, same bits.

    now = 0; schedule(advance every process at 0)
    while events: pop the earliest (time, seq) event; now = time; run it
      resume(p, value)     → schedule advance(p, value) now (after what is scheduled)
      start_task(p, op)    → start now if the lane is free, else queue on the lane (lanes
                             that share hardware, `LaneSpec.shares`, share one queue)
      finish(task)         → lane free; advance(p, result) at once; start the lane's
                             next waiter

What the ops mean (channels, transfers over link lanes) is the `Executor` base's.

Running ahead (`run_ahead=N`, `cost.schedule='run_ahead'`): the schedule of the process
executor (`process.py`), whose driver lets a process go on once its task is dispatched
and its lanes compute behind it:

      start_task(p, op)    → queue op on its lane; if the lane now has at most N
                             unfinished tasks (op included, `op.ahead`) or it is a copy:
                             compute op's result now and resume(p, result) at once
      a task starts        when its lane is free and every task that put what it reads
                           on its lane has ended (the task that made it there, or the
                           copy that sent it there); a lane waits for its next task's
                           inputs, as a lane process waits for its imports, and lanes
                           sharing hardware take it in dispatch order among the lanes
                           whose next task can start (one lane's wait does not hold the
                           device: a lane process waiting for an import does not); a
                           sender's copies on one queue (`copies_on_sender`) run in the
                           order sent (one export thread); on links (`cost.copies=
                           'link'`) copies to different lanes go on their own links
      a task that reads    another compute lane's result (not sent to it) first pays a
                           copy over the link, as a lane process imports a handle

With a simulated driver (`cost.driver`: seconds per event, `cost.driver_latency`: each
message's way), the process executor's driver thread is one more resource:

      start_task(p, op)    → the driver handles the dispatch (FIFO, `driver` s), then
                           as above; op reaches its lane `driver_latency` later (it and
                           the copies it imports start no earlier)
      a task's end         → reaches the driver `driver_latency` later, is heard once the
                           driver has handled it (FIFO, `driver` s): only then does its
                           lane count one unfinished task fewer and a process that waited
                           for it go on (`TaskRecord.heard`); a copy's end is not heard

Results are tracked by array identity (a weak reference per leaf): what a task made,
where it is (and which copy put it on each lane it was sent to), and whether it exists
yet. A task waits only for tasks dispatched before it, and each lane runs its tasks in
dispatch order, so the earliest queued task can always start once the tasks before it
end: running ahead cannot deadlock. A value computed by the driver from a running
task's result (outside any task) is not tracked: such policies take their lane-process
forms in this mode (`SharedSettings.lane_processes`), where every computation is a task.

Checkpoints: `between_events` (if set) is called after every event, where the whole
state is data: `snapshot()` returns it (the event queue as 'advance process P with V'
and 'the task of P on lane L, started at s, ends at t with result R', the queued tasks
per hardware, channel items and waiters, the sampler's random streams, the timeline),
and `run(..., resume=snapshot)` continues from it: every process is started again from
its saved `LoopState` and re-yields its pending op, which goes back where it was.
"""

import heapq
import itertools
import math
import weakref
from collections import deque
from collections.abc import Mapping

import jax
import numpy as np

from jaxsgd.scheduler import snapshot as snapshot_lib
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Compute, Process
from jaxsgd.scheduler.costs import TRANSFER, CostModel
from jaxsgd.scheduler.executor import Executor, expect_op
from jaxsgd.scheduler.placement import lane_name
from jaxsgd.scheduler.timeline import TaskRecord


class VirtualExecutor(Executor):
  """Runs processes in simulated time with durations from `cost_model`."""

  clock = 'virtual'

  def __init__(
    self,
    cost_model: CostModel,
    *,
    lane_hardware: Mapping[str, str] | None = None,
    copies_on_sender: bool = False,
    time_sliced: bool = False,
    run_ahead: int = 0,
  ):
    """`lane_hardware`: placement lane name (`placement.lane_name`) -> hardware key, for
    lanes placed on one piece of hardware (`placement.lanes`) beyond `LaneSpec.shares`.
    `copies_on_sender`: a transfer occupies the sending lane's hardware (FIFO with its
    tasks), not a link of its own (`cost.copies='sender'`). `time_sliced`: lanes that
    `lane_hardware` puts on one piece of hardware share it as an operating system shares
    a core between processes (`cost.sharing='time_slice'`, `_TimeSlicedCore`): each lane
    runs its own tasks one at a time, and the n tasks running on the core at once each
    progress at 1/n of its speed. `run_ahead`: 0, a process goes on when its task ends;
    N > 0, the process executor's schedule (module docstring): it goes on at the
    task's dispatch while its lane has at most N unfinished tasks."""
    if run_ahead < 0:
      raise ValueError(f'run_ahead: unfinished tasks per lane >= 0, got {run_ahead!r}.')
    if cost_model.simulates_driver and not run_ahead:
      raise ValueError(
        f'cost.driver / cost.driver_latency: {cost_model.driver!r} / '
        f"{cost_model.driver_latency!r} s simulate the process executor's driver, whose "
        "schedule is run_ahead > 0 (cost.schedule='run_ahead'); give run_ahead, or set both "
        'to 0.'
      )
    self.run_ahead = run_ahead
    self.cost_model = cost_model
    self.lane_hardware = dict(lane_hardware or {})
    self.copies_on_sender = copies_on_sender
    self.time_sliced = time_sliced
    self._now = 0.0
    self.between_events = None  # called after every event (checkpoints), if set
    self.notes_vjps = False  # records the task of every vjp (`snapshot.note_vjps`)

  def now(self) -> float:
    """Simulated seconds since the start of the run."""
    return self._now

  def begin(self) -> None:
    self._now = 0.0
    self._events, self._seq = [], itertools.count()
    self._busy: set = set()  # hardware running a task
    self._queued: dict = {}  # hardware -> deque of (process, lane, op) waiting for it
    self._hardware_of: dict[int, object] = {}  # lane -> its hardware (`_hardware`)
    self._sampler = self.cost_model.sampler()
    self._cores: dict = {}  # queue key -> its `_TimeSlicedCore` (`time_sliced`)
    self._core_named: dict = {}  # `lane_hardware` key -> its `_TimeSlicedCore`
    self._unfinished: dict[int, int] = {}  # run_ahead: compute lane -> its unfinished tasks
    self._made: dict[int, _Made] = {}  # run_ahead: id of a result leaf -> where, by which task
    self._driver_free = 0.0  # when the simulated driver has handled every event so far

  def execute(self) -> None:
    if self._resume is not None:
      self._load(self._resume)
    else:
      for process in self.processes:
        self.resume(process, None)
    events, pop, between_events = self._events, heapq.heappop, self.between_events
    while events:
      self._now, _, fn, args = pop(events)
      fn(*args)
      if between_events is not None:
        between_events()

  def resume(self, process: Process, value) -> None:
    self._at(self._now, self.advance, process, value)

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    if not self.run_ahead:
      self._enqueue(process, lane, op, None)
    elif self.cost_model.simulates_driver:
      self._on_driver(self._dispatched, process, lane, op)  # the driver dispatches it
    else:
      self._start_ahead(process, lane, op)

  def _enqueue(self, process: Process | None, lane: int, op: Compute, job: '_Job | None') -> None:
    hardware = self._hardware(lane)
    queue = self._queued.get(hardware)
    if queue is None:
      queue = self._queued[hardware] = deque()
    queue.append((process, lane, op, job))
    if hardware not in self._busy:
      self._start_next(hardware, queue)

  def task_finished(self, process: Process, result) -> None:
    self.advance(process, result)  # Publishes its results now, at the simulated end.

  def transfer_call(self, value, channel) -> tuple:
    """The base's transfer task, the message flattened once for its bytes (counted only
    where the link's cost depends on them) and for whether it is on the channel's
    device already (then the task hands it on as it is, which is what `copy_for_send`
    returns for it): two flattens of a pushed gradient cost ~11 µs each of a simulated
    ASGD session's host time here."""
    leaves = jax.tree_util.tree_leaves(value)
    nbytes = transfer.leaves_nbytes(leaves) if math.isfinite(self.cost_model.link_bandwidth) else 0
    if channel.device is None or transfer.leaves_on_device(leaves, channel.device):
      return _as_it_is, (value,), nbytes
    return self.copy_for_send, (value, channel), nbytes

  # --- events ---------------------------------------------------------------------------
  def _at(self, time, fn, *args):
    heapq.heappush(self._events, (time, next(self._seq), fn, args))

  def _on_driver(self, fn, *args) -> None:
    """Runs `fn(*args)` once the simulated driver has handled this event: one host
    thread, `cost_model.driver` seconds per event, events in the order they arrive (a
    FIFO single server; `cost.driver`)."""
    self._driver_free = max(self._now, self._driver_free) + self.cost_model.driver
    self._at(self._driver_free, fn, *args)

  def _dispatched(self, process: Process, lane: int, op: Compute) -> None:
    """The driver has dispatched `op`: its process goes on as running ahead says, and
    the task reaches its lane `driver_latency` later."""
    latency = self.cost_model.driver_latency
    self._start_ahead(process, lane, op, arrives=self._now + latency if latency else None)

  def _arrived(self, job: '_Job') -> None:
    """`job` is done (a task ended, or a dispatched task reached its lane): the lanes
    whose next task waited for it may start."""
    job.done = True
    for waiting in job.blocked:
      queue = self._queued.get(waiting)
      if queue and waiting not in self._busy:
        self._start_next(waiting, queue)

  def _hardware(self, lane: int):
    """What a task on `lane` occupies: the lane, or the hardware it `shares` with others
    (several stages placed on one device run their tasks one at a time). A link is the
    pair of hardware it joins: transfers between two devices share one FIFO link,
    whichever lanes of those devices send them; with `copies_on_sender`, the sender's:
    its own queue, or (`time_sliced`) a queue of the sender's copies on the sender's
    core, beside its tasks (a lane process exports in a thread of its own)."""
    hardware = self._hardware_of.get(lane)
    if hardware is None:
      spec = self.cluster.lanes[lane]
      if spec.link is not None and self.copies_on_sender:
        hardware = self._hardware(spec.link[0])
        core = self._cores.get(hardware)
        if core is not None:  # the sender's copies: a queue of their own on its core
          hardware = ('copies', spec.link[0])
          self._cores[hardware] = core
      elif spec.link is not None:
        hardware = ('link', *map(self._hardware, spec.link))
      elif spec.shares is not None:
        hardware = spec.shares
      elif self.time_sliced and lane_name(spec.name) in self.lane_hardware:
        # Its own queue (a lane process runs one task at a time); the core is shared.
        name = self.lane_hardware[lane_name(spec.name)]
        hardware = ('process', lane)
        core = self._core_named.get(name) or _TimeSlicedCore(self)
        self._cores[hardware] = self._core_named[name] = core
      else:
        hardware = self.lane_hardware.get(lane_name(spec.name), lane)
      self._hardware_of[lane] = hardware
    return hardware

  def _start_next(self, hardware, queue: deque) -> None:
    """Starts the first task waiting for `hardware` (free, with `queue` not empty). In
    order, the queue's head. Running ahead, the earliest queued task whose inputs have
    ended and that is its lane's next (each lane runs its tasks in order, and a sender's
    copies run in order): a lane whose next task waits for a result does not hold up
    another lane sharing the hardware (two lane processes on one core; a lane process
    waiting for an import does not occupy its device)."""
    index = self._startable(hardware, queue)
    if index is None:
      return
    process, lane, op, job = queue[index]
    del queue[index]
    self._busy.add(hardware)
    start = self._now
    if job is not None and job.result is not _NOT_YET:
      result = job.result  # computed when the process ran ahead
    else:
      result = op.fn(*op.args)  # Reads its inputs now, at the simulated start.
    if job is not None:
      job.inputs = ()  # (they have ended; a chain of jobs would keep every result alive)
    if self.notes_vjps:
      snapshot_lib.note_vjps(op.fn, op.args, result)
    duration = self._sampler.duration(op.kind, op.stage, lane, op.nbytes)
    task = (process, op, lane, start, result) + (() if job is None else (job,))
    core = self._cores.get(hardware)
    if core is not None:
      core.add(duration, task)
      return
    heapq.heappush(self._events, (start + duration, next(self._seq), self._finish, task))

  def _startable(self, hardware, queue: deque) -> int | None:
    """The index in `queue` of the task to start now, or None if every lane's next task
    waits for a task still running (each such task then starts `hardware` again when
    it ends: `_Job.blocked`)."""
    if queue[0][3] is None:  # in order: no job, nothing to wait for
      return 0
    seen, lanes = set(), self.cluster.lanes
    for index, (_, lane, _, job) in enumerate(queue):
      # What runs its tasks in order: a compute lane; for copies, their sender (a lane
      # process exports in one thread, each export waiting for its value in turn).
      link = lanes[lane].link
      in_order = lane if link is None else ('copies', link[0])
      if in_order in seen:
        continue  # not the next of its kind
      seen.add(in_order)
      missing = next((j for j in job.inputs if not j.done), None)
      if missing is None:
        return index
      missing.blocked[hardware] = None  # started again when `missing` ends
    return None

  def _finish(self, process, op, lane, start, result, job=None) -> None:
    hardware = self._hardware(lane)
    self._busy.discard(hardware)
    record = TaskRecord(lane, op.kind, start, self._now, op.stage, op.batch)
    if job is None:
      self.record(record)
      self.task_finished(process, result)
    else:
      job.done = True  # what reads it may start: lanes take their inputs from one another
      if self.cost_model.simulates_driver and self.cluster.lanes[lane].link is None:
        # (a copy's end is not heard: the process executor does not wait for it) The end
        # reaches the driver `driver_latency` later and waits there for its turn.
        heard = (self._heard, process, job, lane, result, record)
        if self.cost_model.driver_latency:
          self._at(self._now + self.cost_model.driver_latency, self._on_driver, *heard)
        else:
          self._on_driver(*heard)
      else:
        self.record(record)
        self._heard(process, job, lane, result)
    queue = self._queued.get(hardware)  # (None for a task in flight at a resume)
    if queue and hardware not in self._busy:
      self._start_next(hardware, queue)
    if job is not None:
      self._arrived(job)  # lanes whose next task read this one's result

  # --- running ahead (module docstring) ---------------------------------------------------
  def _start_ahead(
    self, process: Process, lane: int, op: Compute, arrives: float | None = None
  ) -> None:
    """Queues `op` behind the tasks whose results it reads (and the copies of those made
    on other lanes); the process goes on now if the lane may run that far ahead.
    `arrives`: when the task reaches its lane (`driver_latency`); neither it nor the
    copies it needs can start before."""
    spec = self.cluster.lanes[lane]
    leaves = _arrays(op.args)
    message = []
    if arrives is not None:  # the dispatch on its way to the lane: a job that ends then
      message = [_Job([])]
      self._at(arrives, self._arrived, message[0])
    imports = self._imports(leaves, lane, message) if spec.link is None else []
    job = _Job(imports + message)
    reads_at = lane if spec.link is None else spec.link[0]  # a copy reads at its source
    for made in map(self._made_of, leaves):
      if made is not None:  # what put it where this task reads it
        waits = made.at.get(reads_at, ())
        if reads_at == made.lanes[0] or not waits:
          waits = (made.job, *waits)
        job.inputs += [j for j in waits if not j.done]
    if spec.link is None:
      self._unfinished[lane] = self._unfinished.get(lane, 0) + 1
    job.ahead = spec.link is not None or (op.ahead and self._unfinished[lane] <= self.run_ahead)
    if job.ahead:
      job.result = op.fn(*op.args)
      self._note(job, lane, job.result)
    self._enqueue(process, lane, op, job)
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
      costed = math.isfinite(self.cost_model.link_bandwidth)
      nbytes = sum(a.nbytes for a, _ in arrays) if costed else 0
      copy = _Job([made.job for _, made in arrays if not made.job.done] + message)
      copy.result = ()
      self._enqueue(None, link, Compute(None, kind=TRANSFER, lane=link, nbytes=nbytes), copy)
      copies.append(copy)
    return copies

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
        copies = made.at.get(where)
        made.at[where] = [j for j in copies if not j.done] + [job] if copies else [job]
        if where not in made.lanes:
          made.lanes.append(where)

  def _heard(self, process: Process | None, job: '_Job', lane: int, result, record=None) -> None:
    """The driver hears that `job` has ended on `lane` (at its end, or once the simulated
    driver has handled the event, which `record` then notes): the lane has one task fewer
    unfinished, and a process that waited for the task goes on with its result."""
    if record is not None:
      self.record(record._replace(heard=self._now))
    if self.cluster.lanes[lane].link is None:
      self._unfinished[lane] -= 1
    if not job.ahead:
      self._note(job, lane, result)  # its process sees it only now
    job.result = None  # the process has it; the executor keeps no result of an ended task
    if process is not None and not job.ahead:
      self.task_finished(process, result)

  # --- checkpoints ----------------------------------------------------------------------
  def snapshot(self) -> dict:
    """The simulation between two events, as data (processes, channels and arrays by
    reference: `snapshot.encode` saves it); `processes` lists every live process."""
    if self.run_ahead:
      raise snapshot_lib.NotResumableError(
        'checkpoint: a run-ahead schedule (cost.schedule) keeps tasks in flight.'
      )
    seq = next(self._seq)
    self._seq = itertools.count(seq)
    events, live = [], list(self.policy_processes)
    for time, order, fn, args in sorted(self._events):
      if fn == self.advance:
        process, value = args
        events.append((time, order, 'advance', process, value))
      elif fn == self._finish:
        process, op, lane, start, result = args
        events.append((time, order, 'finish', process, lane, start, result))
      else:
        raise snapshot_lib.NotResumableError(f'checkpoint: an event {fn!r} is not saved.')
      live.append(process)
    queued = [(hw, [(p, lane) for p, lane, *_ in tasks]) for hw, tasks in self._queued.items()]
    live += [p for _, tasks in queued for p, _ in tasks]
    return {
      'now': self._now,
      'seq': seq,
      'events': events,
      'queued': [(hw, tasks) for hw, tasks in queued if tasks],
      'busy': sorted(self._busy, key=repr),
      'random': {lane: rng.bit_generator.state for lane, rng in self._sampler._rngs.items()},  # pylint: disable=protected-access
      **self.save_processes(live),
    }

  def _load(self, saved: dict) -> None:
    """Puts the state `snapshot()` saved back (see the module docstring)."""
    self._now = saved['now']
    self._seq = itertools.count(saved['seq'])
    for lane, state in saved['random'].items():
      rng = np.random.default_rng([self.cost_model.seed, lane])
      rng.bit_generator.state = state
      self._sampler._rngs[lane] = rng  # pylint: disable=protected-access
    pending = self.load_processes(saved)
    for time, order, kind, process, *rest in saved['events']:
      if kind == 'advance':
        pending.pop(process, None)  # Its op was dispatched: it goes on with the value.
        self._events.append((time, order, self.advance, (process, rest[0])))
      else:
        lane, start, result = rest
        op = expect_op(pending.pop(process), Compute, process)
        self._events.append((time, order, self._finish, (process, op, lane, start, result)))
    heapq.heapify(self._events)
    for hardware, tasks in saved['queued']:
      for process, lane in tasks:
        self._queued.setdefault(hardware, deque()).append(
          (process, lane, expect_op(pending.pop(process), Compute, process), None)
        )
    self._busy.update(saved['busy'])
    self.load_channels(saved, pending)


_NOT_YET = object()  # a task's result, not computed yet


class _Job:
  """A task of a run-ahead schedule: the tasks it waits for (`inputs`), its result once
  computed, whether its process went on with it at dispatch (`ahead`), whether it has
  ended, and the hardware whose next task waits for it (`blocked`, in order)."""

  __slots__ = ('inputs', 'result', 'ahead', 'done', 'blocked')

  def __init__(self, inputs: list):
    self.inputs, self.result, self.ahead, self.done, self.blocked = (
      inputs,
      _NOT_YET,
      False,
      False,
      {},
    )


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


class _TimeSlicedCore:
  """A core shared by the lanes placed on it, as an operating system shares it between
  processes: processor sharing. With n tasks running, each progresses at 1/n of the
  core's speed; a task's cost is the seconds it would take alone.

      remaining_i -= (now - last) / n            at every arrival and departure
      next end = now + min_i remaining_i · n     (one event; superseded ones are ignored)

  Linux's scheduler gives each runnable process of one core an equal share over a few
  milliseconds (CFS), which this fluid model approximates for tasks of a few ms or more;
  a lane's own tasks still run one at a time (its queue, `VirtualExecutor._hardware`).
  Everything is arithmetic in a fixed order, so a run stays deterministic.
  """

  def __init__(self, executor: VirtualExecutor):
    self.executor = executor
    self.running: list = []  # [remaining seconds alone, arrival number, task]
    self.last = 0.0
    self.generation = 0
    self.arrivals = itertools.count()

  def add(self, seconds: float, task: tuple) -> None:
    self._advance()
    self.running.append([seconds, next(self.arrivals), task])
    self._schedule()

  def _advance(self) -> None:
    now = self.executor.now()
    if self.running:
      share = (now - self.last) / len(self.running)
      for entry in self.running:
        entry[0] -= share
    self.last = now

  def _schedule(self) -> None:
    self.generation += 1
    if self.running:
      first = min(self.running, key=lambda e: (e[0], e[1]))
      end = self.executor.now() + max(first[0], 0.0) * len(self.running)
      self.executor._at(end, self._end, self.generation, first[1])  # pylint: disable=protected-access

  def _end(self, generation: int, arrival: int) -> None:
    if generation != self.generation:
      return  # superseded by a later arrival or departure
    self._advance()
    done = [e for e in self.running if e[1] == arrival or e[0] <= 1e-12]
    self.running = [e for e in self.running if not any(e is d for d in done)]
    for _, _, task in done:
      self.executor._finish(*task)  # pylint: disable=protected-access
    self._schedule()


def _as_it_is(value):
  """A transfer's task for a message already on its channel's device: the message."""
  return value
