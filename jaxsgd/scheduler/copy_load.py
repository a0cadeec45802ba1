"""Copy threads (and the driver) placed by the load a run measures
(`ProcessExecutor(copies='auto')`).

A lane process's copy threads — the readers of its connections and its export thread:
the values it takes in and sends (`lanes/runtime.py`) — run on its own cores unless
placed elsewhere. Where one lane's cores bound the run and another's wait, the copies
are better run on the waiting cores (`lanes.placement.copies_toward_idle`). Which lane
waits depends on the method, its ratio, the model and the machine, so the run measures
it: once every lane has finished `WARM_TASKS` tasks (a lane's first tasks compile), a
window opens; once every lane has finished `WINDOW_TASKS` more and at least
`WINDOW_SECONDS` have passed, it closes. Over that span each lane's load is its tasks'
CPU (the tasks that finished in it, `Pending.cpu`: a task's own computing) and its copy
threads' CPU (`LanePool.copy_cpu`, read when it opens and when it closes), as shares of
one core. Lanes of the same host are placed by `copies_toward_idle`, once (and put back
at the run's end where the pool goes on to another run: `put_back`); a lane
process that replaces a lost one gets its predecessor's placement (one that replaces
it before then starts the warm-up again: its copies' CPU clock starts at 0). A lane
dropped from the run is dropped from the measure.

The driver's threads are placed at the same time, by the same load: the driver process's
CPU over the window (`time.process_time`) goes to the least busy cores of its host if
they stay no busier than its busiest (`lanes.placement.driver_toward_idle`), and they
are put back on their cores from before once the run ends (`put_driver_back`).

A run too short to fill the window, or with a lane that stops finishing tasks, leaves
the copies where the placement put them. A lane lost while it is asked for its copies'
CPU (`LaneError`) starts the warm-up again (the run's own wait hears of the loss, and
drops or replaces the lane); one lost while its copies move keeps none moved.
"""

import collections
import os
import time
from collections.abc import Iterable, Mapping

from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool, runtime
from jaxsgd.scheduler.lanes.placement import (
  copies_toward_idle,
  describe_copy_loads,
  describe_driver_load,
  driver_toward_idle,
)

WARM_TASKS = 4  # a lane's first tasks compile: their CPU is not the run's
WINDOW_TASKS = 16  # tasks every lane finishes while its load is measured
WINDOW_SECONDS = 0.5  # at least this span, so that a copy thread's CPU clock has moved

COPIES = ('own', 'auto')
_LOST = object()  # what `_ask` returns where the lane asked was lost


def refuse_placed_copies(placement: LanePlacement, lanes: Iterable[str]) -> None:
  """'auto' moves copy threads itself: a placement that puts some of `lanes`' copies
  (`copies=`) is refused rather than overridden."""
  placed = [name for name in lanes if placement[name].copy_cores is not None]
  if placed:
    raise ValueError(
      f"copies: 'auto' places the copy threads by the run's load, but the placement puts "
      f"those of {', '.join(placed)} (copies=...); use copies='own' to keep them there."
    )


class DriverThreads:
  """This process, the driver: its CPU seconds, the cores it may run on, and every thread
  of it pinned (`runtime.pin_threads`; threads it starts later inherit that)."""

  def cpu(self) -> float:
    return time.process_time()

  def allowed(self) -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))

  def pin(self, cores: tuple[int, ...]) -> tuple[int, ...]:
    """Pins to `cores` (of `allowed()` before: pinned, the driver may be given back what
    it had), returns the cores it runs on now."""
    runtime.pin_threads(cores)
    return self.allowed()


