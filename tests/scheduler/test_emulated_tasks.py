"""Emulated tasks (`executor='emulated'`, `ProcessExecutor(emulate=cost_model)`): each task
waits its priced duration in its lane process and returns zeros of its real outputs'
shapes, so the messages between lanes keep their real sizes.

What a lane does with an emulated call is checked in this process, on a fake clock (the
lane ends the task exactly `seconds` after its start, by its own clock); what the
executor sends is checked against hand-computed prices and against the virtual clock's
own draws. Timings on the machine are held only to what a wait guarantees: a task that
waits d seconds takes at least d. The lanes join a Ray head started with
`ray start --head` (`tests/lanes/ray_head.py`), once for the module, and none of their
processes is left afterwards.
"""

import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
import lane_tasks  # noqa: E402
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone  # noqa: E402

from jaxsgd import optimizers  # noqa: E402
from jaxsgd.algorithms import ddg  # noqa: E402
from jaxsgd.pipeline import BatchFeed, sequential_roles  # noqa: E402
from jaxsgd.scheduler import CostModel  # noqa: E402
from jaxsgd.scheduler import virtual as virtual_lib  # noqa: E402
from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool  # noqa: E402
from jaxsgd.scheduler.lanes import runtime as runtime_lib  # noqa: E402
from jaxsgd.scheduler.lanes.pool import _dumps  # noqa: E402
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR, LaneRuntime, Ref  # noqa: E402
from jaxsgd.scheduler.process import ProcessExecutor  # noqa: E402
from jaxsgd.scheduler.tasks import Task, TaskRecipe  # noqa: E402
from scheduler_helpers import make_pipeline, batches, mlp  # noqa: E402

OPTIMIZER = optimizers.OptimizerSettings('sgd', 0.1)
STEPS = 3
LAYER = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.5)
# Seconds per task (`cost.compute`); stage 1 runs at half speed (`cost.device_speeds`).
COSTS = {'forward': 0.03, 'backward': 0.05, 'update': 0.01}
SPEEDS = (1.0, 0.5)


def host_valued_tasks() -> dict:
  """A task whose output's shape depends on its argument's value (read on the host):
  it has no abstract trace (a `TaskRecipe` factory)."""
  return {'ones': lambda n: jnp.ones(int(np.asarray(n).sum()), jnp.float32)}


# --- a lane, in this process, on a fake clock --------------------------------------------------
class FakeTime:
  """`time` for the runtime: a clock that moves only when slept on (and by 1 µs per read,
  so that a spin ends), and CPU clocks that do not move."""

  def __init__(self):
    self.now, self.slept = 100.0, []

  def perf_counter(self) -> float:
    self.now += 1e-6
    return self.now

  def time(self) -> float:
    return self.now + 1e9

  def process_time(self) -> float:
    return 0.0

  def thread_time(self) -> float:
    return 0.0

  def sleep(self, seconds: float) -> None:
    self.slept.append(seconds)
    self.now += seconds


class Lane:
  """A `LaneRuntime` in this process, called as `LanePool` calls it."""

  def __init__(self):
    self.runtime, self.keys, self.numbers = LaneRuntime('lane', None), iter(range(10**6)), {}

  def call(self, name: str, args: tuple, seconds: float | None, recipe=LAYER):
    """`(key, outline, start, end)` of task `name` of `recipe` on `args`."""
    task, key = Task(recipe, name), next(self.keys)
    number = self.numbers.get(task)  # a task reaches a lane once, then goes by its number
    named = (
      number if number is not None else (self.numbers.setdefault(task, len(self.numbers)), task)
    )
    call, buffers = _dumps((named, args, key, (), seconds, True))
    outline, _, start, end, self.cpu, _ = self.runtime.run(call, (), *buffers)
    return key, outline, start, end

  def value(self, key, *path):
    return self.runtime.values[(key, path)]


