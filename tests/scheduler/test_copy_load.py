"""Copy threads placed by the load a run measures (`scheduler/copy_load.py`): the window,
the loads and the moves, by hand, against a pool whose copy-thread clocks the test sets."""

import pytest

from jaxsgd.scheduler import copy_load
from jaxsgd.scheduler.copy_load import CopiesByLoad
from jaxsgd.scheduler.lanes import LaneError, LanePlacement
from jaxsgd.scheduler.lanes.placement import driver_toward_idle


DRIVER_HOST = '192.0.2.1'


class ClockedPool:
  """A pool's `placement`, `copy_cpu` (set by the test) and `place_copies` (noted); a
  lane in `lost` raises `LaneError` at either, one in `lost_moving` at `place_copies`.
  `info[lane]['host']`: its placement's host, else the driver's (`driver_host`)."""

  def __init__(self, placement: str):
    self.placement = LanePlacement.parse(placement)
    self.copies = dict.fromkeys(self.placement.names, 0.0)
    self.placed, self.lost, self.lost_moving = [], set(), set()
    self.driver_host = DRIVER_HOST
    self.info = {
      lane: {'host': self.placement[lane].host or DRIVER_HOST} for lane in self.placement.names
    }

  def on_driver_host(self, lane):
    return self.info[lane]['host'] == self.driver_host

  def copy_cpu(self, lane):
    if lane in self.lost:
      raise LaneError(lane, None, f'lane {lane!r} died')
    return self.copies[lane]

  def place_copies(self, lane, cores):
    if lane in self.lost | self.lost_moving:
      raise LaneError(lane, None, f'lane {lane!r} died')
    self.placed.append((lane, cores))
    return cores


class ClockedDriver:
  """The driver's CPU clock (set by the test), the cores it may use, and its pins (noted)."""

  def __init__(self, allowed=(0, 1)):
    self.seconds, self.cores, self.pinned = 0.0, tuple(allowed), []

  def cpu(self):
    return self.seconds

  def allowed(self):
    return self.cores

  def pin(self, cores):
    self.pinned.append(tuple(cores))
    return tuple(cores)


def warm(measure, lanes, now=0.0):
  """Each lane finishes its `WARM_TASKS`: the window opens with the last of them."""
  for _ in range(copy_load.WARM_TASKS):
    for lane in lanes:
      assert measure.finished(lane, 9.0, now) is None  # (a compiling task's CPU: not counted)
  assert measure.opened_at == now


def window(measure, pool, cpu, copies, end, driver=0.1):
  """`WINDOW_TASKS` tasks of each lane (its `cpu` each), ending at `end`, the copy
  threads having used `copies[name]` meanwhile and the driver `driver`; what the last
  task returned."""
  for name, used in copies.items():
    pool.copies[name] += used
  measure.driver.seconds += driver
  lanes = list(cpu)
  said = [
    measure.finished(lane, cpu[lane], end) for _ in range(copy_load.WINDOW_TASKS) for lane in lanes
  ]
  assert said[:-1] == [None] * (len(said) - 1)  # placed once every lane has finished its tasks
  return said[-1]


def test_the_busiest_cores_shed_their_copies_after_the_window_once_and_the_line_says_so():
  """DDG-like: stage 0's core computes 16 x 62.5 ms over a 2-s window (50 %) and copies
  250 ms (12.5 %); stage 1's 16 x 15.625 ms (12.5 %) and 62.5 ms (3.125 %).
  0.15625 + 0.125 <= 0.625 - 0.125: stage 0's copies go to core 1."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1')
  pool.copies.update(stage0=1.0, stage1=2.0)  # used before the window: not counted
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1'}, ClockedDriver())
  warm(measure, [0, 1], now=1.0)
  said = window(measure, pool, {0: 0.0625, 1: 0.015625}, {'stage0': 0.25, 'stage1': 0.0625}, 3.0)
  assert measure.loads == {'stage0': (0.5, 0.125), 'stage1': (0.125, 0.03125)}
  assert pool.placed == [('stage0', (1,))] and measure.moved == {'stage0': (1,)}
  assert said == (
    'copy threads by load (tasks + copies, of a core, over 2.0 s): '
    'stage0 on 0: 50 + 12 %, stage1 on 1: 12 + 3 %; copies of stage0 to 1; '
    'the driver 5 %, pinned to 1'
  )
  assert measure.finished(0, 1.0, 9.0) is None and len(pool.placed) == 1  # once
  # A new process in stage 0's place gets its copies placed as the lost one's were.
  measure.replaced('stage0')
  measure.replaced('stage1')
  assert pool.placed == [('stage0', (1,)), ('stage0', (1,))]
  measure.put_back()  # (a pool that goes on to another run)
  assert pool.placed[2:] == [('stage0', None)] and measure.moved == {'stage0': (1,)}
  measure.dropped(0)  # lost for good: nothing of it to put back
  measure.put_back()
  assert pool.placed[3:] == []


def test_a_window_lasts_half_a_second_at_least():
  """Every lane's tasks are done at 0.25 s: the window stays open until the first task
  after `WINDOW_SECONDS`, and counts every task until then."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1')
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1'}, ClockedDriver())
  warm(measure, [0, 1])
  assert window(measure, pool, {0: 0.0, 1: 0.0}, {}, copy_load.WINDOW_SECONDS / 2) is None
  pool.copies.update(stage0=0.25, stage1=0.25)
  said = measure.finished(0, 1.0, 2.0)
  assert said.endswith('; copies of stage0 to 1; the driver 5 %, pinned to 1')
  assert measure.loads == {'stage0': (0.5, 0.125), 'stage1': (0.0, 0.125)}


