"""The virtual clock's run-ahead schedule (`LaneProcessModel(run_ahead=N)`; `cost.host`, a
host profile of the process executor): that executor's driver, simulated.

A process goes on when its task is dispatched (while its lane has at most N unfinished
tasks); a task starts once the tasks whose results it reads have ended, and a result read
on another lane is first copied over the link, as a lane process imports a handle. Every
expected time below is computed by hand; the values are the in-order clock's, bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxsgd.scheduler import CostModel, LaneProcessModel, virtual
from jaxsgd.scheduler.core import Cluster, Compute, Get, Process, Put, Ready, Send
from jaxsgd.scheduler.snapshot import NotResumableError
from scheduler_helpers import host_file

# F = 1 s on lane a, B = 2 s on lane b, a copy 0.5 s (latency; free bandwidth).
COSTS = CostModel({'forward': 1.0, 'backward': 2.0}, link_latency=0.5)


def _make():
  return jnp.zeros(250)  # 1000 bytes


def _use(x):
  return x + 1


def _producer_consumer(cluster, *, sent: bool, seen: list):
  """Lane a makes two results (F each) and hands each to lane b (a `Put`: the value as it
  is; `sent`: a `Send`, an explicit copy), which computes B on each. `seen` gets
  (what, when) as the processes go on."""
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def producer(executor):
    for i in range(2):
      made = yield Compute(_make, kind='forward', stage=0, batch=i)
      seen.append((f'a made {i}', executor.now()))
      yield (Send if sent else Put)(inbox, made)

  def consumer(executor):
    for i in range(2):
      made = yield Get(inbox)
      seen.append((f'b got {i}', executor.now()))
      yield Compute(_use, (made,), kind='backward', stage=0, batch=i)

  return a, b, producer, consumer


def _run(run_ahead: int, *, sent: bool = False):
  cluster, seen = Cluster(), []
  a, b, producer, consumer = _producer_consumer(cluster, sent=sent, seen=seen)
  executor = virtual.make(COSTS, run_ahead=run_ahead)
  timeline = executor.run(
    cluster, [Process('a', a, producer(executor)), Process('b', b, consumer(executor))]
  )
  spans = {}
  for task in timeline.tasks():
    spans.setdefault(task.kind, []).append((task.start, task.end))
  return spans, seen


def test_in_order_a_process_goes_on_when_its_task_ends_and_a_put_is_free():
  spans, seen = _run(0)
  assert spans == {'forward': [(0, 1), (1, 2)], 'backward': [(1, 3), (3, 5)]}
  assert seen == [('a made 0', 1), ('b got 0', 1), ('a made 1', 2), ('b got 1', 3)]


def test_running_ahead_a_result_read_on_another_lane_is_copied_after_it_is_made():
  """a dispatches both forwards at 0 and hands both on at once; b's first backward waits
  for the copy of forward 0 (1 → 1.5), its second queues behind it (3.5 → 5.5), while
  the copy of forward 1 ran at 2 → 2.5, hidden behind the first backward."""
  spans, seen = _run(4)
  assert spans == {
    'forward': [(0, 1), (1, 2)],
    'transfer': [(1, 1.5), (2, 2.5)],
    'backward': [(1.5, 3.5), (3.5, 5.5)],
  }
  assert seen == [('a made 0', 0), ('b got 0', 0), ('a made 1', 0), ('b got 1', 0)]


def test_a_lane_runs_ahead_by_at_most_its_bound():
  """With a bound of 1, a goes on after forward 0 (its lane was idle) but waits for
  forward 1 (the lane had one unfinished task); b likewise waits for backward 1."""
  spans, seen = _run(1)
  assert spans['backward'] == [(1.5, 3.5), (3.5, 5.5)]
  assert seen == [('a made 0', 0), ('b got 0', 0), ('a made 1', 2), ('b got 1', 2)]


def test_a_send_made_before_its_value_exists_is_copied_once_it_does():
  """The explicit copy waits for forward 0 (1 → 1.5); b reads the copy, made on b, so
  it pays for no second copy."""
  spans, _ = _run(4, sent=True)
  assert spans['transfer'] == [(1, 1.5), (2, 2.5)]
  assert spans['backward'] == [(1.5, 3.5), (3.5, 5.5)]


def _spans_by_lane(cluster, timeline) -> dict:
  spans = {}
  for task in timeline.tasks():
    spans.setdefault(cluster.lanes[task.lane].name, []).append((task.start, task.end))
  return spans


@pytest.mark.parametrize('run_ahead', [0, 4])
def test_the_sender_of_a_value_reads_it_without_waiting_for_its_copy(run_ahead):
  """a makes x (0 → 1), sends it to b (the copy 1 → 1.5) and computes on x itself: its
  second forward reads x where x was made, so it starts at 1, not after the copy (it
  started at 1.5 running ahead: the copy had become the task that made x, everywhere)."""
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def on_a():
    x = yield Compute(_make, kind='forward', stage=0, batch=0)
    yield Send(inbox, x)
    yield Compute(_use, (x,), kind='forward', stage=0, batch=1)

  def on_b():
    x = yield Get(inbox)
    yield Compute(_use, (x,), kind='backward', stage=0)

  executor = virtual.make(COSTS, run_ahead=run_ahead)
  timeline = executor.run(cluster, [Process('a', a, on_a()), Process('b', b, on_b())])
  assert _spans_by_lane(cluster, timeline) == {
    'a': [(0, 1), (1, 2)],
    'link a → b': [(1, 1.5)],
    'b': [(1.5, 3.5)],
  }


@pytest.mark.parametrize('run_ahead', [0, 4])
def test_a_value_sent_to_two_lanes_waits_for_each_copy_on_its_own_link(run_ahead):
  """x (made 1 → 2 on a) is sent to c, whose link still carries y (4 MB at 1 MB/s:
  1 → 5.5), then to b: its copy to b runs 2 → 2.501 and b computes 2.501 → 4.501; only c
  waits for the busy link (copy 5.5 → 6.001, its task 6.001 → 8.001). Running ahead,
  the copy to b had waited for the copy to c, and b's task started at 6.5."""
  costs = CostModel({'forward': 1.0, 'backward': 2.0}, link_latency=0.5, link_bandwidth=1e6)
  cluster = Cluster()
  a, b, c = cluster.add_lane('a'), cluster.add_lane('b'), cluster.add_lane('c')
  to_b, to_c = cluster.channel('to b', b), cluster.channel('to c', c)

  def on_a():
    y = yield Compute(lambda: jnp.zeros(1_000_000), kind='forward', stage=0, batch=0)
    yield Send(to_c, y, batch=0)
    x = yield Compute(_make, kind='forward', stage=0, batch=1)
    yield Send(to_c, x, batch=1)
    yield Send(to_b, x, batch=2)

  def on_b():
    x = yield Get(to_b)
    yield Compute(_use, (x,), kind='backward', stage=0, batch=2)

  def on_c():
    yield Get(to_c)
    x = yield Get(to_c)
    yield Compute(_use, (x,), kind='backward', stage=0, batch=1)

  executor = virtual.make(costs, run_ahead=run_ahead)
  processes = [Process('a', a, on_a()), Process('b', b, on_b()), Process('c', c, on_c())]
  spans = _spans_by_lane(cluster, executor.run(cluster, processes))
  assert spans['link a → b'] == [pytest.approx((2, 2.501))]
  assert spans['b'] == [pytest.approx((2.501, 4.501))]
  assert spans['link a → c'] == [pytest.approx((1, 5.5)), pytest.approx((5.5, 6.001))]
  assert spans['c'] == [pytest.approx((6.001, 8.001))]


