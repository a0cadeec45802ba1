"""The virtual clock's simulated driver (`cost.driver`, `cost.driver_latency`): one host
thread that handles every event — a task or a copy dispatched, a task's end heard — one at
a time, in the order they come, `driver` seconds each; each message between it and a lane
takes `driver_latency` on its way (without queueing).

A lane gets a task only once the driver has dispatched it and the task has reached it; a
process that waits for its task goes on only once the driver has heard of the task's end;
a lane that reads another lane's result does not wait for the driver (lanes take their
inputs from one another).
Every expected time is computed by hand (quarters of a second: exact in binary); the
values are those of the run without a driver, bit for bit.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsgd.algorithms.settings import cost_settings
from jaxsgd.scheduler import host
from jaxsgd.scheduler import CostModel, LaneProcessModel, VirtualExecutor, virtual
from jaxsgd.scheduler.core import Cluster, Compute, Get, Process, Put, Ready, Send

DRIVER = 0.25  # seconds per event


def _costs(driver: float = DRIVER, **others) -> CostModel:
  return CostModel({'forward': 1.0, 'backward': 2.0}, driver=driver, **others)


def _add_one(x):
  return x + 1


def _chain(lane: int, tasks: int, *, ahead: bool, seen: list, executor_box: list):
  """`tasks` forwards on `lane`, each on the previous one's result; `seen` gets when the
  process went on after each."""

  def program():
    x = jnp.zeros(4)
    for _ in range(tasks):
      x = yield Compute(_add_one, (x,), kind='forward', ahead=ahead)
      seen.append(executor_box[0].now())
    return x

  return program()


def _run_chains(
  lanes: int, tasks: int, *, ahead: bool, run_ahead: int, driver: float = DRIVER, latency=0.0
):
  cluster, seen, box = Cluster(), [[] for _ in range(lanes)], []
  indices = [cluster.add_lane(f'lane{i}') for i in range(lanes)]
  executor = LaneProcessModel(_costs(driver, driver_latency=latency), run_ahead=run_ahead)
  box.append(executor)
  processes = [
    Process(f'p{i}', lane, _chain(lane, tasks, ahead=ahead, seen=seen[i], executor_box=box))
    for i, lane in enumerate(indices)
  ]
  timeline = executor.run(cluster, processes)
  return timeline, seen


def _spans(timeline, lane=None):
  return [(r.start, r.end, r.heard) for r in timeline.records if lane is None or r.lane == lane]


def _hand_over(costs: CostModel, *, handed, waited: bool) -> dict:
  """p0 makes x on lane a (`waited`: its process waits for it) and hands it to p1 on lane
  b (`handed`: `Send`, a copy, or `Put`, x as it is), which computes on it:
  `{kind: (start, end, heard, dispatched)}` of the run (a copy: neither of the last)."""
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def producer():
    x = yield Compute(_add_one, (jnp.zeros(4),), kind='forward', ahead=not waited)
    yield handed(inbox, x)

  def consumer():
    x = yield Get(inbox)
    yield Compute(_add_one, (x,), kind='backward')

  timeline = LaneProcessModel(costs, run_ahead=4).run(
    cluster, [Process('p0', a, producer()), Process('p1', b, consumer())]
  )
  return {r.kind: (r.start, r.end, r.heard, r.dispatched) for r in timeline.records}


def test_a_waited_task_costs_a_dispatch_before_it_and_a_hearing_after_it():
  """Dispatch 0 → 0.25, the task 0.25 → 1.25, heard 1.25 → 1.5; the next dispatch
  1.5 → 1.75, its task 1.75 → 2.75, heard at 3."""
  timeline, seen = _run_chains(1, 2, ahead=False, run_ahead=4)
  assert _spans(timeline) == [(0.25, 1.25, 1.5), (1.75, 2.75, 3.0)]
  assert seen == [[1.5, 3.0]]


def test_without_a_driver_the_same_chain_takes_only_its_tasks():
  timeline, seen = _run_chains(1, 2, ahead=False, run_ahead=4, driver=0.0)
  assert _spans(timeline) == [(0, 1, None), (1, 2, None)]
  assert seen == [[1.0, 2.0]]


def test_the_driver_handles_one_event_at_a_time_in_the_order_they_come():
  """Both processes dispatch at 0: p0's dispatch 0 → 0.25, p1's 0.25 → 0.5; their tasks
  run 0.25 → 1.25 and 0.5 → 1.5. p0's end is heard 1.25 → 1.5; p1's end (1.5) arrives
  before p0's second dispatch (also at 1.5, but scheduled after it), so the driver hears
  it first, 1.5 → 1.75, and dispatches p0's 1.75 → 2 (its task 2 → 3); p1 goes on at
  1.75 and its dispatch takes 2 → 2.25 (task 2.25 → 3.25). Heard: 3 → 3.25, 3.25 → 3.5."""
  timeline, seen = _run_chains(2, 2, ahead=False, run_ahead=4)
  assert _spans(timeline, 0) == [(0.25, 1.25, 1.5), (2.0, 3.0, 3.25)]
  assert _spans(timeline, 1) == [(0.5, 1.5, 1.75), (2.25, 3.25, 3.5)]
  assert seen == [[1.5, 3.25], [1.75, 3.5]]


def test_running_ahead_a_process_goes_on_once_its_task_is_dispatched():
  """run_ahead 2: the first two tasks are dispatched 0 → 0.25 and 0.25 → 0.5 and the
  process goes on after each; the lane runs them 0.25 → 1.25 → 2.25. The third would make
  three unfinished (> 2): handled 0.5 → 0.75, it waits for room. The first's end, with one
  call (the second) queued behind it, is sent (a lane holds an end only while two are):
  heard 1.25 → 1.5, which makes room; the third is dispatched 1.5 → 1.75 (the process goes
  on) and runs 2.25 → 3.25 behind the second. Ends heard 2.25 → 2.5, 3.25 → 3.5."""
  timeline, seen = _run_chains(1, 3, ahead=True, run_ahead=2)
  assert _spans(timeline) == [(0.25, 1.25, 1.5), (1.25, 2.25, 2.5), (2.25, 3.25, 3.5)]
  assert seen == [[0.25, 0.5, 1.75]]


def test_processes_waiting_for_room_on_one_lane_go_first_come_first_one_per_end():
  """p0 and p1 share one lane, run_ahead 2, two tasks each. p0's first is dispatched
  0 → 0.25 (p0 goes on), p1's 0.25 → 0.5 (p1 goes on): two unfinished. p0's second,
  handled 0.5 → 0.75, and p1's, 0.75 → 1, wait for room, in that order. The lane runs
  p0's first 0.25 → 1.25 and p1's 1.25 → 2.25. p0's first end (one call behind it) is
  heard 1.25 → 1.5: room for one, p0's second, dispatched 1.5 → 1.75, runs 2.25 → 3.25.
  p1's first end, heard 2.25 → 2.5, makes room for p1's second: 2.5 → 2.75, run
  3.25 → 4.25. The last two ends are heard 3.25 → 3.5 and 4.25 → 4.5."""
  cluster, seen, box = Cluster(), [[], []], []
  lane = cluster.add_lane('lane')
  executor = LaneProcessModel(_costs(), run_ahead=2)
  box.append(executor)
  processes = [
    Process(f'p{i}', lane, _chain(lane, 2, ahead=True, seen=seen[i], executor_box=box))
    for i in range(2)
  ]
  timeline = executor.run(cluster, processes)
  assert _spans(timeline) == [
    (0.25, 1.25, 1.5),
    (1.25, 2.25, 2.5),
    (2.25, 3.25, 3.5),
    (3.25, 4.25, 4.5),
  ]
  assert seen == [[0.25, 1.75], [0.5, 2.75]]


def _ready_behind_a_queued_task(hastened_by_ready: bool):
  """p makes x on lane a (run ahead), hands it to q and dispatches two more tasks there;
  q waits for x to exist (`Ready`), or for nothing: when q went on, and the spans."""
  cluster, seen = Cluster(), []
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)
  executor = LaneProcessModel(_costs(), run_ahead=4)

  def p():
    x = yield Compute(_add_one, (jnp.zeros(4),), kind='forward')
    yield Put(inbox, x)
    y = yield Compute(_add_one, (x,), kind='forward')
    yield Compute(_add_one, (y,), kind='forward')

  def q():
    x = yield Get(inbox)
    if hastened_by_ready:
      yield Ready(x)
    seen.append(executor.now())

  timeline = executor.run(cluster, [Process('p', a, p()), Process('q', b, q())])
  return seen, _spans(timeline)


def test_a_ready_has_the_lane_send_the_end_it_waits_for_at_once():
  """p's first task: dispatched 0 → 0.25, runs 0.25 → 1.25; its second and third,
  dispatched 0.25 → 0.5 and 0.5 → 0.75, had reached the lane by then, so the first's end
  would be held (two calls queued behind it) until the second ends at 2.25. q's `Ready` on
  its result (at 0.25) asks for it: sent at its end, heard 1.25 → 1.5, when q goes on;
  the second's, with one call behind it, 2.25 → 2.5; the third's 3.25 → 3.5."""
  seen, spans = _ready_behind_a_queued_task(True)
  assert seen == [1.5]
  assert spans == [(0.25, 1.25, 1.5), (1.25, 2.25, 2.5), (2.25, 3.25, 3.5)]
  # Without the `Ready`, the first end is held and heard only after the second's end.
  seen, spans = _ready_behind_a_queued_task(False)
  assert seen == [0.25]
  assert spans == [(0.25, 1.25, 2.5), (1.25, 2.25, 2.75), (2.25, 3.25, 3.5)]


def _held_behind_a_wait(forwards: int):
  """p runs `forwards` forwards ahead on lane a (2 s each), the third on what q's second
  backward (4 s each) on lane b sends it; `(lane, kind, start, end, heard, dispatched)` of
  every task."""
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', a)

  def p():
    x = yield Compute(_add_one, (jnp.zeros(4),), kind='forward', ahead=True)
    x = yield Compute(_add_one, (x,), kind='forward', ahead=True)
    y = yield Get(inbox)
    x = yield Compute(_add_one, (y,), kind='forward', ahead=True)
    for _ in range(forwards - 3):
      x = yield Compute(_add_one, (x,), kind='forward', ahead=True)

  def q():
    y = yield Compute(_add_one, (jnp.zeros(4),), kind='backward', ahead=True)
    y = yield Compute(_add_one, (y,), kind='backward', ahead=True)
    yield Send(inbox, y)

  costs = CostModel({'forward': 2.0, 'backward': 4.0}, driver=DRIVER)
  timeline = LaneProcessModel(costs, run_ahead=8).run(
    cluster, [Process('p', a, p()), Process('q', b, q())]
  )
  records = [r for r in timeline.records if r.kind != 'transfer']
  return sorted((r.lane, r.kind, r.start, r.end, r.heard, r.dispatched) for r in records)


@pytest.mark.parametrize('forwards', [4, 5])
def test_a_lane_whose_next_task_waits_with_a_short_queue_sends_the_ends_it_holds(forwards):
  """The driver's events, 0.25 s each in order: p's f1 (dispatched 0.25), q's b1 (0.5),
  f2 (0.75), b2 (1.0), q's copy (1.25), then f3, f4 (and f5) (1.5, 1.75, 2.0), once p had
  q's value. f1 runs 0.25 -> 2.25 and f2 2.25 -> 4.25, each ending with two calls or more
  queued behind it: held. f3 reads what b2 makes (4.5 -> 8.5), and waits for it.
  Four forwards: one call behind f3, so the lane sends f1's and f2's ends as f3 starts to
  wait, at 4.25 (heard 4.5 and 4.75; b1's end, at 4.5, 5.0), not with f3's end at 10.5
  (`LaneRuntime.send_held`); f3 10.5 (one call behind: heard 10.75), f4 12.5 (12.75).
  Five: two calls behind f3, so the lane keeps holding, and f3 too (two behind it), until
  f4 ends with one behind it at 12.5: f1, f2, f3, f4 heard 12.75 to 13.5, f5 at 14.75."""
  b1, b2 = (1, 'backward', 0.5, 4.5, 4.75, 0.5), (1, 'backward', 4.5, 8.5, 8.75, 1.0)
  if forwards == 4:
    b1, heard = (*b1[:4], 5.0, b1[5]), (4.5, 4.75, 10.75, 12.75)
  else:
    heard = (12.75, 13.0, 13.25, 13.5, 14.75)
  spans = [(0.25, 2.25), (2.25, 4.25), (8.5, 10.5), (10.5, 12.5), (12.5, 14.5)][:forwards]
  dispatched = (0.25, 0.75, 1.5, 1.75, 2.0)
  assert _held_behind_a_wait(forwards) == [
    *((0, 'forward', *span, h, d) for span, h, d in zip(spans, heard, dispatched)),
    b1,
    b2,
  ]


def test_a_lane_reads_another_lanes_result_without_waiting_for_the_driver():
  """p0 makes x on lane a (dispatch 0 → 0.25, forward 0.25 → 1.25) and sends it to lane b
  (the copy's dispatch 0.25 → 0.5, as p0 went on at once: its copy waits for x, 1.25 →
  1.75 with a 0.5 s link). p1 on b reads it: its backward's dispatch 0.5 → 0.75, and it
  starts when the copy has landed (1.75), not when the driver hears the forward end
  (1.5) nor the copy's (copies are not heard)."""
  spans = _hand_over(_costs(link_latency=0.5), handed=Send, waited=False)
  assert spans == {
    'forward': (0.25, 1.25, 1.5, 0.25),
    'transfer': (1.25, 1.75, None, None),
    'backward': (1.75, 3.75, 4.0, 0.75),
  }


def test_each_message_takes_the_latency_on_its_way_to_the_lane_and_back():
  """Latency 0.5: dispatch 0 → 0.25, the task reaches the lane at 0.75 and runs to 1.75,
  its end reaches the driver at 2.25 and is heard at 2.5; the second: dispatched 2.5 →
  2.75, at the lane 3.25, ends 4.25, heard 4.75 → 5."""
  timeline, seen = _run_chains(1, 2, ahead=False, run_ahead=4, latency=0.5)
  assert _spans(timeline) == [(0.75, 1.75, 2.5), (3.25, 4.25, 5.0)]
  assert seen == [[2.5, 5.0]]


def test_a_latency_alone_delays_without_occupying_the_driver():
  """No time per event: two processes dispatch at 0, both tasks reach their lanes at 0.5
  (the messages do not queue), end at 1.5 and are heard at 2."""
  timeline, seen = _run_chains(2, 1, ahead=False, run_ahead=4, driver=0.0, latency=0.5)
  assert _spans(timeline) == [(0.5, 1.5, 2.0), (0.5, 1.5, 2.0)]
  assert seen == [[2.0], [2.0]]


def test_running_ahead_with_a_latency_the_process_goes_on_at_dispatch():
  """run_ahead 2, latency 0.5: dispatched 0 → 0.25, 0.25 → 0.5 (the process goes on after
  each); the third, handled 0.5 → 0.75, waits for room. The first two reach the lane at
  0.75 and 1 and run 0.75 → 1.75 → 2.75. The first's end (one call behind it: sent)
  reaches the driver at 2.25, heard 2.25 → 2.5: room; the third is dispatched 2.5 → 2.75
  (the process goes on), reaches the lane at 3.25 and runs 3.25 → 4.25 — the lane idles
  from 2.75, the way there and back being longer than the one task left in its queue. The
  second's end (none behind it) reaches the driver at 3.25, heard 3.5; the third's at
  4.75, heard 5."""
  timeline, seen = _run_chains(1, 3, ahead=True, run_ahead=2, latency=0.5)
  assert _spans(timeline) == [(0.75, 1.75, 2.5), (1.75, 2.75, 3.5), (3.25, 4.25, 5.0)]
  assert seen == [[0.25, 0.5, 2.75]]


@pytest.mark.parametrize('handed', [Put, Send], ids=['imported', 'sent'])
def test_a_copy_starts_only_once_the_dispatch_that_needs_it_has_reached_its_lane(handed):
  """p0 makes x on lane a, waited for (dispatch 0 → 0.25, at the lane 0.75, runs to 1.75,
  heard 2.25 → 2.5), and hands it to p1 on lane b.

  imported (a `Put`: x stays on a): p1's task reads it, dispatched 2.5 → 2.75; it
  reaches b at 3.25, and only then does b import x (the copy, 0.5 s: 3.25 → 3.75; not at
  2.75, when the driver sent the task).
  sent (a `Send`): the copy's own dispatch 2.5 → 2.75 reaches a at 3.25 and the copy runs
  3.25 → 3.75 (x existed since 1.75); p1 gets x at once (the copy runs ahead) and its
  task, dispatched 2.75 → 3, reaches b at 3.5 and reads the copy.

  Either way p1's task runs 3.75 → 5.75 and is heard 6.25 → 6.5."""
  spans = _hand_over(_costs(driver_latency=0.5, link_latency=0.5), handed=handed, waited=True)
  assert spans == {
    'forward': (0.75, 1.75, 2.5, 0.25),
    'transfer': (3.25, 3.75, None, None),
    'backward': (3.75, 5.75, 6.5, 2.75 if handed is Put else 3.0),
  }


def test_the_values_do_not_depend_on_the_driver():
  def final(driver, latency=0.0):
    cluster = Cluster()
    lane = cluster.add_lane('lane')
    results = []

    def program():
      x = jnp.arange(4.0)
      for i in range(5):
        x = yield Compute(lambda v, i=i: v * 1.5 + i, (x,), kind='forward', ahead=i % 2 == 0)
      results.append(x)

    costs = _costs(driver, driver_latency=latency)
    LaneProcessModel(costs, run_ahead=2).run(cluster, [Process('p', lane, program())])
    return np.asarray(results[0])

  np.testing.assert_array_equal(final(0.0), final(DRIVER))
  np.testing.assert_array_equal(final(0.0), final(0.3, 0.7))


def test_the_trace_carries_when_the_driver_dispatched_and_heard_of_each_task():
  """Dispatched once the driver has handled it (0 → 0.25), heard once it has handled the
  end (1.25 → 1.5). With each message's way 0.5 s: dispatched at 0.25 still, on the lane
  at 0.75, its task 0.75 → 1.75, its end at the driver at 2.25, heard at 2.5."""
  timeline, _ = _run_chains(1, 1, ahead=False, run_ahead=4)
  (task,) = [e for e in timeline.chrome_trace()['traceEvents'] if e.get('ph') == 'X']
  assert task['args'] == {'stage': None, 'batch': None, 'heard': 1.5e6, 'dispatched': 0.25e6}
  timeline, _ = _run_chains(1, 1, ahead=False, run_ahead=4, latency=0.5)
  (record,) = timeline.records
  assert (record.dispatched, record.start, record.end, record.heard) == (0.25, 0.75, 1.75, 2.5)
  timeline, _ = _run_chains(1, 1, ahead=False, run_ahead=4, driver=0.0)
  (task,) = [e for e in timeline.chrome_trace()['traceEvents'] if e.get('ph') == 'X']
  assert task['args'] == {'stage': None, 'batch': None}
  json.dumps(timeline.chrome_trace())


def test_a_driver_needs_the_run_ahead_schedule():
  with pytest.raises(ValueError, match=r'^driver / driver_latency: 0\.25 / 0\.0 s .*run_ahead > 0'):
    virtual.make(_costs(), run_ahead=0)
  with pytest.raises(ValueError, match=r'run_ahead > 0'):
    VirtualExecutor(_costs())
  with pytest.raises(ValueError, match=r'run_ahead > 0'):
    LaneProcessModel(_costs(), run_ahead=0)


@pytest.mark.parametrize('bad', [-0.001, float('inf'), float('nan'), True, '0.1'])
def test_a_driver_time_is_a_finite_number_of_seconds(bad):
  with pytest.raises(ValueError, match=r'cost\.driver: must be a finite number of seconds'):
    _costs(bad)
  with pytest.raises(ValueError, match=r'cost\.driver_latency: must be a finite number of'):
    _costs(driver_latency=bad)


@pytest.mark.parametrize('bad', [-1.0, float('nan'), float('inf'), True, 'fast'])
@pytest.mark.parametrize('field', ['driver', 'driver_latency', 'driver_loaded'])
def test_a_host_profile_with_a_bad_driver_figure_is_refused_in_one_line(field, bad, tmp_path):
  """The driver's figures come from a host profile (`cost.host`), checked when the config
  is read: one line naming the file and the figure."""
  path = tmp_path / 'host.json'
  figures = dict.fromkeys(host.FIGURES['processes'], 0.0)
  figures.update({'link_bandwidth': 1e9, field: bad})
  data = {'format': host.FORMAT, 'executor': 'processes', 'cores': 2, **figures}
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=rf"^cost.host: '{path}': {field} must be seconds >= 0"):
    cost_settings({'host': str(path)}, clock='virtual')
