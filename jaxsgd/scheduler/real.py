"""The real clock: tasks dispatched to real devices, timings measured.

`RealExecutor()` (one thread): a cooperative loop advances the processes
round-robin. A `Compute` calls the jitted function, which JAX dispatches
asynchronously to the device its inputs live on, and the process resumes at once
with the (future) outputs; a device starts the task as soon as its inputs are
ready. Nothing on this loop waits for a device. Per device (and per link that
really copies), a *timing thread* waits for each task's inputs and outputs in
dispatch order (a device runs its queue in order: measured on XLA:CPU, and so
does a GPU stream) and records `start = max(dispatched, inputs ready, the
device's previous end)` and `end`; it also bounds how far the loop may run ahead
(`max_inflight` unfinished tasks per device). Several lanes on one device share
its timing thread, so their tasks are measured one after another, as they run.

A `Send` of a value that already lives on the receiver's device moves nothing:
it is delivered in place, with no transfer task (`needs_transfer`).

`RealExecutor(threads=True)` (a `ThreadedExecutor`): every process gets its own
thread, which waits for each of its tasks to finish before going on: independent
workers (a parameter server's workers, stragglers) that must see each other's
progress in real time. Tasks on one lane are serialized by a lock.

Checkpoints (one thread): `between_events` (if set) is called after every op the loop
dispatches. There the run can be saved at a *drained point*: `snapshot()` first waits
until every task dispatched so far has finished (its timing thread has recorded it),
so nothing is in flight but values; what is left is data — the processes' `LoopState`s,
the queue of processes ready to go on (with the values they go on with), channel items
and waiters, the timeline, the wall time. `run(..., resume=snapshot)` continues from
it, the wall clock going on from the saved time. The loop's order depends only on the
programs, so a resumed run of a deterministic schedule (staged BP, DDG, local) ends
bit-identical to an uninterrupted one; only its wall times differ.
With `threads=True` the drained point is reached by pausing: the thread whose op
reported a checkpoint's step asks every other thread to stop before its next op, and
waits until each has stopped there, waits on a channel, or is done (a task a thread is
running finishes first: tasks run in their threads). Every process is then between two
ops; the snapshot lists those that will go on with a value (the events) and the channel
waiters, and the threads go on. A resumed run starts each thread where its process was.
The threads' interleaving is real time's, so only a run whose order does not depend on
it (one asynchronous worker: sequential SGD) resumes bit-identically.

Either way an exception in any process, task or timing thread stops the whole
run promptly and is re-raised by `run`; with threads, a Ctrl-C first lets a worker
that is writing a checkpoint finish it (`ThreadedExecutor._let_the_workers_end`).
What the ops mean (channels, transfers over link lanes) is the `Executor` base's;
these classes say only when tasks run and when processes go on.
"""

import collections
import queue
import sys
import threading
import time

from jaxsgd.scheduler import snapshot as snapshot_lib
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Channel, Compute, DeadlockError, Process, blocked_report
from jaxsgd.scheduler.executor import Executor, Stopped
from jaxsgd.scheduler.timeline import TaskRecord

_POLL = 0.05  # seconds between checks for a failure elsewhere while waiting
_GRACE_S = 5.0  # how long the worker threads are given, in all, to end after a Ctrl-C
WAITING_FOR_THE_SAVE = (  # (on a line of its own: the progress bar's line has no newline)
  '\nCtrl-C: the run stops once the checkpoint a worker is writing is complete;'
  ' press it again to stop now.'
)


