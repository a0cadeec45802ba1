"""Copy threads placed by the load a run measures (`ProcessExecutor(copies='auto')`).

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

A run too short to fill the window, or with a lane that stops finishing tasks, leaves
the copies where the placement put them. A lane lost while it is asked for its copies'
CPU (`LaneError`) starts the warm-up again (the run's own wait hears of the loss, and
drops or replaces the lane); one lost while its copies move keeps none moved.
"""

import collections
from collections.abc import Iterable, Mapping

from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool
from jaxsgd.scheduler.lanes.placement import copies_toward_idle, describe_copy_loads

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


class CopiesByLoad:
  """Measures the lanes of `pool` named in `lanes` (the executor's lane index -> pool
  lane) over a window of the run and then places their copy threads (module docstring).

  `finished(lane, cpu, now)` after every task a lane finishes; it returns the line that
  says what was measured and moved when it places them, else None.
  """

  def __init__(self, pool: LanePool, lanes: Mapping[int, str]):
    self.pool, self.lanes = pool, dict(lanes)
    self.done = collections.Counter()  # tasks each lane finished, in the current phase
    self.cpu = collections.Counter()  # their CPU seconds, in the window
    self.opened_at: float | None = None
    self.copies_before: dict[str, float] = {}
    self.loads: dict[str, tuple[float, float]] | None = None  # (tasks, copies) per lane
    self.moved: dict[str, tuple[int, ...]] = {}  # lane -> the cores its copies run on
    self.placed_at: float | None = None  # the run's time when they were placed

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
    self.placed_at = now
    return f'copy threads by load (tasks + copies, of a core, over {span:.1f} s): {self}'

  def __str__(self) -> str:
    """Each lane's measured load and what moved (`describe_copy_loads`)."""
    cores = {name: self.pool.placement[name].cores for name in self.loads or ()}
    return describe_copy_loads(self.loads or {}, cores, self.moved, (100, 0, '%'))