# (run_ahead, link b → a, a's task on what came back): without running ahead b sends y
# (made 0 → 2) before it takes x in; running ahead it asked for y's copy first, but x's
# value exists on b at 1.501 and y's does not, so x goes back first (a lane process's
# export waiting for its value holds up none behind it) and y's copy follows.
SENT_BACK = [
  (0, [(2, 6.5), (6.5, 7.001)], (7.001, 8.001)),
  (4, [(1.501, 2.002), (2.002, 6.502)], (2.002, 3.002)),
]


@pytest.mark.parametrize('run_ahead, link, task', SENT_BACK)
def test_a_value_sent_back_to_the_lane_that_made_it_is_read_after_it_arrives(run_ahead, link, task):
  """x (made 0 → 1 on a) goes to b (1 → 1.501) and comes back to a on the link b → a,
  which also carries b's y (4 MB at 1 MB/s: 4.5 s, made 0 → 2; `SENT_BACK`); a's task on
  what came back starts once it has arrived, not at 1 (it did, once copies to the
  array's first lane were not noted)."""
  costs = CostModel({'forward': 1.0, 'backward': 2.0}, link_latency=0.5, link_bandwidth=1e6)
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  to_a, to_b = cluster.channel('to a', a), cluster.channel('to b', b)

  def on_a():
    x = yield Compute(_make, kind='forward', stage=0, batch=0)
    yield Send(to_b, x, batch=1)
    yield Get(to_a)  # y
    back = yield Get(to_a)
    yield Compute(_use, (back,), kind='forward', stage=0, batch=4)

  def on_b():
    y = yield Compute(lambda: jnp.zeros(1_000_000), kind='backward', stage=0, batch=2)
    yield Send(to_a, y, batch=5)
    x = yield Get(to_b)
    yield Send(to_a, x, batch=3)

  executor = virtual.make(costs, run_ahead=run_ahead)
  spans = _spans_by_lane(
    cluster, executor.run(cluster, [Process('a', a, on_a()), Process('b', b, on_b())])
  )
  assert spans['link b → a'] == [pytest.approx(span) for span in link]
  assert spans['a'] == [pytest.approx((0, 1)), pytest.approx(task)]