class RealExecutor(Executor):
  """Runs processes on real devices from one thread (see the module docstring).

  `RealExecutor(threads=True)` makes a `ThreadedExecutor` (a thread per process).
  """

  clock = 'real'
  threads = False

  def __new__(cls, *, threads: bool = False, **kwargs):
    del kwargs
    if threads and cls is RealExecutor:
      cls = ThreadedExecutor
    return super().__new__(cls)

  def __init__(self, *, threads: bool = False, max_inflight: int = 16):
    del threads  # Chose the class (`__new__`).
    self.max_inflight = max_inflight
    self._t0 = time.perf_counter()
    self.between_events = None  # called after every op the loop dispatches (checkpoints)
    self.notes_vjps = False  # records the task of every vjp (`snapshot.note_vjps`)

  def now(self) -> float:
    """Wall seconds since the start of the run."""
    return time.perf_counter() - self._t0

  def begin(self) -> None:
    self._t0 = time.perf_counter()
    self._stop = threading.Event()
    # CPU seconds the timing threads spent in this run (host cost, see benchmarks/).
    self.timing_cpu_seconds = 0.0

  def fail(self, error: BaseException) -> None:
    super().fail(error)
    self._stop.set()

  # --- one thread, asynchronous dispatch --------------------------------------------------
  def execute(self) -> None:
    self._timers: dict = {}
    self._ready = collections.deque()
    if self._resume is not None:
      self._ready.extend(self._load(self._resume))
    else:
      self._ready.extend((p, None) for p in self.processes)
    between_events = self.between_events
    try:
      while self._ready and self.failure is None:
        self.advance(*self._ready.popleft())
        if between_events is not None:
          between_events()
    finally:
      for timer in self._timers.values():
        timer.stop()

  def resume(self, process: Process, value) -> None:
    self._ready.append((process, value))

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    dispatched = self.now()
    result = op.fn(*op.args)  # Asynchronous: returns futures.
    if self.notes_vjps:
      snapshot_lib.note_vjps(op.fn, op.args, result)
    spec = self.cluster.lanes[lane]
    key = spec.device if spec.link is None else lane  # A device, or a link of its own.
    timer = self._timers.get(key)
    if timer is None:
      timer = self._timers[key] = _Timer(self)
    timer.submit(lane, op, dispatched, result)
    self.task_finished(process, result)

  def needs_transfer(self, value, channel: Channel) -> bool:
    """Only a value not yet on the channel's device is copied (a task on the link)."""
    return channel.device is not None and not transfer.on_device(value, channel.device)

  # --- checkpoints at a drained point (module docstring) -----------------------------------
  def snapshot(self) -> dict:
    """The run between two ops, once every dispatched task has finished, as data in the
    virtual clock's form (`VirtualExecutor.snapshot`): the ready queue is its events."""
    for timer in self._timers.values():
      timer.drain()
    if self.failure is not None:
      raise self.failure
    return self.drained_snapshot(self._ready)

  def _load(self, saved: dict) -> list:
    """The saved run put back (`load_drained`), the wall clock going on from its time."""
    self._t0 = time.perf_counter() - saved['now']
    return self.load_drained(saved)