def test_an_emulated_call_takes_its_seconds_and_returns_zeros_shaped_as_the_real_result(
  monkeypatch,
):
  """The forward's result (an array and a VJP) and the backward's through that VJP:
  the emulated calls' outlines (bytes, shapes, dtypes) are the real calls', their
  values zeros; each ends exactly `seconds` after its start by the lane's clock, having
  slept all but the spin; a second call of the same shapes reuses the first's zeros."""
  lane = Lane()
  w = np.full((8, 4), 0.5, np.float32)
  x = np.ones((3, 8), np.float32)
  g = np.ones((3, 4), np.float32)
  real_key, real_forward, _, _ = lane.call('forward', (w, x), None)
  _, real_backward, _, _ = lane.call('backward', (Ref((real_key, (1,))), g), None)

  clock = FakeTime()
  monkeypatch.setattr(runtime_lib, 'time', clock)
  key, forward, start, end = lane.call('forward', (w, x), 0.25)
  assert forward == real_forward
  assert clock.slept == [pytest.approx(0.25 - runtime_lib.SPIN_SECONDS, abs=1e-5)]
  assert end - start == pytest.approx(0.25, abs=1e-5)
  y = lane.value(key, 0)
  assert (y.shape, y.dtype, float(jnp.abs(y).max())) == ((3, 4), jnp.float32, 0.0)
  assert type(lane.value(key, 1)) is type(lane.value(real_key, 1))  # a VJP, to pass on

  _, backward, start, end = lane.call('backward', (Ref((key, (1,))), g), 0.5)
  assert backward == real_backward  # (dw, dx): float32[8, 4], float32[3, 8]
  assert end - start == pytest.approx(0.5, abs=1e-5)
  again, _, start, end = lane.call('forward', (w, x), 0.125)
  assert lane.value(again, 0) is y and end - start == pytest.approx(0.125, abs=1e-5)
  assert clock.slept[-1] == pytest.approx(0.125 - runtime_lib.SPIN_SECONDS, abs=1e-5)


def test_a_tasks_cpu_leaves_out_what_the_lanes_copy_threads_used_meanwhile(monkeypatch):
  """A task's `cpu` is its lane process's CPU over the task less what the copy threads
  used meanwhile (`CopyCpu.total`). By hand: over a 0.25-s emulated task the process's
  CPU clock moves 0.1 s, of which a copy took 0.06 s: the task's CPU is 0.04 s; copies
  read as more than the process used leave 0, never less."""
  lane = Lane()
  w, x = np.full((8, 4), 0.5, np.float32), np.ones((3, 8), np.float32)
  lane.call('forward', (w, x), None)  # (compiled: the emulated calls reuse its outline)

  class Busy(FakeTime):
    """The process's CPU clock moves 0.1 s while the task waits; the copies' `copy` s."""

    def __init__(self, copy):
      super().__init__()
      self.cpu, self.copied, self.copy = 0.0, 5.0, copy

    def process_time(self):
      return self.cpu

    def sleep(self, seconds):
      super().sleep(seconds)
      self.cpu += 0.1
      self.copied += self.copy

  for copy, cpu in ((0.06, 0.04), (0.3, 0.0)):
    busy = Busy(copy)
    monkeypatch.setattr(runtime_lib, 'time', busy)
    monkeypatch.setattr(lane.runtime.copies, 'total', lambda busy=busy: busy.copied)
    lane.call('forward', (w, x), 0.25)
    assert lane.cpu == pytest.approx(cpu, abs=1e-9)


def test_copy_threads_cpu_is_read_live_and_kept_when_they_end():
  """`CopyCpu`: a thread computing inside `counted` is seen using CPU while it runs, and
  what it used stays in the total once it ends; a thread sleeping inside it (past the
  second reading: a thread that ends between two readings moves its CPU into the total
  however it was read) adds almost nothing; a thread outside it adds nothing."""
  copies = runtime_lib.CopyCpu()

  def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
      pass

  spinning = threading.Thread(target=copies.counted, args=(spin, 0.4))
  others = [
    threading.Thread(target=copies.counted, args=(time.sleep, 0.6)),
    threading.Thread(target=spin, args=(0.1,)),
  ]
  for thread in (spinning, *others):
    thread.start()
  time.sleep(0.05)
  before = copies.total()
  time.sleep(0.2)
  assert copies.total() > before  # read live, the spinning thread not ended yet
  for thread in (spinning, *others):
    thread.join()
  assert 0.4 <= copies.total() < 0.4 + 0.05