def test_a_lane_waiting_for_its_input_leaves_a_shared_device_to_the_other_lane():
  """x and y share one device. x's task reads v, made on z (0 → 2) and copied to x
  (2 → 2.5); y's task, dispatched after x's, reads nothing: running ahead it takes the
  idle device at once (0 → 1), as a second lane process on the device would while the
  first waits for its import; x's runs at 2.5 → 3.5. It ran 3.5 → 4.5 before: one queue
  per device, whose head waited."""
  cluster = Cluster()
  z = cluster.add_lane('z')
  x, y = cluster.add_lane('x', shares='device'), cluster.add_lane('y', shares='device')
  inbox, go = cluster.channel('inbox', x), cluster.channel('go', y)

  def on_z():
    v = yield Compute(_make, kind='backward', stage=0)
    yield Put(inbox, v)

  def on_x():
    v = yield Get(inbox)
    yield Compute(_use, (v,), kind='forward', stage=0, batch=0)
    yield Put(go, None)

  def on_y():
    yield Get(go)  # dispatched just after x's task
    yield Compute(_make, kind='forward', stage=0, batch=1)

  executor = LaneProcessModel(COSTS, run_ahead=4)
  processes = [Process('z', z, on_z()), Process('x', x, on_x()), Process('y', y, on_y())]
  assert _spans_by_lane(cluster, executor.run(cluster, processes)) == {
    'z': [(0, 2)],
    'link z → x': [(2, 2.5)],
    'x': [(2.5, 3.5)],
    'y': [(0, 1)],
  }


@pytest.mark.parametrize(
  'take_in, b_ends', [(None, 3.75), ((0.125, 8000.0, 0.0625), 4.1875)], ids=['link', 'take-in']
)
def test_an_import_of_several_arrays_pays_per_array_on_its_link_and_its_take_in(take_in, b_ends):
  """Lane b's task reads two arrays made on lane a (F: 0 → 1, each 1000 bytes): one copy
  over the link imports both, 0.5 s latency + 0.25 s for the second array (free
  bandwidth), 1 → 1.75; b's task (B, 2 s) runs 1.75 → 3.75. With the receiving lane's
  take-in (`cost.take_in`: 0.125 s, 8000 B/s, 0.0625 s per array beyond the first), lane
  b first takes the two arrays in, 0.125 + 0.0625 + 2000 / 8000 = 0.4375 s, in front of B:
  1.75 → 4.1875."""
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def on_a():
    made = yield Compute(lambda: (_make(), _make()), kind='forward', stage=0)
    yield Put(inbox, made)

  def on_b():
    made = yield Get(inbox)
    yield Compute(lambda pair: pair[0] + pair[1], (made,), kind='backward', stage=0)

  costs = dataclasses.replace(COSTS, link_per_array=0.25, take_in=take_in)
  executor = LaneProcessModel(costs, run_ahead=4)
  spans = _spans_by_lane(
    cluster, executor.run(cluster, [Process('a', a, on_a()), Process('b', b, on_b())])
  )
  assert spans == {'a': [(0, 1)], 'link a → b': [(1, 1.75)], 'b': [(1.75, b_ends)]}


