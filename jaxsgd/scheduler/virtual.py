"""The virtual clock: a deterministic discrete-event simulation of a cluster.

Every task still runs its real JAX computation, but *when* it runs is decided by simulated
time. A task starts when its lane is free (FIFO among waiters); at its start the executor
calls `fn(*args)` (JAX dispatches it asynchronously and the simulation moves on without
waiting) and draws its duration from the `CostModel`; at its end the process resumes with
the result and publishes it. Events at equal times run in the order they were scheduled,
so a run depends on nothing but the programs, the costs and the seed: same seed, same bits.

    now = 0; schedule(advance every process at 0)
    while events: pop the earliest (time, seq) event; now = time; run it
      resume(p, value)     → schedule advance(p, value) now (after what is scheduled)
      start_task(p, op)    → start now if the lane is free, else queue on the lane (lanes
                             that share hardware, `LaneSpec.shares`, share one queue)
      finish(task)         → lane free; advance(p, result) at once; start the lane's
                             next waiter

What the ops mean (channels, transfers over link lanes) is the `Executor` base's. A task
occupies its lane's hardware (`_hardware`): the lane, what it shares (`LaneSpec.shares`,
`lane_hardware`), or for a transfer the link between two pieces of hardware (the sender's
copies' queue with `copies_on_sender`), each running its tasks one at a time.

This schedule is the in-process clocks'. Subclasses change it through the loop's hooks,
never by branches in it; `make(...)` picks the class a run's settings ask for:
`virtual_processes.LaneProcessModel`, the process executor's schedule (running ahead, a
simulated driver, lanes importing and taking in results: `start_task`, `_next_startable`,
`_compute`, `_duration`, `_task_ended`, `_finish`), and `shared_cores`' time-sliced cores.

Checkpoints: `between_events` (if set) is called after every event, where the whole
state is data: `snapshot()` returns it (the event queue as 'advance process P with V'
and 'the task of P on lane L, started at s, ends at t with result R', the queued tasks
per hardware, channel items and waiters, the sampler's random streams, the timeline),
and `run(..., resume=snapshot)` continues from it: every process is started again from
its saved `LoopState` and re-yields its pending op, which goes back where it was.
"""

import heapq
import itertools
from collections import deque
from collections.abc import Mapping

import jax
import numpy as np

from jaxsgd.scheduler import snapshot as snapshot_lib
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Compute, Process
from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.executor import Executor, expect_op
from jaxsgd.scheduler.placement import lane_name
from jaxsgd.scheduler.timeline import TaskRecord


def make(
  cost_model: CostModel,
  *,
  lane_hardware: Mapping[str, str] | None = None,
  copies_on_sender: bool = False,
  receiver_reads: bool = True,
  time_sliced: bool = False,
  core_shares: Mapping[str, float] | None = None,
  run_ahead: int = 0,
) -> 'VirtualExecutor':
  """The virtual clock for a run's settings: `run_ahead` 0, a process goes on when its task
  ends (`VirtualExecutor`); N > 0, the process executor's schedule, bound N (as its host
  profile, `cost.host`, asks: `LaneProcessModel`); `time_sliced`, lanes that `lane_hardware`
  places on one core share it, CPU cores `core_shares` (`shared_cores`, which imports this)."""
  from jaxsgd.scheduler.shared_cores import TimeSlicedLaneProcessModel, TimeSlicedVirtualExecutor
  from jaxsgd.scheduler.virtual_processes import LaneProcessModel

  sliced = {'core_shares': core_shares} if time_sliced else {}
  options = dict(
    lane_hardware=lane_hardware,
    copies_on_sender=copies_on_sender,
    receiver_reads=receiver_reads,
    **sliced,
  )
  if not run_ahead:
    return (TimeSlicedVirtualExecutor if time_sliced else VirtualExecutor)(cost_model, **options)
  ahead = TimeSlicedLaneProcessModel if time_sliced else LaneProcessModel
  return ahead(cost_model, run_ahead=run_ahead, **options)


