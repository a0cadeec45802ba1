"""The real clock: tasks dispatched to real devices, timings measured.

Default (one thread): a cooperative loop advances the processes round-robin. A
`Compute` calls the jitted function, which JAX dispatches asynchronously to the
device its inputs live on, and the process resumes at once with the (future)
outputs; a device starts the task as soon as its inputs are ready. Nothing on
this loop waits for a device. Per lane, a *timing thread* waits for each task's
inputs and outputs in dispatch order (a device runs its queue in order) and
records `start = max(dispatched, inputs ready, previous task's end)` and `end`;
it also bounds how far the loop may run ahead (`max_inflight` tasks per lane).

With `threads=True` every process gets its own thread, which waits for each of
its tasks to finish before going on: independent workers (a parameter server's
workers, stragglers) that must see each other's progress in real time. Tasks on
one lane are serialized by a lock.

Either way an exception in any process, task or timing thread stops the whole
run promptly and is re-raised by `run`.
"""

import collections
import queue
import threading
import time

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute, DeadlockError, Get, Process, Put, Send
from jaxsgd.scheduler.core import blocked_report
from jaxsgd.scheduler.costs import TRANSFER
from jaxsgd.scheduler.timeline import TaskRecord, Timeline

_POLL = 0.05  # seconds between checks for a failure elsewhere while waiting


class _Stopped(Exception):
  """Raised in a worker thread when another part of the run has failed."""


class RealExecutor:
  """Runs processes on real devices (see the module docstring)."""

  clock = 'real'

  def __init__(self, *, threads: bool = False, max_inflight: int = 16):
    self.threads = threads
    self.max_inflight = max_inflight
    self._t0 = time.perf_counter()

  def now(self) -> float:
    """Wall seconds since the start of the run."""
    return time.perf_counter() - self._t0

  def run(self, cluster: Cluster, processes: list[Process]) -> Timeline:
    self._cluster = cluster
    self._records: list[TaskRecord] = []
    self._failure: BaseException | None = None
    self._stop = threading.Event()
    self._t0 = time.perf_counter()
    try:
      (self._run_threads if self.threads else self._run_cooperative)(processes)
    except _Stopped:
      pass  # Another part failed first; its exception is raised below.
    finally:
      for process in processes:
        if not self.threads:
          process.close()
    if self._failure is not None:
      raise self._failure
    return Timeline([lane.name for lane in cluster.lanes], self._records, self.clock)

  def _fail(self, error: BaseException) -> None:
    if self._failure is None:
      self._failure = error
    self._stop.set()

  # --- one thread, asynchronous dispatch --------------------------------------------------
  def _run_cooperative(self, processes):
    self._watchers: dict[int, _LaneWatcher] = {}
    ready = collections.deque((p, None) for p in processes)
    self._ready = ready
    try:
      while ready and self._failure is None:
        process, value = ready.popleft()
        try:
          op = process.program.send(value)
        except StopIteration:
          process.done = True
          continue
        self._handle(process, op)
      if self._failure is None and any(not p.done for p in processes):
        raise DeadlockError(f'real clock: {blocked_report(processes)}')
    finally:
      for watcher in self._watchers.values():
        watcher.stop()

  def _handle(self, process, op):
    if isinstance(op, Compute):
      self._ready.append((process, self._dispatch(op, self._lane(process, op))))
    elif isinstance(op, Get):
      if op.channel.items:
        self._ready.append((process, op.channel.items.popleft()))
      else:
        process.waiting_on = op.channel
        op.channel.waiters.append(process)
    elif isinstance(op, (Send, Put)):
      value = self._copy(process, op) if isinstance(op, Send) else op.value
      self._deliver(op.channel, value)
      self._ready.append((process, None))
    else:
      raise TypeError(f'{process.name} yielded {op!r}; expected Compute, Send, Put or Get.')

  def _deliver(self, channel, item):
    if channel.waiters:
      waiter = channel.waiters.popleft()
      waiter.waiting_on = None
      self._ready.append((waiter, item))
    else:
      channel.items.append(item)

  def _dispatch(self, op: Compute, lane: int):
    watcher = self._watchers.get(lane)
    if watcher is None:
      watcher = self._watchers[lane] = _LaneWatcher(self, lane)
    watcher.acquire()
    dispatched = self.now()
    result = op.fn(*op.args)  # Asynchronous: returns futures.
    watcher.submit(op, dispatched, op.args, result)
    return result

  # --- a thread per process ------------------------------------------------------------------
  def _run_threads(self, processes):
    self._lane_locks = collections.defaultdict(threading.Lock)
    self._channels_seen: set = set()
    self._waiting: dict[Process, object] = {}
    self._alive = len(processes)
    self._count_lock = threading.Lock()
    threads = [
      threading.Thread(target=self._thread_main, args=(p,), name=p.name, daemon=True)
      for p in processes
    ]
    for thread in threads:
      thread.start()
    try:
      for thread in threads:
        while thread.is_alive():
          thread.join(_POLL)
    except BaseException as e:  # Ctrl-C: stop every worker, then re-raise.
      self._fail(e)
      self._wake_all()
      for thread in threads:
        thread.join(5.0)
      raise

  def _thread_main(self, process: Process):
    value = None
    try:
      while not self._stop.is_set():
        try:
          op = process.program.send(value)
        except StopIteration:
          process.done = True
          return
        value = self._thread_op(process, op)
    except _Stopped:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      self._fail(e)
      self._wake_all()
    finally:
      with self._count_lock:
        self._alive -= 1
        self._waiting.pop(process, None)
      process.program.close()
      self._wake_all()

  def _thread_op(self, process, op):
    if isinstance(op, Compute):
      lane = self._lane(process, op)
      with self._lane_locks[lane]:
        start = self.now()
        result = op.fn(*op.args)
        transfer.wait(result)  # This worker waits for its own task, as a real one does.
        self._records.append(TaskRecord(lane, op.kind, start, self.now(), op.stage, op.batch))
      return result
    if isinstance(op, Get):
      return self._thread_get(process, op.channel)
    if isinstance(op, (Send, Put)):
      value = self._copy(process, op, wait=True) if isinstance(op, Send) else op.value
      with op.channel.condition:
        op.channel.items.append(value)
        op.channel.condition.notify_all()
      self._channels_seen.add(op.channel)
      return None
    raise TypeError(f'{process.name} yielded {op!r}; expected Compute, Send, Put or Get.')

  def _thread_get(self, process, channel):
    self._channels_seen.add(channel)
    with channel.condition:
      while True:
        if channel.items:
          with self._count_lock:
            self._waiting.pop(process, None)
          return channel.items.popleft()
        if self._stop.is_set():
          raise _Stopped
        with self._count_lock:
          self._waiting[process] = channel
          # Deadlock: every live process waits, and on a channel that is empty.
          stuck = len(self._waiting) == self._alive and not any(
            waited.items for waited in self._waiting.values()
          )
        if stuck:
          raise DeadlockError(
            f'real clock: every live process waits ({process.name} on {channel}).'
          )
        channel.condition.wait(_POLL)

  def _wake_all(self):
    for channel in list(self._channels_seen):
      with channel.condition:
        channel.condition.notify_all()

  # --- shared ----------------------------------------------------------------------------------
  def _lane(self, process, op) -> int:
    return process.lane if op.lane is None else op.lane

  def _copy(self, process, op: Send, wait: bool = False):
    """The transfer of a Send, timed on the link lane (a no-op on the same lane)."""
    channel = op.channel
    if channel.lane == process.lane:
      return op.value
    link = self._cluster.link(process.lane, channel.lane)
    copy = Compute(
      transfer.to_device, (op.value, channel.device), kind=TRANSFER, batch=op.batch, lane=link
    )
    if not wait:
      return self._dispatch(copy, link)
    start = self.now()
    copied = transfer.to_device(op.value, channel.device)
    transfer.wait(copied)
    self._records.append(TaskRecord(link, TRANSFER, start, self.now(), None, op.batch))
    return copied