@pytest.mark.parametrize(
  'interpreter, export',
  [(False, None), (True, None), (True, (0.25, float('inf'), 0.0)), (True, (5.0, 1.0, 0.0))],
  ids=['copies apart', 'one interpreter', 'held for the export', 'export longer than the copy'],
)
def test_a_lanes_take_in_and_its_copies_run_one_at_a_time(interpreter, export):
  """Lane a makes p (1 array), lane b makes q (3 arrays), 0 → 1 each; b reads p (task r),
  a and c read q (tasks s, t): three imports, each 0.5 s + 0.25 s per array beyond the
  first on the sender's copies' queue — p's 1 → 1.5; q's to a 1 → 2, then to c 2 → 3 —
  and 0.25 s of taking in on the receiving lane before its 1 s task. A lane process
  exports and takes in in one interpreter: r's take-in waits for b's copy of q to a,
  2 → 2.25, r ends at 3.25; q's copy to c waits for that take-in, 2.25 → 3.25, and t
  runs 3.25 → 4.5. With the copies on a queue of their own (`copies_on_sender=False`:
  links), r runs 1.5 → 2.75, both copies of q 1 → 2 and t 2 → 3.25. s (a's take-in,
  a's copy over at 1.5) runs 2 → 3.25 either way.

  A copy that holds its sender's interpreter for its export alone (`cost.export`: 0.25 s
  here) lets it go at 1.25: q's copy to c runs 1.25 → 2.25 (holding b's interpreter to
  1.5), r takes p in once that is free, 1.5 → 1.75, and ends at 2.75; t takes q in at
  2.25 and ends at 3.5. A copy whose export would outlast it holds the interpreter to
  its end, as without `cost.export`."""
  cluster = Cluster()
  a, b, c = (cluster.add_lane(name) for name in 'abc')
  to_a, to_b, to_c = (cluster.channel(f'to {n}', lane) for n, lane in zip('abc', (a, b, c)))
  three = lambda: (_make(), _make(), _make())  # noqa: E731

  def on_a():
    p = yield Compute(_make, kind='forward', stage=0)
    yield Put(to_b, p)
    q = yield Get(to_a)
    yield Compute(lambda q: q[0] + 1, (q,), kind='forward', stage=0)

  def on_b():
    q = yield Compute(three, kind='forward', stage=0)
    yield Put(to_a, q)
    yield Put(to_c, q)
    p = yield Get(to_b)
    yield Compute(_use, (p,), kind='forward', stage=0)

  def on_c():
    q = yield Get(to_c)
    yield Compute(lambda q: q[0] + 1, (q,), kind='forward', stage=0)

  costs = CostModel(
    {'forward': 1.0},
    link_latency=0.5,
    link_per_array=0.25,
    take_in=(0.25, float('inf'), 0.0),
    export=export,
  )
  executor = LaneProcessModel(costs, run_ahead=4, copies_on_sender=interpreter)
  processes = [Process('a', a, on_a()), Process('b', b, on_b()), Process('c', c, on_c())]
  spans = _spans_by_lane(cluster, executor.run(cluster, processes))
  copies = {k: sorted(v) for k, v in spans.items() if k.startswith('link')}
  if export is not None and export[0] < 0.5:
    assert copies == {
      'link a → b': [(1, 1.5)],
      'link b → a': [(1, 2)],
      'link b → c': [(1.25, 2.25)],
    }
    assert spans['b'] == [(0, 1), (1.5, 2.75)] and spans['c'] == [(2.25, 3.5)]
  elif interpreter:
    assert copies == {
      'link a → b': [(1, 1.5)],
      'link b → a': [(1, 2)],
      'link b → c': [(2.25, 3.25)],
    }
    assert spans['b'] == [(0, 1), (2, 3.25)] and spans['c'] == [(3.25, 4.5)]
  else:
    assert copies == {'link a → b': [(1, 1.5)], 'link b → a': [(1, 2)], 'link b → c': [(1, 2)]}
    assert spans['b'] == [(0, 1), (1.5, 2.75)] and spans['c'] == [(2, 3.25)]
  assert spans['a'] == [(0, 1), (2, 3.25)]