def test_a_lanes_readers_count_as_its_copy_threads(monkeypatch):
  """What a lane's connection readers do (the driver's: its calls and their arrays;
  another lane's: its copies) is counted in `CopyCpu`, so that a task leaves it out: a
  reader whose message takes 0.05 s of its thread's CPU adds that to the total."""

  class Reader:
    """A connection whose next message costs 0.05 s of CPU, then ends."""

    shared = None  # (no memory shared with its sender: `wire.Endpoint.shared`)

    def receive(self):
      end = time.thread_time() + 0.05
      while time.thread_time() < end:
        pass
      raise EOFError

  class Exited(Exception):
    pass

  def exit_now(*_):
    raise Exited

  runtime = Lane().runtime
  runtime.driver_connected = threading.Event()  # (what `serve` sets up)
  monkeypatch.setattr(runtime_lib.wire, 'exit_now', exit_now)  # the driver's end: exit
  for hello in (('lane', ('127.0.0.1', 1)), ('driver',)):
    before = runtime.copies.total()
    try:
      runtime._connected(Reader(), hello)
    except Exited:
      assert hello == ('driver',)
    assert runtime.copies.total() - before >= 0.05, hello


def test_a_lane_replies_to_the_driver_before_it_wakes_the_exports_of_the_result():
  """The call thread sends a task's end to the driver, then wakes the export parked for
  its result (`LaneRuntime._made`): woken as the result was kept, the export thread took
  the interpreter before the reply and the driver heard of the end 0.3-0.8 ms late."""
  import queue

  lane = Lane()
  runtime = lane.runtime
  runtime.calls, runtime.exports = queue.SimpleQueue(), queue.SimpleQueue()
  runtime.parked = [('export', 7, ((0, (0,)), (), None, None, False))]  # the next result's
  replies = []
  runtime._reply = lambda kind, number, value: replies.append((kind, runtime.exports.empty()))
  threading.Thread(target=runtime._run_calls, daemon=True).start()
  w, x = np.full((8, 4), 0.5, np.float32), np.ones((3, 8), np.float32)
  call, buffers = _dumps(((0, Task(LAYER, 'forward')), (w, x), 0, (), None, True))
  runtime.calls.put(('run', 0, (call, (), *buffers)))
  assert runtime.exports.get(timeout=30) is runtime_lib._WAKE  # woken once it was made
  assert replies == [('ok', True)]  # and only after the reply: none woken before it


