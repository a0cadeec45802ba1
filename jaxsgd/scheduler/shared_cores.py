"""Lanes that share a CPU core as operating system processes, on the virtual clock.

With a process executor's host (`cost.host`): lanes that `lane_hardware`
(`placement.lanes`) places on one core are processes of their own, as the process
executor's lanes are, and the core runs them as an operating system does
(`TimeSlicedCore`): each lane runs its own tasks one at a time, and the n tasks running on
the core at once each progress at 1/n of its speed (`share` / n while the host's own
processes take part of every core: `TimeSlicedVirtualExecutor.core_shares`).

With `copies_on_sender`, a sender's copies are one more queue on its core, beside its
tasks (a lane process exports in a thread of its own, on the cores it is placed on; an
unplaced lane's copies share no core). With `receiver_reads` too (values that cross a
socket: `moves=socket`, or a host profile measured so), a copy takes the receiver's core
as well, for the same seconds: a lane process's reader thread reads each message from
its socket as it arrives, whatever the lane computes meanwhile (`LaneRuntime._read_lane`),
so a copy is a memory copy at both ends. Without it the copy's bytes lie in memory both
ends share (`wire.Arena`, the host path within a host): the sender writes them once and
the receiver reads only the message naming them. The copy ends once both ends have done
their part (the sender's socket fills until the reader drains it), and not before its
link time. With the host profile's export figures (`cost.export`) the sender's part is
its export alone, which holds the sender's copies' queue and interpreter
(`LaneProcessModel._exported`: a lane blocked in a socket write lets its other threads
run); without them, the whole copy's. Between two lanes on one core both parts take that
core: 2x the link time of its work. Measured over sockets (`benchmarks/copy_receiver.py`):
a copy of 4-64 MB arriving at a lane pinned to a core makes the task computing there
longer by 0.9-2.1x the copy's link time (medians 1.14 and 1.20 over the sizes), and by
1.6-2.5x (median 1.75) when it comes from a lane of the same core.

`TimeSlicedVirtualExecutor` overrides two hooks of `VirtualExecutor`: `_hardware_key`
(such a lane's queue is its own, its core shared) and `_occupy` (a task on a shared core
ends when the core's shares say; a copy when both ends' shares say).
`TimeSlicedLaneProcessModel` is the same over the process executor's schedule
(`virtual_processes`). The cores' shares are not data: a run with time-sliced cores takes
no checkpoint (`settings`, `checkpoint_every`).
"""

import functools
import itertools
from collections.abc import Mapping

from jaxsgd.scheduler.placement import lane_name
from jaxsgd.scheduler.virtual import VirtualExecutor
from jaxsgd.scheduler.virtual_processes import LaneProcessModel


class TimeSlicedVirtualExecutor(VirtualExecutor):
  """`VirtualExecutor` whose lanes placed on one core (`lane_hardware`) time-slice it."""

  def __init__(self, cost_model, *, core_shares: Mapping[str, float] | None = None, **options):
    """`core_shares`: CPU cores (`lane_hardware` values) -> the share of each that its
    lanes get while every one of these cores runs a task; the rest is the host's own
    processes' (a host profile's `upkeep`: `host.simulated`), which otherwise run on a
    core with no task (they are not pinned; the lanes are)."""
    for core, share in (core_shares or {}).items():
      if not 0 < share <= 1:
        raise ValueError(f'core_shares: a share of a core in (0, 1], got {share!r} for {core!r}.')
    super().__init__(cost_model, **options)
    shares = dict(core_shares or {})
    self.core_shares = shares if any(share != 1 for share in shares.values()) else {}

  def begin(self) -> None:
    super().begin()
    self._cores: dict = {}  # queue key -> the `TimeSlicedCore` it runs on
    self._core_named: dict = {}  # `lane_hardware` key -> its `TimeSlicedCore`
    self._every_core_busy = False  # every core of `core_shares` runs a task

  def _core_busy_changed(self) -> None:
    """A core began or stopped running tasks: while every core of `core_shares` runs one,
    each gives its lanes its share, else each the whole of itself."""
    if not self.core_shares:
      return
    cores = [self._core_named.get(name) for name in self.core_shares]
    every_core_busy = all(core is not None and core.running for core in cores)
    if every_core_busy != self._every_core_busy:
      self._every_core_busy = every_core_busy
      for core, share in zip(cores, self.core_shares.values()):  # a fixed order
        if core is not None:
          core.set_share(share if every_core_busy else 1.0)

  def _hardware_key(self, lane: int):
    """A compute lane placed on a core: a queue of its own (a lane process runs one task
    at a time) on the shared core. A copy on a sender that is on a core: the sender's
    copies' queue on that core."""
    spec = self.cluster.lanes[lane]
    if spec.link is None and spec.shares is None:
      core_name = self.lane_hardware.get(lane_name(spec.name))
      if core_name is not None:
        return self._on_core(('process', lane), core_name)
    hardware = super()._hardware_key(lane)
    if spec.link is not None and self.copies_on_sender:  # ('copies', sender)
      sender = self._hardware(spec.link[0])
      if sender in self._cores:
        self._cores[hardware] = self._cores[sender]
    return hardware

  def _on_core(self, queue_key, core_name: str):
    core = self._core_named.get(core_name) or TimeSlicedCore(self)
    self._cores[queue_key] = self._core_named[core_name] = core
    return queue_key

  def _occupy(self, hardware, seconds: float, running: tuple) -> None:
    core = self._cores.get(hardware)
    receivers_core = self._receivers_core(running[2]) if seconds > 0 else None  # no work
    if core is None and receivers_core is None:
      super()._occupy(hardware, seconds, running)
      return
    sending, sent = self._sending(hardware, seconds, running)
    rest = receivers_core is not None or sending < seconds  # a part beyond the sender's
    parts = _Parts(2 if rest else 1, self._finish, running)

    def sender_done():
      if sent is not None:
        sent()
      parts.part_ended()

    if core is None:  # an unplaced sender: its part takes no core
      self._at(self._now + sending, sender_done)
    else:
      core.add(sending, sender_done)
    if receivers_core is not None:
      receivers_core.add(seconds, parts.part_ended)
    elif rest:
      self._at(self._now + seconds, parts.part_ended)

  def _sending(self, hardware, seconds: float, running: tuple):
    """Hook: `(seconds of work, what to do when done)` of the sending end of what
    `running` puts on `hardware`: all of it, nothing more."""
    del hardware, running
    return seconds, None

  def _receivers_core(self, lane: int):
    """The core of the lane a copy on `lane` goes to, where its reader thread takes it
    (`copies_on_sender`: lane processes, reading it out of a socket: `receiver_reads`);
    None for a task, a receiver on no core, or a copy in memory both ends share."""
    link = self.cluster.lanes[lane].link
    if link is None or not self.copies_on_sender or not self.receiver_reads:
      return None
    return self._cores.get(self._hardware(link[1]))


