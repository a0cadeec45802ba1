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
      advance(p, value): op = p.send(value)
        Compute → start now if the lane is free, else queue on the lane
        Get     → resume now with the next item, or wait for a delivery
        Send    → a transfer task on the link lane; deliver at its end; resume now
        Put     → deliver now; resume now
      finish(task): lane free; advance(p, result); start the lane's next waiter
"""

import heapq
import itertools
from collections import defaultdict, deque

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.core import Cluster, Compute, DeadlockError, Get, Process, Put, Send
from jaxsgd.scheduler.core import blocked_report
from jaxsgd.scheduler.costs import TRANSFER, CostModel
from jaxsgd.scheduler.timeline import TaskRecord, Timeline


class VirtualExecutor:
  """Runs processes in simulated time with durations from `cost_model`."""

  clock = 'virtual'

  def __init__(self, cost_model: CostModel):
    self.cost_model = cost_model
    self._now = 0.0

  def now(self) -> float:
    """Simulated seconds since the start of the run."""
    return self._now

  def run(self, cluster: Cluster, processes: list[Process]) -> Timeline:
    self._cluster, self._now = cluster, 0.0
    self._events, self._seq = [], itertools.count()
    self._busy: dict[int, bool] = defaultdict(bool)
    self._queued: dict[int, deque] = defaultdict(deque)
    self._records: list[TaskRecord] = []
    self._sampler = self.cost_model.sampler()
    self._processes = list(processes)
    for process in self._processes:
      self._at(0.0, self._advance, process, None)
    try:
      while self._events:
        self._now, _, fn, args = heapq.heappop(self._events)
        fn(*args)
      stuck = blocked_report(self._processes)
    finally:
      for process in self._processes:
        process.close()
    if stuck:
      raise DeadlockError(f'virtual clock: {stuck}')
    return Timeline([lane.name for lane in cluster.lanes], self._records, self.clock)

  # --- events ---------------------------------------------------------------------------
  def _at(self, time, fn, *args):
    heapq.heappush(self._events, (time, next(self._seq), fn, args))

  def _advance(self, process: Process, value) -> None:
    try:
      op = process.program.send(value)
    except StopIteration:
      process.done = True
      return
    if isinstance(op, Compute):
      lane = process.lane if op.lane is None else op.lane
      self._queued[lane].append((process, op))
      self._start_next(lane)
    elif isinstance(op, Get):
      self._get(process, op.channel)
    elif isinstance(op, Send):
      self._send(process, op)
      self._at(self._now, self._advance, process, None)
    elif isinstance(op, Put):
      self._deliver(op.channel, op.value)
      self._at(self._now, self._advance, process, None)
    else:
      raise TypeError(f'{process.name} yielded {op!r}; expected Compute, Send, Put or Get.')

  def _start_next(self, lane: int) -> None:
    if self._busy[lane] or not self._queued[lane]:
      return
    process, op = self._queued[lane].popleft()
    self._busy[lane] = True
    start = self._now
    result = op.fn(*op.args)  # Reads its inputs now, at the simulated start.
    duration = self._sampler.duration(op.kind, op.stage, lane, op.nbytes)
    self._at(start + duration, self._finish, process, op, lane, start, result)

  def _finish(self, process, op, lane, start, result) -> None:
    self._records.append(TaskRecord(lane, op.kind, start, self._now, op.stage, op.batch))
    self._busy[lane] = False
    self._advance(process, result)  # Publishes its results now, at the simulated end.
    self._start_next(lane)

  # --- channels -------------------------------------------------------------------------
  def _get(self, process, channel) -> None:
    if channel.items:
      self._at(self._now, self._advance, process, channel.items.popleft())
    else:
      process.waiting_on = channel
      channel.waiters.append(process)

  def _deliver(self, channel, item) -> None:
    if channel.waiters:
      waiter = channel.waiters.popleft()
      waiter.waiting_on = None
      self._at(self._now, self._advance, waiter, item)
    else:
      channel.items.append(item)

  def _send(self, process, op: Send) -> None:
    channel = op.channel
    if channel.lane == process.lane:
      self._deliver(channel, op.value)
      return
    link = self._cluster.link(process.lane, channel.lane)
    copy = Compute(
      transfer.to_device,
      (op.value, channel.device),
      kind=TRANSFER,
      batch=op.batch,
      lane=link,
      nbytes=transfer.nbytes(op.value),
    )
    mover = Process(f'transfer to {channel.name}', link, _transfer(copy, channel))
    self._at(self._now, self._advance, mover, None)


def _transfer(copy: Compute, channel):
  """A transfer process: the copy is a task on the link lane, delivered at its end."""
  copied = yield copy
  yield Put(channel, copied)