@pytest.mark.parametrize('hastened', [False, True])
def test_a_lane_holds_the_ends_of_tasks_run_ahead_while_two_calls_are_queued(hastened):
  """Four calls queued at once: three `run_ahead` (the driver went on without them) and a
  `run` it waits for. The first two ends are held (three and two calls behind them); the
  third, with one call behind it, is sent after them, in order, while the fourth has not
  run yet: one wake-up of the driver for three ends, while the lane still has a call to
  run. `hasten` (a `Ready` on the first's result) sends the first at its end, while the
  second is not made yet."""
  import queue

  runtime = Lane().runtime
  runtime.calls, runtime.exports = queue.SimpleQueue(), queue.SimpleQueue()
  replies = []

  def reply(kind, number, value):  # (which of the four results exist when it is sent)
    made = tuple(any(key[0] == k for key in runtime.values) for k in range(4))
    replies.append((kind, number, made))

  runtime._reply = reply
  w, x = np.full((8, 4), 0.5, np.float32), np.ones((3, 8), np.float32)
  for number, op in enumerate(('run_ahead', 'run_ahead', 'run_ahead', 'run')):
    call, buffers = _dumps(((0, Task(LAYER, 'forward')), (w, x), number, (), 0.0, True))
    runtime.calls.put((op, number, (call, (), *buffers)))
  if hastened:
    runtime.hasten(0)
  thread = threading.Thread(target=runtime._run_calls, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while len(replies) < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
  three, every = (True, True, True, False), (True, True, True, True)
  if hastened:
    first = ('ok', 0, (True, False, False, False))
    assert replies == [first, ('ok', 1, three), ('ok', 2, three), ('ok', 3, every)]
  else:
    assert replies == [('ok', 0, three), ('ok', 1, three), ('ok', 2, three), ('ok', 3, every)]
  assert runtime.held == [] and runtime.hastened == set()


@pytest.mark.parametrize('calls', [4, 5])
def test_a_lane_that_waits_for_a_copy_with_a_short_queue_sends_the_ends_it_holds(calls):
  """`calls` calls queued at once, all run ahead; the third reads a copy from another lane
  that has not come. The first two ends are held (two calls or more behind them).
  Four calls: the third waits with one call behind it, and sends the two held ends as it
  starts to wait, while nothing else has ended — a waiting lane's core is idle, and the
  driver hears of room on a lane about to run dry. Five: two calls behind it, the lane
  keeps holding (the driver needs no room there). The copy comes; the rest run, and each
  end goes with the first one sent at once (one call behind it or none)."""
  import pickle
  import queue

  runtime = Lane().runtime
  runtime.calls, runtime.exports = queue.SimpleQueue(), queue.SimpleQueue()
  replies = []
  runtime._reply = lambda kind, number, value: replies.append(number)
  w, x = np.full((8, 4), 0.5, np.float32), np.ones((3, 8), np.float32)
  copied, source = ('copied', ()), ('127.0.0.1', 1)
  for number in range(calls):
    reads = Ref(copied) if number == 2 else x
    call, buffers = _dumps(((0, Task(LAYER, 'forward')), (w, reads), number, (), 0.0, True))
    imports = ((copied, source),) if number == 2 else ()
    runtime.calls.put(('run_ahead', number, (call, imports, *buffers)))
  threading.Thread(target=runtime._run_calls, daemon=True).start()
  deadline = time.monotonic() + 30
  while {key[0] for key in runtime.values} != {0, 1} and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)  # (the third waits for its copy: nothing more is sent meanwhile)
  assert {key[0] for key in runtime.values} == {0, 1}  # the third has not run
  if calls == 4:
    assert replies == [0, 1] and runtime.held == []
  else:
    assert replies == [] and [reply[1] for reply in runtime.held] == [0, 1]
  leaves, treedef = jax.tree.flatten(x)
  with runtime.stored:  # the copy comes, as a lane's reader would hand it over
    runtime.arrived[copied] = (('treedef', pickle.dumps(treedef)), leaves)
    runtime._changed()
  while len(replies) < calls and time.monotonic() < deadline:
    time.sleep(0.01)
  assert replies == list(range(calls)) and runtime.held == []


def test_hasten_sends_the_held_ends_at_once_and_ignores_one_already_sent():
  """By hand: a held end asked for goes at once with those held before it; an end
  already sent (its number at most the last one answered) is not waited for again."""
  runtime = Lane().runtime
  sent = []
  runtime._reply = lambda kind, number, value: sent.append(number)
  runtime.held = [('ok', 4, None), ('ok', 5, None)]
  runtime.last_ended = 5
  runtime.hasten(5)
  assert sent == [4, 5] and runtime.held == []
  runtime.hasten(3)  # replied before
  assert runtime.hastened == set()
  runtime.hasten(7)  # not ended yet: replied at its end
  assert runtime.hastened == {7} and sent == [4, 5]