class TimeSlicedLaneProcessModel(TimeSlicedVirtualExecutor, LaneProcessModel):
  """`LaneProcessModel` (the process executor's schedule) on time-sliced cores. A copy
  that lets go of its sender after its export (`cost.export`) puts only that export's
  seconds on the sender's core, and lets go when that work is done there; the receiver's
  part is the whole copy's, as without the figure."""

  def _sending(self, hardware, seconds: float, running: tuple):
    export = self._export_seconds(running)
    if export is None:
      return seconds, None
    return min(export, seconds), functools.partial(self._exported, hardware, running[-1])


class TimeSlicedCore:
  """A core shared by the lanes placed on it, as an operating system shares it between
  processes: processor sharing. With n tasks running, each progresses at `share` / n of
  the core's speed; a task's cost is the seconds it would take alone.

      remaining_i -= (now - last) · share / n          at every arrival and departure
      next end = now + min_i remaining_i · n / share   (one event; superseded ones ignored)

  `share` (1: the whole core) is what the host's own processes leave to the lanes while
  every core has a task: then they run only by taking a slice of some lane's core (a
  host profile's `upkeep`, spread over the cores: `host.simulated`); while a core
  has none they run there (`TimeSlicedVirtualExecutor._core_busy_changed`).

  Linux's scheduler gives each runnable process of one core an equal share over a few
  milliseconds (CFS), which this fluid model approximates for tasks of a few ms or more;
  a lane's own tasks still run one at a time (its queue, `_hardware_key`).
  Everything is arithmetic in a fixed order, so a run stays deterministic.
  """

  def __init__(self, executor: 'TimeSlicedVirtualExecutor'):
    self.executor = executor
    self.share = 1.0
    self.running: list = []  # [remaining seconds alone, arrival number, on_end]
    self.last = 0.0
    self.generation = 0
    self.arrivals = itertools.count()

  def add(self, seconds: float, on_end) -> None:
    """`on_end()` once `seconds` of work, at the core's shares from now, are done."""
    self._advance()
    self.running.append([seconds, next(self.arrivals), on_end])
    if len(self.running) == 1:
      self.executor._core_busy_changed()  # pylint: disable=protected-access
    self._schedule()

  def set_share(self, share: float) -> None:
    """From now on the core's lanes get `share` of it (the work done so far at the old)."""
    self._advance()
    self.share = share
    self._schedule()

  def _advance(self) -> None:
    now = self.executor.now()
    if self.running:
      work = (now - self.last) * self.share / len(self.running)
      for entry in self.running:
        entry[0] -= work
    self.last = now

  def _schedule(self) -> None:
    self.generation += 1
    if self.running:
      first = min(self.running, key=lambda e: (e[0], e[1]))
      end = self.executor.now() + max(first[0], 0.0) * len(self.running) / self.share
      self.executor._at(end, self._end, self.generation, first[1])  # pylint: disable=protected-access

  def _end(self, generation: int, arrival: int) -> None:
    if generation != self.generation:
      return  # superseded by a later arrival or departure
    self._advance()
    done = [e for e in self.running if e[1] == arrival or e[0] <= 1e-12]
    self.running = [e for e in self.running if not any(e is d for d in done)]
    for _, _, on_end in done:
      on_end()
    if not self.running:
      self.executor._core_busy_changed()  # pylint: disable=protected-access
    self._schedule()


class _Parts:
  """A task done in parts (a copy: the sender's and the receiver's): `fn(*args)` once
  every part has ended."""

  def __init__(self, parts: int, fn, args: tuple):
    self.left, self.fn, self.args = parts, fn, args

  def part_ended(self) -> None:
    self.left -= 1
    if self.left == 0:
      self.fn(*self.args)
