"""The executor base: what `Compute`, `Send`, `Put` and `Get` do, written once for every clock.

An executor runs the processes of a `Cluster` and returns a `Timeline`. What an op
*means* is the same under every clock, so it is written here once:

    advance(p, value): op = p.send(value)              (StopIteration: p is done)
      Compute(fn, args)  → start_task(p, lane, op)     the clock runs it; when it is
                                                       done: task_finished(p, result)
      Get(channel)       → an item waits: resume(p, item); else p waits on the channel
      Put(channel, v)    → deliver(channel, v); resume(p, None)
      Send(channel, v)   → same lane, or no transfer needed: deliver(channel, v);
                           else spawn a transfer process on the link lane (sender
                           → channel), which runs Compute(copy_for_send, (v,
                           channel)) there and then Put(channel, copy);
                           resume(p, None)
    deliver(channel, v): the first waiter resumes with v; else v is queued

What a clock decides is *when*: when a task starts and how long it takes, and
when a process that can go on does. A subclass overrides only these hooks (the
model is SimPy's `Environment` and its real-time subclass, which overrides only
`step()`):

- `execute()`: runs the processes (`self.processes`) until none can go on; returns
  normally when they are all done or all wait (the base reports a deadlock), or
  raises. Starts every process with `advance(p, None)`, directly or via `resume`.
- `resume(process, value)`: `process` can go on with `value`; the clock calls
  `advance(process, value)` later, in its own order (never from inside `resume`:
  `resume` is called from within the dispatch of another op).
- `start_task(process, lane, op)`: run the `Compute` `op` on `lane` (one task at a
  time per lane), record it (`record(TaskRecord(...))`) and, when the clock says it
  is done, call `task_finished(process, result)`. `op.fn(*op.args)` is the task; the
  value it returns is what the process receives. A lane's `LaneSpec.link` is not
  None for link lanes: their tasks are the transfers of `Send`s.
- `task_finished(process, result)`: default `resume(process, result)`; the virtual
  clock continues the process at once instead (it publishes at the task's end).
- `spawn(process)`: start a helper process (a `Send`'s transfer); default
  `resume(process, None)`.
- `copy_for_send(value, channel)`: the copy a transfer makes (default
  `transfer.to_device(value, channel.device)`); an executor whose lanes live in
  other processes moves the value between them here.
- `needs_transfer(value, channel)`: whether a `Send` between two lanes is a
  transfer task at all (default True: the virtual clock prices every link); the
  real clock delivers a value already on the channel's device in place.
- `message_bytes(value)`: the bytes a transfer moves, for its record (default 0; the
  process executor counts its handles' bytes).
- `transfer_call(value, channel)`: `(fn, args, nbytes, arrays)` of a transfer's task (default
  `copy_for_send` and `message_bytes`); the virtual clock, which prices a link by its
  bytes, flattens the message once for both.
- `begin()`: resets the clock's state at the start of a run; `now()`: seconds since
  the start of the run (simulated or wall).
- `fetch(value)` / `deferred(value)`: `value` for the driver now (logging,
  evaluation) / when first read (a loss handed to a report); `close()`: releases
  what the executor holds after a run (its lane processes). Identity and no-op for
  the in-process clocks, whose values are already the driver's.
- `close_processes()`: closes every process's generator when the run ends (an
  executor that runs them in threads closes each in its own thread instead).

Checkpoints: a clock that can save a run between two ops (`snapshot()`: the virtual
clock after any event, the real clock at a drained point, `real.py`) saves its
processes and channels with `save_processes(live)` and puts them back with
`load_processes` and `load_channels`: every process is started again from its saved
`LoopState` and re-yields its pending op, which the clock puts back where it was.

Failures: `fail(error)` records the first error of a run (from a thread, say);
`run` raises it. A process waiting while another part has failed raises
`Stopped`, which `run` swallows in favour of the recorded error.
"""

import numpy as np

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Channel, Cluster, Compute, DeadlockError, Get, LoopState
from jaxsgd.scheduler.core import Process, Put, Ready, Send, blocked_report
from jaxsgd.scheduler.costs import TRANSFER
from jaxsgd.scheduler.snapshot import NotResumableError
from jaxsgd.scheduler.timeline import TaskRecord, Timeline