def test_a_moved_vjp_is_rebuilt_from_one_trace_per_task_and_argument_shapes(monkeypatch):
  """A lane takes in a VJP (a structure that does not pickle) by tracing the task that
  made it: once per task, argument shapes and part, not at every move (the trace, ~4 ms,
  was paid at each of PD-ASGD's residual moves, in front of the backward reading them).
  Every VJP taken in still gives its own forward's gradients, bit for bit, from the host
  arrays it came in."""
  source, target = Lane(), Lane()
  traces, trace = [], jax.eval_shape
  monkeypatch.setattr(jax, 'eval_shape', lambda *a, **k: traces.append(a[0]) or trace(*a, **k))
  w, g = np.full((8, 4), 0.5, np.float32), np.ones((3, 4), np.float32)
  for i, x in enumerate((np.ones((3, 8)), np.full((3, 8), 2.0), np.ones((5, 8)))):
    x = x.astype(np.float32)
    g = np.ones((len(x), 4), np.float32)
    key, *_ = source.call('forward', (w, x), None)
    _, payload = source.runtime.export((key, (1,)))
    assert payload[0][0] == 'origin'  # rebuilt from its task, not unpickled
    assert target.runtime.adopt(payload, (f'moved {i}', ()), describe=False) is None
    # A CPU lane keeps the arrays as they came (a jitted call takes them in itself).
    assert all(type(leaf) is np.ndarray for leaf in jax.tree.leaves(target.value(f'moved {i}')))
    there, *_ = target.call('backward', (Ref((f'moved {i}', ())), g), None)
    here, *_ = source.call('backward', (Ref((key, (1,))), g), None)
    for part in (0, 1):
      np.testing.assert_array_equal(target.value(there, part), source.value(here, part))
    assert len(traces) == (1 if i < 2 else 2)  # the third forward's batch has 5 rows


def test_a_task_without_an_abstract_trace_runs_once_for_its_shapes():
  """A task whose output's shape is set by its argument's value: `jax.eval_shape` cannot
  trace it, so the first emulated call of its shapes runs it, the next ones do not."""
  lane = Lane()
  recipe = TaskRecipe.of(host_valued_tasks)
  n = np.array([2, 3], np.int32)
  key, outline, _, _ = lane.call('ones', (n,), 0.001, recipe)
  assert outline == (20, 'float32[5]')
  assert float(jnp.abs(lane.value(key)).max()) == 0.0  # zeros, not the ones it computed
  again, _, _, _ = lane.call('ones', (np.array([4, 4], np.int32),), 0.001, recipe)
  assert lane.value(again) is lane.value(key)  # same shapes, same zeros: not run again


def test_lppsgd_partitioned_update_has_an_abstract_trace():
  """It asked its parameters for their device, which a tracer has none of: an emulated
  lane ran it, compiling it, at each slice's first step (~100 ms in a lane's steady
  state, beyond its price)."""
  from jaxsgd.asynchronous import lppsgd

  roles = sequential_roles(1)
  stages = make_pipeline(
    mlp(),
    roles,
    optimizers.make_optimizer(OPTIMIZER, STEPS),
    optimizer=(OPTIMIZER, STEPS),
  )
  params = stages.initial_variables(0, roles[0])['params']
  opt_state = stages.tx.init(params)
  recipe = TaskRecipe.of(
    lppsgd.partitioned_step_tasks, update=stages.ops(0, roles[0]).update, part=1, parts=3
  )
  step = recipe.build()['partitioned_update']
  traced = jax.eval_shape(step, params, opt_state, params)
  real = step(params, opt_state, params)
  assert jax.tree.structure(traced) == jax.tree.structure(real)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), traced) == jax.tree.map(
    lambda x: (x.shape, x.dtype), real
  )


def test_the_wait_sleeps_then_spins_to_its_deadline(monkeypatch):
  clock = FakeTime()
  monkeypatch.setattr(runtime_lib, 'time', clock)
  deadline = clock.perf_counter() + 0.01
  runtime_lib.wait_until(deadline)
  assert clock.slept == [pytest.approx(0.01 - runtime_lib.SPIN_SECONDS, abs=1e-5)]
  assert deadline <= clock.now < deadline + 2e-6
  runtime_lib.wait_until(clock.now + 1e-4)  # shorter than the spin: no sleep
  assert len(clock.slept) == 1