@pytest.mark.parametrize(
  'export, copies',
  [
    ((0.3, float('inf'), 0.0), [(1, 2.0), (1.3, 1.8), (1.6, 2.1), (1.9, 2.4)]),
    ((0.4, float('inf'), 0.6), [(1, 2.0), (2.0, 2.5), (2.4, 2.9), (2.8, 3.3)]),
  ],
  ids=['a copy ends after the next one took the queue', 'an export outlasts its copy'],
)
def test_a_senders_queue_goes_to_its_next_copy_only_when_the_holder_lets_go(export, copies):
  """Lane b makes p (3 arrays) and q (1 array), 0 → 1; lanes c, d, e, f read p, q, q, q:
  four copies on b's queue, in that order, of 1 s (p: 0.5 s + 0.25 s per array beyond
  the first) and 0.5 s (q). With exports of 0.3 s each, p's copy lets go at 1.3, q's to d
  takes the queue 1.3 → 1.6 (ends 1.8), q's to e 1.6 → 1.9 (ends 2.1): d's copy ending at
  1.8 frees nothing, and q's to f starts at 1.9. With 0.4 s + 0.6 s per array beyond the
  first, p's export (1.6 s) outlasts its copy, which holds the queue to its end at 2;
  q's copies then take it 2 → 2.4 and 2.4 → 2.8, and the export p's copy no longer has,
  ending at 2.6, frees nothing: q's to f starts at 2.8."""
  cluster = Cluster()
  b, c, d, e, f = (cluster.add_lane(name) for name in 'bcdef')
  to = {name: cluster.channel(f'to {name}', lane) for name, lane in zip('cdef', (c, d, e, f))}

  def on_b():
    made = yield Compute(lambda: ((_make(), _make(), _make()), _make()), kind='forward', stage=0)
    p, q = made
    for name, value in zip('cdef', (p, q, q, q)):
      yield Put(to[name], value)

  def reads(name):
    value = yield Get(to[name])
    yield Compute(lambda v: jax.tree.leaves(v)[0] + 1, (value,), kind='forward', stage=0)

  costs = CostModel({'forward': 1.0}, link_latency=0.5, link_per_array=0.25, export=export)
  executor = LaneProcessModel(costs, run_ahead=4, copies_on_sender=True)
  processes = [Process('b', b, on_b())] + [
    Process(n, l, reads(n)) for n, l in zip('cdef', (c, d, e, f))
  ]
  spans = _spans_by_lane(cluster, executor.run(cluster, processes))
  flat = lambda lanes: [t for lane in lanes for span in spans[lane] for t in span]  # noqa: E731
  # (approx: 1.3 + 0.3 is not 1.6 in floating point)
  assert flat(f'link b → {name}' for name in 'cdef') == pytest.approx(
    [t for c in copies for t in c]
  )
  assert flat('cdef') == pytest.approx([t for _, end in copies for t in (end, end + 1.0)])


@pytest.mark.parametrize('interpreter', [False, True], ids=['copies apart', 'one interpreter'])
def test_a_lanes_next_take_in_goes_before_the_copies_of_its_tasks_result(interpreter):
  """Lane b makes x (B, 0 → 2), sends it to c, then reads p, which a made (0 → 1) and sent
  to b (the copy 1 → 1.5). At 2 both x's copy and b's next task, which takes p in first
  (0.25 s), can start: a lane process replies, wakes its export thread and takes its
  queued next call before that thread gets the interpreter, so b's task runs 2 → 3.25
  (its take-in 2 → 2.25) and x's copy after the take-in, 2.25 → 2.75; c takes x in and
  computes, 2.75 → 4. With the copies apart: x's copy 2 → 2.5 beside b's task, c
  2.5 → 3.75."""
  cluster = Cluster()
  a, b, c = (cluster.add_lane(name) for name in 'abc')
  to_b, to_c = cluster.channel('to b', b), cluster.channel('to c', c)

  def on_a():
    p = yield Compute(_make, kind='forward', stage=0)
    yield Send(to_b, p)

  def on_b():
    x = yield Compute(_make, kind='backward', stage=0)
    yield Send(to_c, x)
    p = yield Get(to_b)
    yield Compute(_use, (p,), kind='forward', stage=0)

  def on_c():
    x = yield Get(to_c)
    yield Compute(_use, (x,), kind='forward', stage=0)

  costs = dataclasses.replace(COSTS, take_in=(0.25, float('inf'), 0.0))
  executor = LaneProcessModel(costs, run_ahead=4, copies_on_sender=interpreter)
  processes = [Process('a', a, on_a()), Process('b', b, on_b()), Process('c', c, on_c())]
  spans = _spans_by_lane(cluster, executor.run(cluster, processes))
  assert spans['link a → b'] == [(1, 1.5)]
  assert spans['link b → c'] == [(2.25, 2.75) if interpreter else (2, 2.5)]
  assert spans['b'] == [(0, 2), (2, 3.25)]
  assert spans['c'] == [(2.75, 4) if interpreter else (2.5, 3.75)]