# How many unfinished tasks a lane may have before a process that dispatched one waits
# for it (`ProcessExecutor(run_ahead=...)`, and the virtual clock simulating it): a
# stage's forward, backward and update of one iteration, and the next forward.
RUN_AHEAD = 4
# How many calls a lane must still have queued behind a task the driver ran ahead of to
# hold that task's end back (`LaneRuntime._answer`): with one call left it sends the ends
# it holds, so that the driver hears of room on the lane while the lane runs that call,
# and a process waiting for room (`ProcessExecutor.start_task`) sends its next tasks
# before the lane has run dry. Holding until none was left, every lane idled for a round
# trip through the driver every run-ahead bound's worth of tasks.
HOLD_WHILE_QUEUED = 2


def holds_ends(calls_behind: int) -> bool:
  """Whether a lane with `calls_behind` calls queued behind the one it runs, or waits in,
  holds the end of a task run ahead (`HOLD_WHILE_QUEUED`), rather than sending what it
  holds: the lane process's rule, and the virtual clock's model of it."""
  return calls_behind >= HOLD_WHILE_QUEUED


def waits_for_room(ahead: bool, run_ahead: int, unfinished: int) -> bool:
  """Whether a task that may run ahead (`ahead`) waits for room on a lane that has
  `unfinished` tasks, under the bound `run_ahead` (the process executor's rule, and the
  virtual clock's model of it). Below a bound of `HOLD_WHILE_QUEUED` the lane would have
  no call left to run when the driver hears of room: the process waits for its own task
  instead, dispatched at once."""
  return ahead and run_ahead >= HOLD_WHILE_QUEUED and unfinished >= run_ahead


class Stopped(Exception):
  """Raised where a process waits once another part of the run has failed."""