# --- the executor, on lane processes ---------------------------------------------------------------
@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.fixture(scope='module')
def pool(head):
  with LanePool(
    LanePlacement.spread(['stage0', 'stage1']), address=head.address, verbose=False
  ) as lanes:
    yield lanes
  assert gone(lanes.pids().values()) == []


def train(roles, executor, started: dict | None = None, pool: LanePool | None = None):
  """`STEPS` iterations of `roles` (MLP, SGD) on `executor`: its timeline. `started`:
  filled with `{lane: [(task name, seconds, result outline)]}` of the tasks `pool`
  started, in the order started."""
  tx = optimizers.make_optimizer(OPTIMIZER, STEPS)
  stages = make_pipeline(mlp(), roles, tx, optimizer=(OPTIMIZER, STEPS))
  feed = BatchFeed(batches(0), 1 + sum(r.loss != 'none' for r in roles))
  session = stages.session(roles, feed, STEPS)
  session.fetch = executor.fetch
  pendings = []
  if pool is not None:
    start = pool.start

    def start_and_note(lane, task, args=(), *, seconds=None, **options):
      pending = start(lane, task, args, seconds=seconds, **options)
      pendings.append((lane, task.name, seconds, pending))
      return pending

    pool.start = start_and_note
  try:
    timeline = executor.run(session.cluster, session.processes())
  finally:
    executor.close()
    if pool is not None:
      del pool.start
  if started is not None:
    for lane, name, seconds, pending in pendings:
      started.setdefault(lane, []).append((name, seconds, _outline(pending.result())))
  return timeline


def _outline(result):
  """A task's result as the driver knows it: its handles' bytes and descriptions."""
  if isinstance(result, tuple):
    return tuple(_outline(part) for part in result)
  return (result.nbytes, result.description) if hasattr(result, 'nbytes') else result


def _computed(timeline) -> dict:
  """`{lane name: [(kind, stage, batch, seconds)]}` of the compute lanes, in start order."""
  tasks = {}
  for record in sorted(timeline.records, key=lambda r: r.start):
    name = timeline.lane_names[record.lane]
    if not name.startswith('link '):
      tasks.setdefault(name.split(' (')[0], []).append(
        (record.kind, record.stage, record.batch, record.end - record.start)
      )
  return tasks


def test_each_task_waits_the_hand_computed_price_and_returns_the_real_shapes(pool):
  """Staged BP over 2 lanes, F/B/U = 30/50/10 ms and lane 1 at half speed: the lanes are
  sent exactly those prices (lane 1's doubled), each task lasts at least its price, and
  every result has the shapes, dtypes and bytes of the same run's real result, so each
  copy between the lanes moves what it moves in the real run."""
  roles = sequential_roles(2)
  model = CostModel(dict(COSTS), device_speeds=SPEEDS)
  emulated, real = {}, {}
  timeline = train(roles, ProcessExecutor(pool=pool, emulate=model), emulated, pool)
  train(roles, ProcessExecutor(pool=pool), real, pool)
  assert timeline.clock == 'real (emulated tasks)'
  tasks = _computed(timeline)
  for stage in (0, 1):
    lane = f'stage{stage}'
    kinds = [kind for kind, _, _, _ in tasks[f'stage {stage}']]
    assert kinds == ['forward', 'backward', 'update'] * STEPS
    prices = [COSTS[kind] / SPEEDS[stage] for kind in kinds]  # 30/50/10 ms; 60/100/20 ms
    assert [seconds for _, seconds, _ in emulated[lane]] == prices
    assert [(name, outline) for name, _, outline in emulated[lane]] == [
      (name, outline) for name, _, outline in real[lane]
    ]
    durations = [duration for _, _, _, duration in tasks[f'stage {stage}']]
    assert all(d >= price for d, price in zip(durations, prices, strict=True))
  assert pool.held('stage0') == pool.held('stage1') == 0  # nothing left in the lanes