def test_balanced_lanes_keep_their_copies():
  """Both lanes 50 % + 12.5 %: neither gives (0.625 + 0.125 > 0.5)."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1')
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1'}, ClockedDriver())
  warm(measure, [0, 1])
  said = window(measure, pool, {0: 0.0625, 1: 0.0625}, {'stage0': 0.25, 'stage1': 0.25}, 2.0)
  assert measure.loads == {'stage0': (0.5, 0.125), 'stage1': (0.5, 0.125)}
  assert pool.placed == [] and said.endswith(
    '; each lane keeps its copies; the driver 5 %, unpinned'
  )


def test_copies_move_between_cores_of_one_host_only():
  """Core 0 of this host and core 0 of 10.0.0.2 are not one group: each host's busy lane
  gives its copies to its own idle core. (Grouped by core numbers alone, cores 1 of both
  hosts, 1.35 of a core, would have given theirs to cores 0, 1.02.)"""
  pool = ClockedPool(
    'stage0@cores=0; stage1@cores=1; w@host=10.0.0.2@cores=0; v@host=10.0.0.2@cores=1'
  )
  lanes = {0: 'stage0', 1: 'stage1', 2: 'w', 3: 'v'}
  measure = CopiesByLoad(pool, lanes, ClockedDriver())
  warm(measure, list(lanes))
  cpu = {0: 0.8 / 16, 1: 0.3 / 16, 2: 0.1 / 16, 3: 0.9 / 16}
  copies = {'stage0': 0.1, 'stage1': 0.05, 'w': 0.02, 'v': 0.1}
  window(measure, pool, cpu, copies, 1.0)
  assert measure.moved == {'stage0': (1,), 'v': (0,)}
  assert sorted(pool.placed) == [('stage0', (1,)), ('v', (0,))]


def test_a_lane_replaced_before_the_move_starts_the_warm_up_again_and_a_dropped_one_is_not_waited_for():
  pool = ClockedPool('stage0@cores=0; stage1@cores=1; stage2@cores=1')
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1', 2: 'stage2'}, ClockedDriver())
  warm(measure, [0, 1, 2])
  measure.replaced('stage1')  # its copy threads' clocks start again at 0
  assert measure.opened_at is None and not measure.done
  measure.dropped(2)  # lost for good: the others' window does not wait for it
  warm(measure, [0, 1], now=1.0)
  window(measure, pool, {0: 0.0625, 1: 0.0}, {'stage0': 0.25}, 3.0)
  assert set(measure.loads) == {'stage0', 'stage1'} and measure.moved == {'stage0': (1,)}


@pytest.mark.parametrize('when', ['opening', 'closing'])
def test_a_lane_lost_while_asked_starts_the_warm_up_again(when):
  """A lane whose copies' CPU cannot be read (its process lost: the run replaces or drops
  it) starts the measure over; once it answers again, it goes on as before."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1')
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1'}, ClockedDriver())
  if when == 'opening':
    pool.lost.add('stage1')
    for _ in range(copy_load.WARM_TASKS):
      measure.finished(0, 0.0, 0.0), measure.finished(1, 0.0, 0.0)
  else:
    warm(measure, [0, 1])
    pool.lost.add('stage1')
    assert window(measure, pool, {0: 0.0625, 1: 0.0}, {'stage0': 0.25}, 3.0) is None
  assert measure.loads is None and measure.opened_at is None and not measure.done
  assert pool.placed == []
  pool.lost.clear()  # (a new process in its place)
  warm(measure, [0, 1], now=4.0)
  window(measure, pool, {0: 0.0625, 1: 0.0}, {'stage0': 0.25}, 6.0)
  assert measure.moved == {'stage0': (1,)}