class _Timer:
  """Measures when the tasks of one device (or one link) start and end, off the loop.

  A device runs its queue in dispatch order (XLA:CPU and a GPU stream alike), so
  one thread per device waits for each task's inputs and outputs in that order
  and records `start = max(dispatched, inputs ready, the device's previous end)`.
  It also bounds how far the dispatch loop may run ahead: once more than
  `max_inflight` of its tasks are unfinished, `submit` waits until at most half of
  that are. Two counters, each written
  by one thread, say how many; the loop takes a lock only when it has to wait.
  """

  def __init__(self, executor: RealExecutor):
    self._executor = executor
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._submitted = 0  # written by the dispatch loop only
    self._finished = 0  # written by the timing thread only
    self._waiting = False
    self._room = 0  # how many may be unfinished when the waiting loop goes on
    self._progress = threading.Condition()
    self._previous_end = 0.0
    self._thread = threading.Thread(target=self._loop, daemon=True, name='real clock timer')
    self._thread.start()

  def submit(self, lane, op, dispatched, result):
    """Times `op` (dispatched at `dispatched`); when more than `max_inflight` are
    unfinished, waits until at most half of that are.

    Half, not one less: waiting for one task at a time woke the dispatch loop for every
    other task (950 waits in 1,788 tasks of DDG K=4 on one CPU device), each a wake-up
    of this thread and a hand-over of the GIL between it and the timing thread; with
    half the window the loop waits about once per `max_inflight / 2` tasks, and the
    device still has that many queued when it goes on (at least one: a window of one
    keeps one task queued, as before)."""
    self._queue.put((lane, op, dispatched, result))
    self._submitted += 1
    if self._submitted - self._finished > self._executor.max_inflight:
      self._wait_for_room(max(1, self._executor.max_inflight // 2))

  def drain(self):
    """Waits until every task submitted so far has been timed (a drained point)."""
    self._wait_for_room(0)

  def _wait_for_room(self, room: int):
    with self._progress:
      self._room = room
      self._waiting = True  # Set before the check: the timing thread then notifies.
      try:
        while self._submitted - self._finished > room:
          if self._executor.failure is not None:
            raise Stopped
          self._progress.wait(_POLL)
      finally:
        self._waiting = False

  def stop(self):
    self._queue.put(None)
    self._thread.join()

  def _loop(self):
    executor, clock, t0 = self._executor, time.perf_counter, self._executor._t0
    cpu = time.thread_time()
    while (item := self._queue.get()) is not None:
      lane, op, dispatched, result = item
      try:
        transfer.wait(op.args)
        inputs_ready = clock() - t0
        transfer.wait(result)
        end = clock() - t0
        start = max(dispatched, inputs_ready, self._previous_end)
        self._previous_end = end
        executor.record(TaskRecord(lane, op.kind, min(start, end), end, op.stage, op.batch))
      except BaseException as e:  # pylint: disable=broad-except
        executor.fail(e)
      finally:
        self._finished += 1
        if self._waiting and self._submitted - self._finished <= self._room:
          with self._progress:
            self._progress.notify()
    executor.timing_cpu_seconds += time.thread_time() - cpu  # Threads end one at a time.


_START, _WAIT, _DONE = object(), object(), object()  # how a thread starts (`_drive`)


def _wait_for(event: threading.Event) -> None:
  """Waits in steps of `_POLL`: the main thread runs Python's signal handlers (Ctrl-C)
  between them, wherever the kernel delivered the signal."""
  while not event.wait(_POLL):
    pass


class _Mailbox:
  """Where a waiting thread's process receives the value it resumes with."""

  def __init__(self):
    self.ready = threading.Event()
    self.value = None


class ThreadedExecutor(RealExecutor):
  """The real clock with a thread per process; each waits for its own tasks.

  A `Get` on an empty channel blocks the process's thread until a delivery; the
  channel operations (`take`, `deliver`, `resume`) are atomic under one lock. A
  `Send`'s transfer runs in the sender's thread (it waits for the copy). When
  every live process waits on a channel, the run is a deadlock.
  """

  threads = True

  def begin(self) -> None:
    super().begin()
    self._lock = threading.RLock()
    self._lane_locks = collections.defaultdict(threading.Lock)
    self._mailboxes: dict[Process, _Mailbox] = {p: _Mailbox() for p in self.processes}
    self._saving = threading.Lock()  # held by the thread taking a checkpoint
    self._pause = threading.Event()  # set: threads stop before their next op
    self._pause_over = threading.Event()  # set when the checkpoint is taken
    self._paused: dict[Process, object] = {}  # stopped there, with the value they go on with
    self._waiting_turn: set[Process] = set()  # after an op, waiting to call `between_events`
    self._depth = threading.local()  # nesting of `_drive` (a Send's transfer runs inside)
    self._writer = None  # the process whose thread writes a checkpoint (snapshot taken), if any

  def fail(self, error: BaseException) -> None:
    with self._lock:  # (`snapshot` checks for a failure under it: no save begins after)
      super().fail(error)

  def execute(self) -> None:
    starts = {p: _START for p in self.processes}
    if self._resume is not None:
      starts.update(self._load_threads(self._resume))
    # Waited for by these events, not `Thread.join`: a join that Ctrl-C interrupts can
    # mark a live thread as ended (CPython 3.11's `Thread._wait_for_tstate_lock`), and
    # the thread writing a checkpoint must be waited for after a Ctrl-C.
    self._ended: dict[Process, threading.Event] = {}  # set as each thread ends
    try:
      for process, start in starts.items():
        if start is not _DONE:
          ended = threading.Event()
          args = (process, start, ended)
          thread = threading.Thread(target=self._thread_main, args=args, name=process.name)
          thread.daemon = True
          self._ended[process] = ended
          try:
            thread.start()
          except BaseException:
            ended.set()  # (not waited for: it ends by itself, or never began)
            raise
      for ended in list(self._ended.values()):
        _wait_for(ended)
    except BaseException as e:  # Ctrl-C: stop every worker, then re-raise.
      self.fail(e)
      self._let_the_workers_end()
      raise

  def _let_the_workers_end(self) -> None:
    """After the main thread failed (Ctrl-C): a worker writing a checkpoint is waited for
    until it has ended, one line saying so, for once `run` has raised the run's files are
    closed (`Run.abort`), and a save cut short there is left damaged; a second Ctrl-C
    stops the wait. The other workers are given `_GRACE_S` in all to end (a task one is
    running finishes first)."""
    writing = self._ended.get(self._writer)  # (`fail` took the lock: no new writer now)
    if writing is not None and not writing.is_set():
      try:
        print(WAITING_FOR_THE_SAVE, file=sys.stderr, flush=True)
      except OSError:  # stderr gone (`| tee` ended by the same Ctrl-C): wait all the same
        pass
      _wait_for(writing)
    deadline = time.monotonic() + _GRACE_S
    for ended in self._ended.values():
      ended.wait(max(0.0, deadline - time.monotonic()))

  def close_processes(self) -> None:
    pass  # Each thread closes its own process's generator.

  def _thread_main(self, process: Process, start, ended: threading.Event) -> None:
    try:
      self._drive(process, start)
    except Stopped:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      self.fail(e)
    finally:
      try:
        process.program.close()
      finally:
        ended.set()

  def _drive(self, process: Process, start=None) -> None:
    """Runs `process` to its end in this thread, waiting wherever it waits. `start`:
    the value it goes on with (`_WAIT`: it waits on its channel first)."""
    depth = getattr(self._depth, 'value', 0)
    self._depth.value = depth + 1
    if depth == 0:
      self._depth.process = process  # (whose thread this is: `snapshot`)
    try:
      value = self._wait(process) if start is _WAIT else (None if start is _START else start)
      while not self._stop.is_set():
        if depth == 0:
          value = self._stop_if_asked(process, value)
        self.advance(process, value)
        if depth == 0 and self.between_events is not None:
          self._between_ops()
        if process.done:
          return
        value = self._wait(process)
      raise Stopped
    finally:
      self._depth.value = depth

  # --- checkpoints at a drained point (module docstring) -----------------------------------
  def _between_ops(self) -> None:
    """`between_events`, by one thread at a time. A thread waiting for its turn is
    between two ops (its next value in its mailbox, or it waits on a channel), so a
    checkpoint being taken counts it as stopped (`_waiting_turn`)."""
    process = self._depth.process
    with self._lock:
      self._waiting_turn.add(process)
    try:
      self._saving.acquire()
    finally:
      with self._lock:
        self._waiting_turn.discard(process)
    try:
      self.between_events()
    finally:
      self._writer = None
      self._go_on()  # after the checkpoint is written, not when `snapshot` returns
      self._saving.release()

  def _go_on(self) -> None:
    if self._pause.is_set():
      self._pause.clear()
      self._pause_over.set()

  def _stop_if_asked(self, process: Process, value):
    """Before an op: while a checkpoint is being taken, stop here (`_paused`)."""
    if not self._pause.is_set():
      return value
    with self._lock:
      self._paused[process] = value
    while self._pause.is_set():
      if self._stop.is_set():
        raise Stopped
      self._pause_over.wait(_POLL)
    with self._lock:
      return self._paused.pop(process)

  def snapshot(self) -> dict:
    """Called by `between_events` in the thread whose op reported the step: stops every
    other thread between two ops and returns the state; they go on once
    `between_events` has returned (the state, by reference, is saved by then). Once the
    run has failed it raises `Stopped` instead: no save begins after a Ctrl-C."""
    me = getattr(self._depth, 'process', None)  # None: the run is over (`after_run`)
    self._pause_over = threading.Event()
    self._pause.set()
    try:
      self._wait_until_drained(me)
    except BaseException:
      self._go_on()
      raise
    with self._lock:
      if self.failure is not None:
        self._go_on()
        raise Stopped
      if me is not None:
        self._writer = me  # until `between_events` returns
      going_on = dict(self._paused)
      for process in (me, *self._waiting_turn):  # after an op: its value is in its mailbox
        mailbox = self._mailboxes.get(process)
        if mailbox is not None and mailbox.ready.is_set():
          going_on[process] = mailbox.value
      order = {p: i for i, p in enumerate(self.processes)}
      return self.drained_snapshot([(p, going_on[p]) for p in sorted(going_on, key=order.get)])

  def _wait_until_drained(self, me: Process) -> None:
    while True:
      with self._lock:
        busy = [
          p
          for p in self.processes
          if p is not me
          and not p.done
          and p not in self._paused
          and p not in self._waiting_turn
          and not (p.waiting_on is not None and not self._mailboxes[p].ready.is_set())
        ]
      if not busy:
        return
      if self.failure is not None:
        raise Stopped
      time.sleep(0.001)

  def _load_threads(self, saved: dict) -> dict:
    """Each saved process's start: the value it goes on with, `_WAIT` (on a channel) or
    `_DONE`; spawned processes get their mailboxes."""
    ready = self._load(saved)
    for process in self.processes:
      self._mailboxes.setdefault(process, _Mailbox())
    starts = {p: _DONE if p.done else _WAIT for p in self.processes}
    starts.update(ready)
    return starts

  def _wait(self, process: Process):
    mailbox = self._mailboxes[process]
    while not mailbox.ready.wait(_POLL):
      if self._stop.is_set():
        raise Stopped
      with self._lock:
        live = [p for p in self.processes if not p.done]
        stuck = live and all(p.waiting_on is not None for p in live)
      if stuck:
        raise DeadlockError(
          f'{self.clock} clock: every live process waits: {blocked_report(self.processes)}'
        )
    mailbox.ready.clear()
    value, mailbox.value = mailbox.value, None
    return value

  # --- when things happen -----------------------------------------------------------------
  def resume(self, process: Process, value) -> None:
    with self._lock:
      mailbox = self._mailboxes.setdefault(process, _Mailbox())
      mailbox.value = value
      mailbox.ready.set()

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    with self._lane_locks[lane]:
      start = self.now()
      result = op.fn(*op.args)
      if self.notes_vjps:
        snapshot_lib.note_vjps(op.fn, op.args, result)
      transfer.wait(result)  # This worker waits for its own task, as a real one does.
      self.record(TaskRecord(lane, op.kind, start, self.now(), op.stage, op.batch))
    self.task_finished(process, result)

  def spawn(self, process: Process) -> None:
    try:
      self._drive(process)  # A Send's transfer: the sender's thread makes the copy.
    finally:
      with self._lock:
        self._mailboxes.pop(process, None)

  def take(self, process: Process, channel: Channel) -> None:
    with self._lock:
      super().take(process, channel)

  def deliver(self, channel: Channel, item) -> None:
    with self._lock:
      super().deliver(channel, item)