def test_a_lanes_time_between_queued_calls_is_measured_between_its_tasks(pool):
  """`measure_call_gap` over a chain of 20 ms emulated tasks on one lane: the chain's calls
  are queued (`queued_gap` finds pairs) and the figure is the time between a task's end
  and the next one's start — more than nothing, less than a task (a task's own length,
  or the time from one end to the next, would be 20 ms or more)."""
  from jaxsgd.scheduler import lane_timing

  gap = lane_timing.measure_call_gap(pool, 'stage0', seconds=0.02, tasks=8, repeats=1)
  assert 0 < gap < 0.02


def test_the_lanes_wait_what_the_virtual_clock_draws_straggler_noise_included(pool):
  """With straggler noise each lane's n-th task draws the n-th number of that lane's
  stream on both clocks: DDG's tasks, lane by lane, wait exactly the virtual clock's
  durations (kinds, stages and batches in the same order)."""
  roles = ddg.roles(2)
  model = CostModel(dict(COSTS), device_speeds=SPEEDS, straggler_std=0.3, seed=7)
  virtual = _computed(train(roles, virtual_lib.make(model, run_ahead=4)))
  started = {}
  emulated = _computed(train(roles, ProcessExecutor(pool=pool, emulate=model), started, pool))
  sent = {lane: [seconds for _, seconds, _ in tasks] for lane, tasks in started.items()}
  sampler = model.sampler()  # each lane's stream, drawn in that lane's order
  for stage in (0, 1):
    lane = f'stage {stage}'
    assert [t[:3] for t in emulated[lane]] == [t[:3] for t in virtual[lane]]
    drawn = [sampler.duration(kind, stage, stage) for kind, _, _, _ in virtual[lane]]
    assert [t[3] for t in virtual[lane]] == pytest.approx(drawn, rel=1e-12, abs=0)
    assert sent[f'stage{stage}'] == drawn  # the same floats
    assert all(e[3] >= d for e, d in zip(emulated[lane], drawn, strict=True))
  assert len(set(sent['stage0'])) > 3  # the noise varies them


@pytest.mark.parametrize('fault', ['raise', 'kill'])
def test_a_failing_emulated_lane_ends_the_run_naming_it_and_leaves_no_process(
  head, monkeypatch, fault
):
  """The fault hook's task raising (or its lane's process dying) while the lanes wait
  their prices: `LaneError` names the lane and its host, as with computing lanes."""
  monkeypatch.setenv(FAULT_VAR, 'stage1:backward:2' + (':kill' if fault == 'kill' else ''))
  lanes = LanePool(LanePlacement.spread(['stage0', 'stage1']), address=head.address, verbose=False)
  pids = list(lanes.pids().values())
  model = CostModel(dict(COSTS))
  expected = 'injected fault' if fault == 'raise' else 'its process died'
  with pytest.raises(LaneError, match=rf"lane 'stage1' on host \S+: .*{expected}"):
    train(sequential_roles(2), ProcessExecutor(pool=lanes, emulate=model))
  lanes.close()
  assert gone(pids) == []


def test_a_lane_killed_during_a_long_wait_ends_the_run_within_5s(head):
  """A task priced at a minute: the lane sleeps, and its death is still heard at once."""
  executor = ProcessExecutor(
    LanePlacement.spread(['stage0', 'stage1']),
    address=head.address,
    verbose=False,
    emulate=CostModel({'forward': 60.0, 'backward': 60.0, 'update': 60.0}),
  )
  killed = {}

  def kill_when_started():
    while executor.pool is None or not getattr(executor, '_pending', None):
      time.sleep(0.05)
    killed['pids'] = list(executor.pool.pids().values())
    time.sleep(0.5)
    killed['at'] = time.monotonic()
    os.kill(executor.pool.pids()['stage0'], signal.SIGKILL)

  threading.Thread(target=kill_when_started, daemon=True).start()
  with pytest.raises(LaneError, match=r"lane 'stage0' on host .*process died"):
    train(sequential_roles(2), executor)
  assert time.monotonic() - killed['at'] < 5
  assert gone(killed['pids']) == []