def test_a_lane_lost_while_its_copies_move_keeps_none_moved():
  """Stage 0's and stage 2's copies go to core 1; stage 2 is lost as its move is asked:
  only stage 0's is recorded (said, written, put back, placed again on replacement)."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1; stage2@cores=0')
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1', 2: 'stage2'}, ClockedDriver())
  warm(measure, [0, 1, 2])
  pool.lost_moving.add('stage2')
  cpu = {0: 0.0625, 1: 0.0, 2: 0.03125}  # core 0: 0.5 + 0.125 + 0.25 + 0.125; core 1: 0
  said = window(measure, pool, cpu, {'stage0': 0.25, 'stage2': 0.25}, 2.0)
  assert measure.moved == {'stage0': (1,)}
  assert said.endswith('; copies of stage0 to 1; the driver 5 %, pinned to 1')
  measure.replaced('stage2')  # its new process: nothing of it was moved
  pool.lost.add('stage0')
  measure.replaced('stage0')  # lost again at once: its copies are not where it says
  assert measure.moved == {} and pool.placed == [('stage0', (1,))]


PD_LOADS = {  # PD-ASGD 1:1 on two cores, shares of a core: (tasks, copies)
  'sharedmodel': (0.05, 0.0),
  'forwardworker0': (0.50, 0.0),
  'backwardworker0': (0.88, 0.05),
}
PD_CORES = {'sharedmodel': (0,), 'forwardworker0': (0,), 'backwardworker0': (1,)}


@pytest.mark.parametrize(
  'loads, cores, moved, driver, allowed, want',
  [
    # The backward worker's copies went to core 0: core 0 at 0.05 + 0.50 + 0.05 = 0.60,
    # core 1 at 0.88; 0.60 + 0.06 <= 0.88: the driver goes to core 0.
    (PD_LOADS, PD_CORES, {'backwardworker0': (0,)}, 0.06, (0, 1), (0,)),
    # Its copies kept: core 1 at 0.93, core 0 at 0.55; 0.55 + 0.06 <= 0.93.
    (PD_LOADS, PD_CORES, {}, 0.06, (0, 1), (0,)),
    # A driver of 0.40: 0.60 + 0.40 > 0.88, it would make core 0 the busier: unpinned.
    (PD_LOADS, PD_CORES, {'backwardworker0': (0,)}, 0.40, (0, 1), None),
    # The driver may not run on core 0: no core to go to.
    (PD_LOADS, PD_CORES, {'backwardworker0': (0,)}, 0.06, (1,), None),
    # DDG K=2's stages at 0.91 and 0.93: 0.91 + 0.06 > 0.93, unpinned.
    (
      {'stage0': (0.91, 0.0), 'stage1': (0.93, 0.0)},
      {'stage0': (0,), 'stage1': (1,)},
      {},
      0.06,
      (0, 1),
      None,
    ),
    # Staged BP on core 0, core 1 free (a group of load 0): 0 + 0.06 <= 0.97.
    ({'stage0': (0.97, 0.0)}, {'stage0': (0,)}, {}, 0.06, (0, 1), (1,)),
    # K=2 on cores 0 and 1 of four: the free cores 2 and 3, together.
    (
      {'stage0': (0.5, 0.0), 'stage1': (0.9, 0.0)},
      {'stage0': (0,), 'stage1': (1,)},
      {},
      0.06,
      (0, 1, 2, 3),
      (2, 3),
    ),
    # A lane on cores 0 and 1 at 1.2 (0.6 a core), one on core 2 at 0.9, the driver 0.2:
    # (1.2 + 0.2) / 2 = 0.7 <= 0.9.
    ({'a': (1.1, 0.1), 'b': (0.9, 0.0)}, {'a': (0, 1), 'b': (2,)}, {}, 0.2, (0, 1, 2), (0, 1)),
    # Lanes on cores 0-1 (1.6: 0.8 a core) and on core 1 (0.5): the less busy group's
    # core is one of the busiest's, so pinned there the driver would still take from it.
    ({'a': (1.6, 0.0), 'b': (0.5, 0.0)}, {'a': (0, 1), 'b': (1,)}, {}, 0.06, (0, 1), None),
    # A driver that used no CPU in the window: nothing to shed, unpinned.
    (PD_LOADS, PD_CORES, {'backwardworker0': (0,)}, 0.0, (0, 1), None),
    # A lane not pinned may compute on any core: none is known to be free of it.
    (
      {'stage0': (0.97, 0.0), 'stage1': (0.1, 0.0)},
      {'stage0': (0,), 'stage1': None},
      {},
      0.06,
      (0, 1),
      None,
    ),
  ],
  ids=[
    'pd-copies-moved',
    'pd-copies-kept',
    'driver-too-heavy',
    'not-allowed',
    'ddg-balanced',
    'bp-free-core',
    'free-cores',
    'two-core-group',
    'overlapping-groups',
    'idle-driver',
    'unpinned-lane',
  ],
)
def test_the_driver_goes_to_the_least_busy_cores_only_where_the_busiest_stay_busiest(
  loads, cores, moved, driver, allowed, want
):
  """`driver_toward_idle`, by hand: (L + d) / m <= B / n."""
  assert driver_toward_idle(loads, cores, moved, driver, allowed) == want


def test_the_driver_is_pinned_with_the_copies_by_its_own_hosts_lanes_and_put_back():
  """The driver used 0.2 s of CPU over a 2-s window (10 %). This host: stage 0's core at
  40 %, stage 1's at 70 + 10 % of copies, which go to core 0 (0.4 + 0.1 <= 0.8 - 0.1):
  core 0 at 0.5, core 1 at 0.7; 0.5 + 0.1 <= 0.7, the driver goes to core 0. The lane of
  10.0.0.2 (its core 0 at 95 %) is not on the driver's host: not counted (with it, core
  0's group would be the busiest). At the run's end the driver is put back on the cores
  it had, once."""
  pool = ClockedPool('stage0@cores=0; stage1@cores=1; w@host=10.0.0.2@cores=0')
  driver = ClockedDriver(allowed=(0, 1))
  measure = CopiesByLoad(pool, {0: 'stage0', 1: 'stage1', 2: 'w'}, driver)
  warm(measure, [0, 1, 2])
  cpu = {0: 0.8 / 16, 1: 1.4 / 16, 2: 1.9 / 16}
  said = window(measure, pool, cpu, {'stage1': 0.2}, 2.0, driver=0.2)
  assert measure.moved == {'stage1': (0,)} and measure.driver_load == pytest.approx(0.1)
  assert driver.pinned == [(0,)] and measure.driver_cores == (0,)
  assert said.endswith('; copies of stage1 to 0; the driver 10 %, pinned to 0')
  measure.put_driver_back()
  measure.put_driver_back()  # (once only)
  assert driver.pinned == [(0,), (0, 1)] and measure.driver_affinity is None


def test_auto_is_refused_where_the_placement_puts_copies_itself():
  from jaxsgd.scheduler.process import ProcessExecutor

  placement = LanePlacement.parse('stage0@cores=0; stage1@cores=1@copies=0')
  with pytest.raises(ValueError, match=r"^copies: 'auto' places .* those of stage1 \(copies="):
    ProcessExecutor(placement, copies='auto')
  with pytest.raises(ValueError, match=r"^copies: one of own, auto expected, got 'idle'"):
    ProcessExecutor(placement, copies='idle')
  ProcessExecutor(placement, copies='own').close()  # (nothing started)


def test_a_run_on_lane_processes_places_copies_by_load_unless_told_or_placed_otherwise():
  """`placement.copies=None`: 'auto' on lane processes that compute; 'own' where
  `placement.lanes` places a lane's copies, or tasks are emulated (the simulator's
  executor model keeps them on their lanes' cores); a value given is taken as it is."""
  from jaxsgd.algorithms.settings import PlacementSettings

  placed = 'stage0@cores=0; stage1@cores=1@copies=0'
  assert PlacementSettings().copy_placement('processes') == 'auto'
  assert PlacementSettings(lanes='stage0@cores=0').copy_placement('processes') == 'auto'
  assert PlacementSettings(lanes=placed).copy_placement('processes') == 'own'
  assert PlacementSettings().copy_placement('emulated') == 'own'
  assert PlacementSettings(copies='auto').copy_placement('emulated') == 'auto'
  assert PlacementSettings(copies='own').copy_placement('processes') == 'own'