@pytest.mark.parametrize('devices', [False, True], ids=['no devices', 'two devices'])
def test_a_message_that_arrived_early_is_taken_in_once_by_the_first_task_reading_it(devices):
  """Lane a makes x (1000 bytes, 0 → 1) and sends it to b (the copy 1 → 1.5). Lane b
  runs two forwards (0 → 2) before the first task that reads x: x arrived at 1.5, yet
  that task first takes it in (0.125 + 1000 / 8000 = 0.25 s), as a lane process does at
  the first call reading a copy: 2 → 4.25 with its 2 s. The second task reading x takes
  nothing in: 4.25 → 6.25. Alike where the lanes have devices of their own, and the copy
  is a new array on b's device."""
  cluster = Cluster()
  if devices:
    first, second = jax.devices()[:2]
    a, b = cluster.add_lane('a', first), cluster.add_lane('b', second)
  else:
    a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def on_a():
    x = yield Compute(_make, kind='forward', stage=0)
    yield Send(inbox, x)

  def on_b():
    for _ in range(2):
      yield Compute(_make, kind='forward', stage=0)
    x = yield Get(inbox)
    for _ in range(2):
      yield Compute(_use, (x,), kind='backward', stage=0)

  costs = dataclasses.replace(COSTS, take_in=(0.125, 8000.0, 0.0625))
  executor = LaneProcessModel(costs, run_ahead=4)
  spans = _spans_by_lane(
    cluster, executor.run(cluster, [Process('a', a, on_a()), Process('b', b, on_b())])
  )
  assert spans == {
    'a': [(0, 1)],
    'link a → b': [(1, 1.5)],
    'b': [(0, 1), (1, 2), (2, 4.25), (4.25, 6.25)],
  }


def test_a_senders_copy_waiting_for_its_value_holds_up_no_copy_behind_it():
  """Lane a makes x (0 → 1) and y (from 1), sends y to b, then x to c. Its copies share
  a's core with its tasks (`copies_on_sender`, time-sliced) and run one at a time, as a
  lane process's exports do (one thread), but y's copy, asked first, waits for y while
  x's goes at 1, as a lane process parks an export whose value is not made yet: x's copy
  (0.5 s) and the making of y (1 s) share the core at half speed each from 1, so x's
  copy ends at 2 and y at 2.5; y's copy runs 2.5 → 3. (Served in the order asked, x's
  copy waited behind y's, 2.5 → 3, and c's task with it.)"""
  cluster = Cluster()
  a, b, c = cluster.add_lane('a'), cluster.add_lane('b'), cluster.add_lane('c')
  to_b, to_c = cluster.channel('to b', b), cluster.channel('to c', c)

  def on_a():
    x = yield Compute(_make, kind='forward', stage=0, batch=0)
    y = yield Compute(_make, kind='forward', stage=0, batch=1)
    yield Send(to_b, y)
    yield Send(to_c, x)

  def on(channel):
    got = yield Get(channel)
    yield Compute(_use, (got,), kind='backward', stage=0)

  executor = virtual.make(
    COSTS, run_ahead=4, copies_on_sender=True, time_sliced=True, lane_hardware={'a': 'core'}
  )
  processes = [Process('a', a, on_a()), Process('b', b, on(to_b)), Process('c', c, on(to_c))]
  assert _spans_by_lane(cluster, executor.run(cluster, processes)) == {
    'a': [(0, 1), (1, 2.5)],
    'link a → c': [(1, 2)],
    'link a → b': [(2.5, 3)],
    'b': [(3, 5)],
    'c': [(2, 4)],
  }


def test_a_task_marked_not_ahead_is_waited_for():
  cluster, seen = Cluster(), []
  lane = cluster.add_lane('a')
  executor = LaneProcessModel(COSTS, run_ahead=4)

  def program():
    yield Compute(_make, kind='forward', stage=0)
    seen.append(executor.now())
    yield Compute(_make, kind='forward', stage=0, ahead=False)
    seen.append(executor.now())

  executor.run(cluster, [Process('p', lane, program())])
  assert seen == [0, 2]