# --- a config on emulated lanes ------------------------------------------------------------------
def test_a_config_run_waits_its_cost_compute_and_records_its_prices(
  head, data_dir, tmp_path, capsys
):
  """`--config.executor=emulated` end to end: DDG K=2 with `cost.compute`; its summary
  names the clock and the prices, every task lasted at least its price, and its lane
  processes are ended when the run is over."""
  import json

  from experiments.configs import ddg as ddg_config
  from jaxsgd import training

  config = ddg_config.get_config('smoke')
  config.update(
    data_dir=data_dir,
    clock='real',
    executor='emulated',
    cluster_address=head.address,
    stages=2,
    train_steps=4,
    eval_every=4,
  )
  config.cost.calibrate = False
  config.cost.compute = dict(COSTS)
  config.placement.lanes = 'stage0; stage1'  # not pinned: an emulated lane only waits
  before = set(_lane_processes(head))
  summary = training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  assert '  stage0: host=' in capsys.readouterr().out  # the placement, at start
  assert summary['clock'] == 'real (emulated tasks)'
  assert summary['cost_model_ms'] == {
    f'stage {k} {kind}': 1e3 * seconds for kind, seconds in COSTS.items() for k in (0, 1)
  }
  with open(tmp_path / 'run' / 'trace.json') as f:
    events = [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']
  computed = [e for e in events if e['cat'] in COSTS]
  assert {(e['cat'], e['args']['stage']) for e in computed} == {
    (k, s) for k in COSTS for s in (0, 1)
  }
  assert all(e['dur'] >= 1e6 * COSTS[e['cat']] - 1 for e in computed)  # (µs, rounded)
  assert gone(set(_lane_processes(head)) - before) == []


def _config(name: str, **fields):
  import importlib

  module = 'default' if name == 'bp' else name
  config = importlib.import_module(f'experiments.configs.{module}').get_config('smoke')
  config.update({'clock': 'real', 'executor': 'emulated', **fields})
  if name in ('ddg', 'local'):
    config.stages = 2
  return config


def test_bad_input_is_refused_in_one_line_before_anything_compiles(head):
  from jaxsgd import algorithms

  model = mlp()
  refused = [
    ('ddg', _config('ddg', clock='virtual'), r"^executor: 'emulated' runs lane processes"),
    ('ssgd', _config('ssgd'), r"^executor: 'emulated' runs the scheduler families"),
  ]
  config = _config('ddg')
  config.cost.calibrate = False  # priced from cost.compute, which lacks the forward
  refused.append(('ddg', config, r'^cost.compute.forward: missing'))
  config = _config('local')
  config.algorithm.agreement_every = 5
  refused.append(('local', config, r"^algorithm.agreement_every: .* not 'emulated'"))
  config = _config('ddg')
  config.placement.devices = (0,)
  refused.append(('ddg', config, r"^placement.devices: .* with executor='emulated'"))
  config = _config('ddg', executor='processes')  # a core this host lacks: not unpinned
  config.placement.lanes = 'stage0@cores=0; stage1@cores=4096'
  refused.append(('ddg', config, r"^placement.lanes: lane 'stage1': core 4096 is not one of"))
  for name, config, message in refused:
    with pytest.raises(ValueError, match=message) as error:
      algorithms.get(name).validate(config, model)
    assert '\n' not in str(error.value), name
  # What goes with lane processes goes with emulated ones.
  config = _config('asgd', tolerate_lost_workers=True, cluster_address=head.address)
  shared = algorithms.get('asgd').validate(config, model).shared
  assert (shared.emulated, shared.on_lane_processes, shared.lane_processes) == (True,) * 3
  assert shared.tolerate_lost_workers and shared.cluster_address == head.address