class _LaneWatcher:
  """Measures when a lane's tasks start and end, off the dispatch loop."""

  def __init__(self, executor: RealExecutor, lane: int):
    self._executor = executor
    self._lane = lane
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._slots = threading.Semaphore(executor.max_inflight)
    self._previous_end = 0.0
    self._thread = threading.Thread(target=self._loop, daemon=True, name=f'timing lane {lane}')
    self._thread.start()

  def acquire(self):
    """Waits while `max_inflight` tasks of this lane are unfinished (back-pressure)."""
    while not self._slots.acquire(timeout=_POLL):
      if self._executor._failure is not None:  # pylint: disable=protected-access
        raise _Stopped

  def submit(self, op, dispatched, args, result):
    self._queue.put((op, dispatched, args, result))

  def stop(self):
    self._queue.put(None)
    self._thread.join()

  def _loop(self):
    executor = self._executor
    while (item := self._queue.get()) is not None:
      op, dispatched, args, result = item
      try:
        transfer.wait(args)
        inputs_ready = executor.now()
        transfer.wait(result)
        end = executor.now()
        start = max(dispatched, inputs_ready, self._previous_end)
        self._previous_end = end
        executor._records.append(  # pylint: disable=protected-access
          TaskRecord(self._lane, op.kind, min(start, end), end, op.stage, op.batch)
        )
      except BaseException as e:  # pylint: disable=broad-except
        executor._fail(e)  # pylint: disable=protected-access
      finally:
        self._slots.release()