@pytest.mark.parametrize('ready', [False, True])
def test_ready_holds_a_task_back_until_its_input_exists_and_keeps_it_from_blocking_a_lane(
  ready,
):
  """p makes x on lane a (B: 0 → 2) and computes y from x on lane s (F, after the copy
  a → s, 2 → 2.5); q computes z on s (F) once its own task on lane q has ended (F, 0 → 1,
  waited for). Dispatched at 0, y holds s from the start, so z (dispatched at 1) waits
  behind it: y 2.5 → 3.5, z 3.5 → 4.5. With `Ready(x)` p goes on at 2, when x's end is
  heard: z runs 1 → 2 and y 2.5 → 3.5."""
  cluster, seen = Cluster(), []
  a, s, q = cluster.add_lane('a'), cluster.add_lane('s'), cluster.add_lane('q')
  executor = LaneProcessModel(COSTS, run_ahead=4)

  def on_p():
    x = yield Compute(_make, kind='backward', stage=0)
    if ready:
      yield Ready(x)
    seen.append(executor.now())
    yield Compute(_use, (x,), kind='forward', stage=0, lane=s)

  def on_q():
    yield Compute(_make, kind='forward', stage=0, ahead=False)
    yield Compute(_make, kind='forward', stage=0, lane=s, batch=1)

  timeline = executor.run(cluster, [Process('p', a, on_p()), Process('q', q, on_q())])
  spans = {(cluster.lanes[t.lane].name, t.batch): (t.start, t.end) for t in timeline.tasks()}
  y, z = spans['s', None], spans['s', 1]
  assert seen == [2 if ready else 0]
  assert (y, z) == (((2.5, 3.5), (1, 2)) if ready else ((2.5, 3.5), (3.5, 4.5)))
  assert spans['link a → s', None] == (2, 2.5)


def test_an_ended_task_keeps_no_result_alive():
  """Each task reads the previous one's result: the executor's record of who made what
  must not chain them, or every result of the run stays in memory (it did: a PD-ASGD run
  of 80 steps grew to 11 GB)."""
  import gc
  import weakref

  cluster = Cluster()
  lane = cluster.add_lane('a')
  made, alive = [], []
  executor = LaneProcessModel(COSTS, run_ahead=4)

  def program():
    x = yield Compute(_make, kind='forward', stage=0)
    for _ in range(20):
      made.append(weakref.ref(x))
      x = yield Compute(_use, (x,), kind='forward', stage=0)
    yield Compute(_use, (x,), kind='forward', stage=0, ahead=False)  # all ended
    gc.collect()
    alive.append(sum(ref() is not None for ref in made))

  executor.run(cluster, [Process('p', lane, program())])
  assert alive == [0]  # (x now holds a result made after them)


def test_a_run_ahead_schedule_refuses_a_checkpoint():
  cluster = Cluster()
  lane = cluster.add_lane('a')
  executor = LaneProcessModel(COSTS, run_ahead=2)
  refused = []

  def program():
    yield Compute(_make, kind='forward', stage=0)
    try:
      executor.snapshot()
    except NotResumableError as error:
      refused.append(str(error))

  executor.run(cluster, [Process('p', lane, program())])
  assert refused and 'run-ahead' in refused[0]


def test_a_negative_bound_is_refused():
  with pytest.raises(ValueError, match='run_ahead'):
    LaneProcessModel(COSTS, run_ahead=-1)
  with pytest.raises(ValueError, match='run_ahead'):
    virtual.make(COSTS, run_ahead=-1)


# --- every scheduler family, end to end (`cost.host`: the process executor's) ----------------
# Each family in a configuration whose values do not depend on the schedule: the pipelines
# are deterministic; one ASGD worker, PD-ASGD's 1:1 with one token and LPP-SGD's one replica
# are sequential SGD (whose lane-process forms these runs take).
SEQUENTIAL = {
  'bp': ('ddg', {'algorithm.name': 'bp', 'stages': 2}),
  'ddg': ('ddg', {}),
  'local': ('local', {}),
  'asgd': ('asgd', {'workers': 1}),
  'dcasgd': ('dcasgd', {'workers': 1}),
  'pdasgd': (
    'pdasgd',
    {'stages': 2, 'algorithm.n_fwd': 1, 'algorithm.n_bwd': 1, 'algorithm.max_inflight': 1},
  ),
  'lppsgd': ('lppsgd', {'algorithm.devices': 1, 'algorithm.workers_per_device': 1}),
}


def _family_run(family, host, data_dir, workdir):
  """`family`'s run on the virtual clock with the host profile `host` (None: no host)."""
  import importlib

  from jaxsgd import training

  name, overrides = SEQUENTIAL[family]
  config = importlib.import_module(f'experiments.configs.{name}').get_config('smoke')
  config.update({'data_dir': data_dir, 'clock': 'virtual', 'train_steps': 12, 'eval_every': 12})
  if family == 'bp':
    del config.algorithm['variant']  # a DDG field
  config.cost.update({'host': host, 'link_latency': 1e-4})
  for field, value in overrides.items():
    parent, _, leaf = field.rpartition('.')
    (config[parent] if parent else config)[leaf] = value
  return training.train_and_evaluate(config, str(workdir), show_progress=False)['final']


