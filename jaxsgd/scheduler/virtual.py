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
from collections import defaultdict, deque
from collections.abc import Mapping

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Compute, Process
from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.executor import Executor
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
  ):
    """`lane_hardware`: placement lane name (`placement.lane_name`) -> hardware key, for
    lanes placed on one piece of hardware (`placement.lanes`) beyond `LaneSpec.shares`.
    `copies_on_sender`: a transfer occupies the sending lane's hardware (FIFO with its
    tasks), not a link of its own (`cost.copies='sender'`)."""
    self.cost_model = cost_model
    self.lane_hardware = dict(lane_hardware or {})
    self.copies_on_sender = copies_on_sender
    self._now = 0.0

  def now(self) -> float:
    """Simulated seconds since the start of the run."""
    return self._now

  def begin(self) -> None:
    self._now = 0.0
    self._events, self._seq = [], itertools.count()
    self._busy: dict[int, bool] = defaultdict(bool)
    self._queued: dict[int, deque] = defaultdict(deque)
    self._sampler = self.cost_model.sampler()
    self._hardware_of: dict[int, object] = {}

  def execute(self) -> None:
    for process in self.processes:
      self.resume(process, None)
    while self._events:
      self._now, _, fn, args = heapq.heappop(self._events)
      fn(*args)

  def resume(self, process: Process, value) -> None:
    self._at(self._now, self.advance, process, value)

  def start_task(self, process: Process, lane: int, op: Compute) -> None:
    self._queued[self._hardware(lane)].append((process, lane, op))
    self._start_next(self._hardware(lane))

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
    (several stages placed on one device run their tasks one at a time). A link is the
    pair of hardware it joins: transfers between two devices share one FIFO link,
    whichever lanes of those devices send them; with `copies_on_sender`, the sender's."""
    hardware = self._hardware_of.get(lane)
    if hardware is None:
      spec = self.cluster.lanes[lane]
      if spec.link is not None and self.copies_on_sender:
        hardware = self._hardware(spec.link[0])
      elif spec.link is not None:
        hardware = ('link', *map(self._hardware, spec.link))
      elif spec.shares is not None:
        hardware = spec.shares
      else:
        hardware = self.lane_hardware.get(lane_name(spec.name), lane)
      self._hardware_of[lane] = hardware
    return hardware

  def _start_next(self, hardware) -> None:
    if self._busy[hardware] or not self._queued[hardware]:
      return
    process, lane, op = self._queued[hardware].popleft()
    self._busy[hardware] = True
    start = self._now
    result = op.fn(*op.args)  # Reads its inputs now, at the simulated start.
    duration = self._sampler.duration(op.kind, op.stage, lane, op.nbytes)
    self._at(start + duration, self._finish, process, op, lane, start, result)

  def _finish(self, process, op, lane, start, result) -> None:
    self.record(TaskRecord(lane, op.kind, start, self._now, op.stage, op.batch))
    self._busy[self._hardware(lane)] = False
    self.task_finished(process, result)
    self._start_next(self._hardware(lane))
