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
"""

import heapq
import itertools
import math
from collections import deque

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Compute, Process
from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.executor import Executor
from jaxsgd.scheduler.timeline import TaskRecord


class VirtualExecutor(Executor):
  """Runs processes in simulated time with durations from `cost_model`."""

  clock = 'virtual'

  def __init__(self, cost_model: CostModel):
    self.cost_model = cost_model
    self._now = 0.0

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

  def execute(self) -> None:
    for process in self.processes:
      self.resume(process, None)
    events, pop = self._events, heapq.heappop
    while events:
      self._now, _, fn, args = pop(events)
      fn(*args)

  def resume(self, process: Process, value) -> None:
    self._at(self._now, self.advance, process, value)

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    hardware = self._hardware(lane)
    queue = self._queued.get(hardware)
    if queue is None:
      queue = self._queued[hardware] = deque()
    queue.append((process, lane, op))
    if hardware not in self._busy:
      self._start_next(hardware, queue)

  def task_finished(self, process: Process, result) -> None:
    self.advance(process, result)  # Publishes its results now, at the simulated end.

  def message_bytes(self, value) -> int:
    """Bytes of a `Send`, counted only where the link's cost depends on them."""
    return transfer.nbytes(value) if math.isfinite(self.cost_model.link_bandwidth) else 0

  # --- events ---------------------------------------------------------------------------
  def _at(self, time, fn, *args):
    heapq.heappush(self._events, (time, next(self._seq), fn, args))

  def _hardware(self, lane: int):
    """What a task on `lane` occupies: the lane, or the hardware it `shares` with others
    (several stages placed on one device run their tasks one at a time). Remembered per
    lane: it is asked twice per task."""
    hardware = self._hardware_of.get(lane)
    if hardware is None:
      shares = self.cluster.lanes[lane].shares
      hardware = self._hardware_of[lane] = lane if shares is None else shares
    return hardware

  def _start_next(self, hardware, queue: deque) -> None:
    """Starts the first task waiting for `hardware` (free, with `queue` not empty)."""
    process, lane, op = queue.popleft()
    self._busy.add(hardware)
    start = self._now
    result = op.fn(*op.args)  # Reads its inputs now, at the simulated start.
    duration = self._sampler.duration(op.kind, op.stage, lane, op.nbytes)
    heapq.heappush(
      self._events,
      (start + duration, next(self._seq), self._finish, (process, op, lane, start, result)),
    )

  def _finish(self, process, op, lane, start, result) -> None:
    self.record(TaskRecord(lane, op.kind, start, self._now, op.stage, op.batch))
    hardware = self._hardware(lane)
    self._busy.discard(hardware)
    self.task_finished(process, result)
    queue = self._queued[hardware]
    if queue and hardware not in self._busy:
      self._start_next(hardware, queue)