class Executor:
  """Runs the processes of a cluster; subclasses say when things happen (see above)."""

  clock = ''

  def run(
    self, cluster: Cluster, processes: list[Process], *, resume: dict | None = None
  ) -> Timeline:
    """Runs `processes` until all are done; their tasks as a `Timeline`.

    `resume`: a decoded `snapshot()` of a clock that saves (module docstring), to go on
    from. Raises the first exception of any process or task, or `DeadlockError` when
    the unfinished processes all wait on channels nobody will fill.
    """
    if resume is not None and not hasattr(self, 'snapshot'):
      raise ValueError(f'the {self.clock} clock cannot resume a run.')
    self._resume = resume
    self.policy_processes = list(processes)  # (a checkpoint names them by index)
    try:
      return self._run(cluster, processes)
    finally:
      self._resume = None

  def _run(self, cluster: Cluster, processes: list[Process]) -> Timeline:
    self.cluster = cluster
    self.processes = list(processes)
    self.records: list[TaskRecord] = []
    self.failure: BaseException | None = None
    self.begin()
    try:
      try:
        self.execute()
      except Stopped:
        pass  # Another part failed first; its exception is raised below.
      if self.failure is None:
        stuck = blocked_report(self.processes)
        if stuck:
          raise DeadlockError(f'{self.clock} clock: {stuck}')
    finally:
      self.close_processes()
    if self.failure is not None:
      raise self.failure
    return Timeline([lane.name for lane in cluster.lanes], self.records, self.clock)

  # --- the ops, once for every clock --------------------------------------------------------
  def advance(self, process: Process, value) -> None:
    """Runs `process` up to its next op with `value` sent in, and dispatches the op."""
    try:
      op = process.program.send(value)
    except StopIteration:
      process.done = True
      process.forget()
      return
    if isinstance(op, Compute):
      self.start_task(process, process.lane if op.lane is None else op.lane, op)
    elif isinstance(op, Get):
      self.take(process, op.channel)
    elif isinstance(op, Send):
      self.send(process, op)
      self.resume(process, None)
    elif isinstance(op, Put):
      self.deliver(op.channel, op.value)
      self.resume(process, None)
    elif isinstance(op, Ready):
      self.when_ready(process, op.value)
    else:
      raise TypeError(f'{process.name} yielded {op!r}; expected Compute, Send, Put, Get or Ready.')

  def take(self, process: Process, channel: Channel) -> None:
    """`Get`: resume with the channel's next item, or wait for one."""
    if channel.items:
      self.resume(process, channel.items.popleft())
    else:
      process.waiting_on = channel
      channel.waiters.append(process)

  def deliver(self, channel: Channel, item) -> None:
    """Hands `item` to the first process waiting on `channel`, or queues it."""
    if channel.waiters:
      waiter = channel.waiters.popleft()
      waiter.waiting_on = None
      self.resume(waiter, item)
    else:
      channel.items.append(item)

  def send(self, process: Process, op: Send) -> None:
    """`Send`: delivered at once on the same lane; else a transfer on the link lane."""
    channel = op.channel
    if channel.lane == process.lane or not self.needs_transfer(op.value, channel):
      self.deliver(channel, op.value)
      return
    link = self.cluster.link(process.lane, channel.lane)
    fn, args, nbytes, arrays = self.transfer_call(op.value, channel)
    copy = Compute(fn, args, TRANSFER, batch=op.batch, lane=link, nbytes=nbytes, arrays=arrays)
    transfer_state = LoopState(copy=copy, channel=channel)
    self.spawn(Process.resumable(f'transfer to {channel.name}', link, _transfer, transfer_state))

  def record(self, task: TaskRecord) -> None:
    self.records.append(task)

  def fail(self, error: BaseException) -> None:
    """Records the run's first error (`run` raises it)."""
    if self.failure is None:
      self.failure = error

  # --- hooks: what a clock decides ------------------------------------------------------------
  def now(self) -> float:
    raise NotImplementedError

  def begin(self) -> None:
    pass

  def execute(self) -> None:
    raise NotImplementedError

  def resume(self, process: Process, value) -> None:
    raise NotImplementedError

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    raise NotImplementedError

  def task_finished(self, process: Process, result) -> None:
    self.resume(process, result)

  def when_ready(self, process: Process, value) -> None:
    """`Ready`: here a `Compute` resumes its process at the task's end, so every value a
    process holds exists already."""
    self.resume(process, value)

  def spawn(self, process: Process) -> None:
    self.resume(process, None)

  def needs_transfer(self, value, channel: Channel) -> bool:
    del value, channel
    return True

  def copy_for_send(self, value, channel: Channel):
    return transfer.to_device(value, channel.device)

  def transfer_call(self, value, channel: Channel) -> tuple:
    """`(fn, args, nbytes, arrays)` of the transfer task a `Send` of `value` to `channel`
    runs (its bytes and arrays price it on the virtual clock; 0 and 1 elsewhere)."""
    return self.copy_for_send, (value, channel), self.message_bytes(value), 1

  def message_bytes(self, value) -> int:
    del value
    return 0

  def fetch(self, value):
    return value

  def deferred(self, value):
    return value

  def close(self) -> None:
    pass

  def close_processes(self) -> None:
    for process in self.processes:
      process.close()

  # --- checkpoints (module docstring) ------------------------------------------------------
  def save_processes(self, live: list[Process]) -> dict:
    """The links made so far, the channels (items, waiters), every process in `live` or
    waiting on a channel (each once, in a fixed order: its `LoopState`) and the timeline
    so far. Raises `NotResumableError` for a process that is not resumable."""
    channels = [(list(c.items), list(c.waiters)) for c in self.cluster.channels]
    live = list(dict.fromkeys([*live, *(p for _, waiters in channels for p in waiters)]))
    for process in live:
      if process.state is None:
        raise NotResumableError(
          f'checkpoint: {process.name} is not a resumable process (core.LoopState).'
        )
    return {
      'links': self.cluster.links,
      'channels': channels,
      'processes': [(p, p.done, p.state) for p in live],
      'records': records_as_arrays(self.records),
    }

  def drained_snapshot(self, ready) -> dict:
    """A snapshot taken at a drained point (the real clocks': no task in flight), in the
    virtual clock's form: `ready`, the `(process, value)` pairs about to go on, are its
    events."""
    events = [(0.0, order, 'advance', p, value) for order, (p, value) in enumerate(ready)]
    live = [*self.policy_processes, *(p for p, _ in ready)]
    return {'now': self.now(), 'events': events, **self.save_processes(live)}

  def load_drained(self, saved: dict) -> list:
    """Puts back the processes and channels of a `drained_snapshot` (the clock sets its
    time first); returns the `(process, value)` pairs that go on, in saved order."""
    if saved.get('queued') or any(kind != 'advance' for _, _, kind, *_ in saved['events']):
      raise ValueError(
        f'checkpoint: saved with tasks in flight (the virtual clock); the {self.clock} '
        'clock resumes from a drained point only.'
      )
    pending = self.load_processes(saved)
    ready = []
    for _, _, _, process, value in saved['events']:
      pending.pop(process, None)  # Its op was dispatched: it goes on with the value.
      ready.append((process, value))
    self.load_channels(saved, pending)
    return ready

  def load_processes(self, saved: dict) -> dict:
    """Makes the saved links, restores the timeline and starts every saved process again
    from its state; returns `{process: the op it yielded again}` for those that were
    suspended at one (the clock puts each back, then calls `load_channels`)."""
    for source, destination in saved['links']:
      self.cluster.link(source, destination)
    self.records.extend(records_from_arrays(saved['records']))
    pending = {}
    for process, done, state in saved['processes']:
      process.restart(state)
      process.done = done
      if not done and state.phase is not None:
        pending[process] = process.program.send(None)
    return pending

  def load_channels(self, saved: dict, pending: dict) -> None:
    """Puts the channels' items and waiters back (each waiter re-yielded its `Get`), checks
    that every pending op went somewhere and adds the spawned processes to the run."""
    for channel, (items, waiters) in zip(self.cluster.channels, saved['channels'], strict=True):
      channel.items.extend(items)
      for process in waiters:
        expect_op(pending.pop(process), Get, process)
        process.waiting_on = channel
        channel.waiters.append(process)
    if pending:
      raise ValueError(f'checkpoint: {", ".join(p.name for p in pending)} saved nowhere.')
    known = set(map(id, self.processes))
    self.processes += [p for p, _, _ in saved['processes'] if id(p) not in known]  # spawned