class CopiesByLoad:
  """Measures the lanes of `pool` named in `lanes` (the executor's lane index -> pool
  lane) over a window of the run and then places their copy threads (module docstring).

  `finished(lane, cpu, now)` after every task a lane finishes; it returns the line that
  says what was measured and moved when it places them, else None.
  """

  def __init__(self, pool: LanePool, lanes: Mapping[int, str], driver=None):
    self.pool, self.lanes = pool, dict(lanes)
    self.driver = DriverThreads() if driver is None else driver
    self.done = collections.Counter()  # tasks each lane finished, in the current phase
    self.cpu = collections.Counter()  # their CPU seconds, in the window
    self.opened_at: float | None = None
    self.copies_before: dict[str, float] = {}
    self.loads: dict[str, tuple[float, float]] | None = None  # (tasks, copies) per lane
    self.moved: dict[str, tuple[int, ...]] = {}  # lane -> the cores its copies run on
    self.placed_at: float | None = None  # the run's time when they were placed
    self.driver_before = 0.0  # the driver's CPU seconds when the window opened
    self.driver_load: float | None = None  # its CPU over the window, of a core
    self.driver_cores: tuple[int, ...] | None = None  # where it was pinned (None: not)
    self.driver_affinity: tuple[int, ...] | None = None  # its cores before, while pinned

  def finished(self, lane: int, cpu: float | None, now: float) -> str | None:
    if self.loads is not None or lane not in self.lanes:
      return None
    self.done[lane] += 1
    if self.opened_at is not None:
      self.cpu[lane] += cpu or 0.0
    if self.opened_at is None and self._all_done(WARM_TASKS):
      self._open(now)
    elif (
      self.opened_at is not None
      and now - self.opened_at >= WINDOW_SECONDS
      and now > self.opened_at  # (a span to divide by, whatever `WINDOW_SECONDS` is)
      and self._all_done(WINDOW_TASKS)
    ):
      return self._place(now)
    return None

  def replaced(self, name: str) -> None:
    """A new process of lane `name` took a lost one's place: its copies go where the
    lost one's went; before they are placed, the warm-up starts again."""
    if self.loads is None:
      self._restart()
    elif name in self.moved and self._ask(self.pool.place_copies, name, self.moved[name]) is _LOST:
      del self.moved[name]  # (the new process was lost too)

  def put_back(self) -> None:
    """The moved copies back on their lanes' own cores (a pool that serves another run);
    `moved` still says what the run did."""
    for name in self.moved:
      self._ask(self.pool.place_copies, name, None)

  def dropped(self, lane: int) -> None:
    """Lane `lane` left the run (lost, not replaced): it is measured no more, and its
    copies are not put back (it has none)."""
    self.moved.pop(self.lanes.pop(lane, None), None)

  def _all_done(self, tasks: int) -> bool:
    return all(self.done[lane] >= tasks for lane in self.lanes)

  def _restart(self) -> None:
    """The warm-up again: a lane's copy-thread clock started again, or could not be read."""
    self.opened_at = None
    self.done.clear()
    self.cpu.clear()
    self.copies_before.clear()

  def _ask(self, call, *args):
    """`call(*args)` of the pool; `_LOST` where a lane was lost meanwhile (`LaneError`:
    the run's own wait hears of it, and drops or replaces it)."""
    try:
      return call(*args)
    except LaneError:
      return _LOST

  def _copy_cpu(self) -> dict[str, float] | None:
    """Every lane's copy threads' CPU seconds so far; None if a lane was lost."""
    copies = {name: self._ask(self.pool.copy_cpu, name) for name in self.lanes.values()}
    return None if _LOST in copies.values() else copies

  def _open(self, now: float) -> None:
    copies = self._copy_cpu()
    if copies is None:
      self._restart()
      return
    self.opened_at, self.copies_before = now, copies
    self.driver_before = self.driver.cpu()
    self.done.clear()

  def _place(self, now: float) -> str | None:
    span, copies = now - self.opened_at, self._copy_cpu()
    if copies is None:
      self._restart()
      return None
    self.loads = {
      name: (self.cpu[lane] / span, (copies[name] - self.copies_before[name]) / span)
      for lane, name in self.lanes.items()
    }
    placement = self.pool.placement
    hosts = collections.defaultdict(dict)  # copies move between cores of one host only
    for name in self.loads:
      hosts[placement[name].host][name] = self.loads[name]
    cores = {name: placement[name].cores for name in self.loads}
    for loads in hosts.values():
      for name, moved_to in copies_toward_idle(loads, cores).items():
        if self._ask(self.pool.place_copies, name, moved_to) is not _LOST:
          self.moved[name] = moved_to  # (not one lost meanwhile)
    self._place_driver(cores, (self.driver.cpu() - self.driver_before) / span)
    self.placed_at = now
    return f'copy threads by load (tasks + copies, of a core, over {span:.1f} s): {self}'

  def _place_driver(self, cores: dict, driver: float) -> None:
    """Pins the driver's threads by the same load (`driver_toward_idle`, over the lanes
    of its own host), if that moves them off the busiest cores."""
    self.driver_load = driver
    lanes = {name: load for name, load in self.loads.items() if self.pool.on_driver_host(name)}
    allowed = self.driver.allowed()
    target = driver_toward_idle(lanes, cores, self.moved, driver, allowed) if lanes else None
    if target is not None:
      self.driver_affinity = allowed
      self.driver_cores = self.driver.pin(target)

  def put_driver_back(self) -> None:
    """The driver's threads on the cores they had before `_place_driver` (the run has
    ended: what the driver does next is not the run's)."""
    if self.driver_affinity is not None:
      self.driver.pin(self.driver_affinity)
      self.driver_affinity = None

  def __str__(self) -> str:
    """Each lane's measured load and what moved (`describe_copy_loads`), then the
    driver's (`describe_driver_load`)."""
    cores = {name: self.pool.placement[name].cores for name in self.loads or ()}
    copies = describe_copy_loads(self.loads or {}, cores, self.moved, (100, 0, '%'))
    if self.driver_load is None:
      return copies
    return f'{copies}; {describe_driver_load(self.driver_load, self.driver_cores, (100, 0, "%"))}'