class VirtualExecutor(Executor):
  """Runs processes in simulated time with durations from `cost_model`; a process goes on
  when its task ends. A queued task is `(process, lane, op, *extra)`, a running one
  `(process, op, lane, start, result, *extra)`: `extra` is what a subclass queues with a
  task (nothing here), handed back to its hooks."""

  clock = 'virtual'
  run_ahead = 0  # unfinished tasks a lane may have while its process goes on (none)

  def __init__(
    self,
    cost_model: CostModel,
    *,
    lane_hardware: Mapping[str, str] | None = None,
    copies_on_sender: bool = False,
    receiver_reads: bool = True,
  ):
    """`lane_hardware`: placement lane name (`placement.lane_name`) -> hardware key, for
    lanes placed on one piece of hardware (`placement.lanes`) beyond `LaneSpec.shares`.
    `copies_on_sender`: the sending lane's process makes a transfer in a thread of its
    own (a lane process exports what it sends): one at a time beside its tasks, not on a
    link of their own. `receiver_reads` (with it): the receiving lane's process reads the
    copy's bytes on its own cores (out of a socket), else it reads none of them (they
    lie in memory both processes share): `shared_cores`."""
    if cost_model.simulates_driver and not self.run_ahead:
      raise ValueError(
        f'driver / driver_latency: {cost_model.driver!r} / {cost_model.driver_latency!r} s '
        "simulate the process executor's driver, whose schedule is run_ahead > 0 (a host "
        'profile of the process executor); give run_ahead, or set both to 0.'
      )
    self.cost_model = cost_model
    self.lane_hardware = dict(lane_hardware or {})
    self.copies_on_sender = copies_on_sender
    self.receiver_reads = receiver_reads
    self._now = 0.0
    self.between_events = None  # called after every event (checkpoints), if set
    self.notes_vjps = False  # records the task of every vjp (`snapshot.note_vjps`)

  def now(self) -> float:
    return self._now  # simulated seconds since the start of the run

  def begin(self) -> None:
    self._now = 0.0
    self._events, self._seq = [], itertools.count()
    self._busy: set = set()  # hardware running a task
    self._queued: dict = {}  # hardware -> deque of the tasks waiting for it
    self._hardware_of: dict[int, object] = {}  # lane -> its hardware (`_hardware`)
    self._sampler = self.cost_model.sampler()

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
    self._enqueue((process, lane, op))

  def task_finished(self, process: Process, result) -> None:
    self.advance(process, result)  # Publishes its results now, at the simulated end.

  def transfer_call(self, value, channel) -> tuple:
    """The base's transfer task, the message flattened once for its bytes (counted only
    where a message's cost depends on them) and for whether it is on the channel's
    device already (then handed on as it is, as `copy_for_send` would): a flatten of a
    pushed gradient costs ~11 µs of a simulated ASGD session's host time."""
    leaves = jax.tree_util.tree_leaves(value)
    nbytes = transfer.leaves_nbytes(leaves) if self.cost_model.prices_bytes else 0
    if channel.device is None or transfer.leaves_on_device(leaves, channel.device):
      return _as_it_is, (value,), nbytes, len(leaves)
    return self.copy_for_send, (value, channel), nbytes, len(leaves)

  # --- events and hardware ----------------------------------------------------------------
  def _at(self, time, fn, *args):
    heapq.heappush(self._events, (time, next(self._seq), fn, args))

  def _enqueue(self, queued: tuple) -> None:
    """Queues `queued` on its lane's hardware and starts it there if that is free."""
    hardware = self._hardware(queued[1])
    queue = self._queued.get(hardware)
    if queue is None:
      queue = self._queued[hardware] = deque()
    queue.append(queued)
    self._start_if_free(hardware)

  def _start_if_free(self, hardware) -> None:  # (a task, if one waits and `hardware` is free)
    queue = self._queued.get(hardware)  # (None for a task in flight at a resume)
    if queue and hardware not in self._busy:
      self._start_next(hardware, queue)

  def _hardware(self, lane: int):
    """What a task on `lane` occupies (`_hardware_key`), worked out once per lane."""
    hardware = self._hardware_of.get(lane)
    if hardware is None:
      hardware = self._hardware_of[lane] = self._hardware_key(lane)
    return hardware

  def _hardware_key(self, lane: int):
    """Hook: the lane, or the hardware it `shares` with others (several stages placed on
    one device run their tasks one at a time). A link is the pair of hardware it joins:
    transfers between two devices share one FIFO link, whichever lanes of those devices
    send them; with `copies_on_sender`, the sender's copies' queue (its export thread)."""
    spec = self.cluster.lanes[lane]
    if spec.link is not None and self.copies_on_sender:
      return ('copies', spec.link[0])
    if spec.link is not None:
      return ('link', *map(self._hardware, spec.link))
    if spec.shares is not None:
      return spec.shares
    return self.lane_hardware.get(lane_name(spec.name), lane)

  def _start_next(self, hardware, queue: deque) -> None:
    """Starts the task `_next_startable` picks on `hardware` (free, `queue` not empty):
    computes its result now, at its simulated start, and draws its duration."""
    index = self._next_startable(hardware, queue)
    if index is None:
      return
    queued = queue[index]
    del queue[index]
    process, lane, op = queued[:3]
    self._busy.add(hardware)
    result = self._compute(queued)
    if self.notes_vjps:
      snapshot_lib.note_vjps(op.fn, op.args, result)
    running = (process, op, lane, self._now, result, *queued[3:])
    self._occupy(hardware, self._duration(queued), running)

  def _next_startable(self, hardware, queue: deque) -> int | None:
    """Hook: the index in `queue` of the task to start now (None: none can); FIFO: 0."""
    del hardware, queue
    return 0

  def _compute(self, queued: tuple):
    """Hook: the task's result, computed as it starts (it reads its inputs then)."""
    op = queued[2]
    return op.fn(*op.args)

  def _duration(self, queued: tuple) -> float:
    """Hook: how long the task occupies its hardware from its start: its drawn cost."""
    op = queued[2]
    return self._sampler.duration(op.kind, op.stage, queued[1], op.nbytes, op.arrays)

  def _occupy(self, hardware, seconds: float, running: tuple) -> None:
    """Hook: `hardware` runs `running` alone for `seconds` from now; it ends then."""
    del hardware
    heapq.heappush(self._events, (self._now + seconds, next(self._seq), self._finish, running))

  def _finish(self, process, op, lane, start, result, *extra) -> None:
    """A task ends: its hardware is free, `_task_ended` follows, the next task starts."""
    hardware = self._hardware(lane)
    self._busy.discard(hardware)
    self._task_ended(process, op, lane, start, result, *extra)
    self._start_if_free(hardware)

  def _task_ended(self, process, op, lane, start, result) -> None:
    """Hook: the task is recorded and its process goes on at once with its result."""
    self.record(TaskRecord(lane, op.kind, start, self._now, op.stage, op.batch))
    self.task_finished(process, result)

  # --- checkpoints ----------------------------------------------------------------------
  def snapshot(self) -> dict:
    """The simulation between two events, as data (processes, channels and arrays by
    reference: `snapshot.encode` saves it); `processes` lists every live process."""
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
        op = expect_op(pending.pop(process), Compute, process)
        self._queued.setdefault(hardware, deque()).append((process, lane, op))
    self._busy.update(saved['busy'])
    self.load_channels(saved, pending)


def _as_it_is(value):
  """A transfer's task for a message already on its channel's device: the message."""
  return value