@pytest.mark.parametrize('family', SEQUENTIAL)
def test_every_family_running_ahead_computes_the_in_order_values(family, data_dir, tmp_path):
  """The same losses, accuracy and staleness as the in-order clock, bit for bit, with
  and without a simulated driver (a host profile of the process executor, with zero or
  some driver time); the simulated time may differ (copies the in-order clock does not
  price, overlap, the driver's time)."""
  in_order = _family_run(family, None, data_dir, tmp_path / 'in_order')
  ahead = _family_run(family, host_file(tmp_path), data_dir, tmp_path / 'run_ahead')
  driver = host_file(tmp_path, driver=1e-3, driver_latency=2e-3)
  driven = _family_run(family, driver, data_dir, tmp_path / 'driven')
  for run in (ahead, driven):
    for key in ('train_loss', 'test_loss', 'test_accuracy'):
      assert run[key] == in_order[key], key
    assert run.get('staleness_mean') == in_order.get('staleness_mean')
  assert driven['sim_time'] > ahead['sim_time']  # the driver's time is on its path


# --- bad input -----------------------------------------------------------------------------------
def test_the_old_schedule_setting_is_refused_naming_its_replacement():
  from jaxsgd.algorithms.settings import cost_settings

  with pytest.raises(ValueError, match=r'^cost.schedule: renamed; use cost.host \(a host profile'):
    cost_settings({'schedule': 'run_ahead'}, clock='virtual')


def test_a_simulated_process_executor_refuses_periodic_checkpoints(tmp_path):
  from experiments.configs import ddg as ddg_config
  from jaxsgd.algorithms.settings import shared_settings

  config = ddg_config.get_config('smoke')
  config.update({'clock': 'virtual', 'checkpoint_every': 5})
  config.cost.host = host_file(tmp_path)
  with pytest.raises(ValueError, match=r'^checkpoint_every: a virtual run of the process executor'):
    shared_settings(config)


def test_a_data_parallel_method_refuses_a_host_profile(tmp_path):
  from experiments.configs import ssgd as ssgd_config
  from jaxsgd import algorithms

  from scheduler_helpers import mlp

  config = ssgd_config.get_config('smoke')
  config.cost.host = host_file(tmp_path, 'in_process')
  with pytest.raises(ValueError, match=r"^cost.host: a host profile prices an executor's host"):
    algorithms.get('ssgd').validate(config, mlp())


@pytest.mark.parametrize(
  'executor, given, bound, lane_processes',
  [(None, None, 0, False), ('in_process', None, 0, False)]
  + [('processes', None, 4, True), ('processes', 1, 1, True)],
)
def test_the_host_profile_gives_the_virtual_clock_the_process_executors_schedule(
  executor, given, bound, lane_processes, tmp_path
):
  """A host profile of the process executor (`cost.host`) is what makes the family runs
  above run ahead at all: the virtual clock gets that executor's bound (4; ASGD's 1,
  passed as `run_ahead`), and the asynchronous policies their lane-process forms."""
  from experiments.configs import ddg as ddg_config
  from jaxsgd.algorithms import clocks
  from jaxsgd.algorithms.settings import KINDS, shared_settings

  config = ddg_config.get_config('smoke')
  config.clock = 'virtual'
  host = None if executor is None else host_file(tmp_path, executor)
  config.cost.update({'host': host, 'calibrate': False})
  config.cost.compute.update({kind: 1.0 for kind in KINDS})
  shared = shared_settings(config)
  executor, _ = clocks.make_executor(shared, None, KINDS, 2, run_ahead=given)
  assert executor.run_ahead == bound
  assert shared.lane_processes is lane_processes


@pytest.mark.parametrize('executor', ['in_process', 'processes', 'emulated'])
def test_a_real_clock_run_refuses_a_host_profile(executor, tmp_path):
  from experiments.configs import ddg as ddg_config
  from jaxsgd.algorithms.settings import shared_settings

  config = ddg_config.get_config('smoke')
  config.update({'clock': 'real', 'executor': executor})
  config.cost.host = host_file(tmp_path)
  with pytest.raises(ValueError, match=r"^cost.host: a host profile prices an executor's host"):
    shared_settings(config)