class ReadyWait:
  """A process in `Ready`: it goes on with `value` once every one of `pending` (the tasks
  that made the value, as its executor tracks them) has ended."""

  __slots__ = ('process', 'value', 'pending')

  def __init__(self, process: Process, value, pending: set):
    self.process, self.value, self.pending = process, value, pending

  def ended(self, task) -> bool:
    """Notes that `task` ended; whether the process may go on now."""
    self.pending.discard(task)
    return not self.pending


def expect_op(op, kind, process):
  """`op` if it is a `kind` (what a resumed process re-yielded where it was saved)."""
  if not isinstance(op, kind):
    raise ValueError(f'checkpoint: {process.name} resumed at {op!r}, expected a {kind.__name__}.')
  return op


_NONE = -(2**62)  # None in the integer columns of a saved timeline


def records_as_arrays(records) -> dict:
  """A timeline's records as columns of arrays (what a checkpoint saves)."""
  kinds = sorted({r.kind for r in records})
  index = {kind: i for i, kind in enumerate(kinds)}
  column = lambda values: np.asarray([_NONE if v is None else v for v in values], np.int64)  # noqa: E731
  return {
    'kinds': kinds,
    'lane': column(r.lane for r in records),
    'kind': np.asarray([index[r.kind] for r in records], np.int64),
    'start': np.asarray([r.start for r in records], np.float64),
    'end': np.asarray([r.end for r in records], np.float64),
    'stage': column(r.stage for r in records),
    'batch': column(r.batch for r in records),
  }


def records_from_arrays(saved: dict) -> list[TaskRecord]:
  value = lambda v: None if v == _NONE else int(v)  # noqa: E731
  return [
    TaskRecord(int(lane), saved['kinds'][kind], float(start), float(end), value(stage), value(b))
    for lane, kind, start, end, stage, b in zip(
      saved['lane'], saved['kind'], saved['start'], saved['end'], saved['stage'], saved['batch']
    )
  ]


def _transfer(s: LoopState):
  """A transfer process (`s.copy`, `s.channel`): the copy is a task on the link lane,
  delivered at its end."""
  if s.enter('copy'):
    s.copied = yield s.copy
  if s.enter('deliver'):
    yield Put(s.channel, s.copied)
