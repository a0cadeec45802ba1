"""The real clock across processes (`scheduler/process.py`): the same policies give the
same bits as in one process and on the virtual clock; faults end the run, naming the lane.

The lanes join a Ray head started with `ray start --head` (`tests/lanes/ray_head.py`),
by address: the code path of a run over several hosts. Every test that starts lanes
checks that none of their processes is left.
"""

import collections
import logging
import math
import os
import re
import socket
import sys
import time
import types

import chex
import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
import lane_tasks  # noqa: E402
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone, spy_pools  # noqa: E402

from jaxsgd import optimizers  # noqa: E402
from jaxsgd.algorithms import ddg, local  # noqa: E402
from jaxsgd.algorithms.settings import shared_settings  # noqa: E402
from jaxsgd.asynchronous import common, server  # noqa: E402
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles  # noqa: E402
from jaxsgd.scheduler import Cluster, Compute, Placement, Process, RealExecutor  # noqa: E402
from jaxsgd.scheduler.core import Get, Put, Ready, Send  # noqa: E402
from jaxsgd.scheduler import VirtualExecutor  # noqa: E402
from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool  # noqa: E402
from jaxsgd.scheduler.lanes import pool as pool_module  # noqa: E402
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR  # noqa: E402
from jaxsgd.scheduler.process import ProcessExecutor, lane_name  # noqa: E402
from jaxsgd.scheduler.tasks import Task, TaskRecipe  # noqa: E402
from scheduler_helpers import BATCH, make_pipeline, UNIT_COSTS, batches, mlp  # noqa: E402

OPTIMIZER = optimizers.OptimizerSettings('adam', 1e-2)
STEPS = 6
PROBES = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.5)


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.fixture(scope='module')
def pool(head):
  names = ['stage0', 'stage1', 'server', 'worker0', 'worker1']
  with LanePool(LanePlacement.spread(names), address=head.address) as lanes:
    yield lanes
  assert gone(lanes.pids().values()) == []


def train(roles, executor, timelines: list | None = None):
  """`STEPS` iterations of `roles` (MLP, Adam): final variables, losses, staleness (and
  the run's timeline appended to `timelines`, if given)."""
  tx = optimizers.make_optimizer(OPTIMIZER, STEPS)
  stages = make_pipeline(mlp(), roles, tx, optimizer=(OPTIMIZER, STEPS))
  feed = BatchFeed(batches(0), 1 + sum(r.loss != 'none' for r in roles))
  losses = []
  session = stages.session(
    roles,
    feed,
    STEPS,
    on_step=lambda t, loss: losses.append(executor.deferred(loss)),
    host_batches=isinstance(executor, ProcessExecutor),  # as the training path does
  )
  session.fetch = executor.fetch
  try:
    timeline = executor.run(session.cluster, session.processes())
    if timelines is not None:
      timelines.append(timeline)
    variables = session.variables()
    losses.append(session.metrics())  # local losses of aux stages, fetched from the lanes
    losses = [np.asarray(loss) for loss in losses[:-1]] + losses[-1:]
  finally:
    executor.close()
  return variables, losses, [store.staleness().tolist() for store in session.stores]


def test_a_pipelines_lanes_are_sent_their_stage_tasks_before_its_first_task(pool, monkeypatch):
  """Every stage's tasks go to its lane as the run begins (`Cluster.declare_tasks`,
  `LanePool.prepare`), so that the lanes build them at once: at its first call, a stage
  built its tasks only once the stage before it had run its own first call."""
  from jaxsgd.pipeline.session import STAGE_TASKS

  sent = []
  prepare, start = pool.prepare, pool.start
  monkeypatch.setattr(
    pool,
    'prepare',
    lambda lane, tasks: sent.append((lane, tuple(t.name for t in tasks))) or prepare(lane, tasks),
  )
  monkeypatch.setattr(
    pool,
    'start',
    lambda lane, task, *args, **kw: sent.append(lane) or start(lane, task, *args, **kw),
  )
  train(ddg.roles(2), ProcessExecutor(pool=pool))
  assert sent[:3] == [('stage0', STAGE_TASKS), ('stage1', STAGE_TASKS), 'stage0']


def agreement(roles, executor, every: int = 2):
  """The gradient-agreement probe's measurements (`PipelineSession(agreement_every=...)`)
  over `STEPS` iterations of `roles`: (batches measured, cosine per block)."""
  tx = optimizers.make_optimizer(OPTIMIZER, STEPS)
  stages = make_pipeline(mlp(), roles, tx, optimizer=(OPTIMIZER, STEPS))
  feed = BatchFeed(batches(0), 1 + sum(r.loss != 'none' for r in roles))
  session = stages.session(
    roles,
    feed,
    STEPS,
    agreement_every=every,
    host_batches=isinstance(executor, ProcessExecutor),
  )
  session.fetch = executor.fetch
  try:
    executor.run(session.cluster, session.processes())
  finally:
    executor.close()
  return session.agreement.series()


def test_the_gradient_agreement_probe_on_lane_processes_measures_the_in_process_cosines(pool):
  """The probe reads each stage's weights at its forward of a measured batch: on lane
  processes they are fetched from the stage's lane, and the cosines measured in the
  driver are the in-process run's, bit for bit."""
  roles = local.roles(2, 'overlapping')
  steps, cosines = agreement(roles, ProcessExecutor(pool=pool))
  in_process = agreement(roles, RealExecutor())
  assert steps.tolist() == list(range(0, STEPS, 2)) and cosines.shape == (len(steps), 2)
  np.testing.assert_array_equal(steps, in_process[0])
  np.testing.assert_array_equal(cosines, in_process[1])
  assert np.isfinite(cosines).all()
  assert (cosines[:, 0] < 1 - 1e-4).all()  # block 0's local gradient is not backprop's
  np.testing.assert_allclose(cosines[:, 1], 1, atol=1e-6)  # block 1's is: the model's loss


@pytest.mark.parametrize(
  'roles',
  [
    sequential_roles(2),
    ddg.roles(2),
    ddg.roles(2, 'recompute'),
    local.roles(2),  # pipelined
    local.roles(2, pipelined=False),  # lock-step
    local.roles(2, 'overlapping'),
  ],
  ids=['bp', 'ddg', 'ddg-recompute', 'local', 'local-lockstep', 'local-overlapping'],
)
def test_pipelines_on_lane_processes_are_bit_identical_to_both_in_process_clocks(
  pool, roles, monkeypatch
):
  virtual = train(roles, VirtualExecutor(UNIT_COSTS))
  real = train(roles, RealExecutor())
  sent = []  # the driver's arrays sent to the lanes as call arguments: (type, shape, dtype)
  host_array = pool._host_array
  dtype = lambda leaf: leaf.dtype if hasattr(leaf, 'dtype') else np.result_type(leaf)  # noqa: E731
  monkeypatch.setattr(
    pool,
    '_host_array',
    lambda leaf: sent.append((type(leaf), np.shape(leaf), dtype(leaf))) or host_array(leaf),
  )
  processes = train(roles, ProcessExecutor(pool=pool))
  waiting = train(roles, ProcessExecutor(pool=pool, run_ahead=False))
  # Batches go as the feed's numpy: none was placed on the driver's device and copied
  # back out of it to be sent (the driver's arrays sent are the initial weights).
  batch = next(batches(0))
  shapes = {(np.shape(x), x.dtype) for x in batch.values()}
  sent_batches = [kind for kind, *shape in sent if tuple(shape) in shapes]
  assert len(sent_batches) >= 2 * 2 * STEPS  # images and labels, of both runs
  assert set(sent_batches) == {np.ndarray}
  for other in (real, processes, waiting):
    chex.assert_trees_all_equal(other[0], virtual[0])
    chex.assert_trees_all_equal(other[1], virtual[1])
    assert other[2] == virtual[2]
  assert pool.held('stage0') == pool.held('stage1') == 0  # nothing left in the lanes


def test_copies_placed_by_the_runs_load_move_mid_run_and_change_no_bit(pool, monkeypatch):
  """`copies='auto'`: the executor measures each lane's tasks' and copy threads' CPU over
  a window of the run and moves copy threads while the lanes compute, and pins the
  driver by the same load; the run is the one of copies on their own cores, bit for
  bit, and the driver is on its own cores again once it ends. (The rules are
  `copies_toward_idle`'s and `driver_toward_idle`'s, tested by hand; here they are told
  to move stage 1's copies and the driver, to see both happen in a live run.)"""
  from jaxsgd.scheduler import copy_load

  monkeypatch.setattr(copy_load, 'WARM_TASKS', 2)  # (a run of 6 steps: 18 tasks a stage)
  monkeypatch.setattr(copy_load, 'WINDOW_TASKS', 6)
  monkeypatch.setattr(copy_load, 'WINDOW_SECONDS', 0.0)
  measured, placed = [], []
  monkeypatch.setattr(
    copy_load, 'copies_toward_idle', lambda loads, cores: measured.append(loads) or {'stage1': (0,)}
  )
  driver_cores, core = os.sched_getaffinity(0), min(os.sched_getaffinity(0))
  asked = []  # the loads the driver's placement was given
  monkeypatch.setattr(copy_load, 'driver_toward_idle', lambda *a: asked.append(a) or (core,))
  pinned = []  # the driver's cores as the run ended
  put_driver_back = copy_load.CopiesByLoad.put_driver_back
  monkeypatch.setattr(
    copy_load.CopiesByLoad,
    'put_driver_back',
    lambda self: pinned.append(os.sched_getaffinity(0)) or put_driver_back(self),
  )
  place = pool.place_copies
  monkeypatch.setattr(pool, 'place_copies', lambda *a: placed.append((a, place(*a))))
  own = train(ddg.roles(2), ProcessExecutor(pool=pool))
  executor, timelines = ProcessExecutor(pool=pool, copies='auto'), []
  at_end = []  # the moves made when the run ended (`put_back`)
  put_back = copy_load.CopiesByLoad.put_back
  monkeypatch.setattr(
    copy_load.CopiesByLoad, 'put_back', lambda self: at_end.append(len(placed)) or put_back(self)
  )
  try:
    auto = train(ddg.roles(2), executor, timelines)
  finally:
    place('stage1', None)
  # Moved once, to core 0, while the run ran; put back on its own core (1) at its end,
  # since the pool goes on.
  assert placed == [(('stage1', (0,)), (0,)), (('stage1', None), (1,))] and at_end == [1]
  [loads] = measured
  assert set(loads) == {'stage0', 'stage1'} and all(tasks > 0 for tasks, _ in loads.values())
  assert executor.copies_by_load.moved == {'stage1': (0,)}
  # The driver: given this host's lanes' loads and the copies moved, pinned until the end.
  [(lanes, _, moved, driver, allowed)] = asked
  assert set(lanes) == {'stage0', 'stage1'} and moved == {'stage1': (0,)} and driver > 0
  assert set(allowed) == driver_cores and executor.copies_by_load.driver_cores == (core,)
  assert pinned == [{core}] and os.sched_getaffinity(0) == driver_cores
  [timeline] = timelines  # tasks began after the move: the run went on with them moved
  assert executor.copies_by_load.placed_at < max(record.start for record in timeline.records)
  for got, want in zip(auto, own):
    chex.assert_trees_all_equal(got, want)


def test_the_driver_placed_by_load_is_put_back_when_the_run_fails(head, monkeypatch):
  """A run that raises after the driver was pinned (`copies='auto'`; the rule told to pin
  it) leaves the driver on the cores it had: what runs next is not the run's. (A pool of
  its own: the failed run's tasks stay in its pool's count of unfinished ones.)"""
  from jaxsgd.scheduler import copy_load

  monkeypatch.setattr(copy_load, 'WARM_TASKS', 2)
  monkeypatch.setattr(copy_load, 'WINDOW_TASKS', 6)
  monkeypatch.setattr(copy_load, 'WINDOW_SECONDS', 0.0)
  monkeypatch.setattr(copy_load, 'copies_toward_idle', lambda loads, cores: {})
  before = os.sched_getaffinity(0)
  if len(before) < 2:
    pytest.skip('pinned to one core of one, the driver would look put back either way')
  core = min(before)
  monkeypatch.setattr(copy_load, 'driver_toward_idle', lambda *args: (core,))
  placement = LanePlacement.spread(['stage0', 'stage1'])
  own_pool = LanePool(placement, address=head.address, verbose=False)
  executor, pinned = ProcessExecutor(pool=own_pool, copies='auto'), []
  finished = executor.task_finished

  def fail_once_pinned(process, value):
    if executor.copies_by_load.driver_cores is not None:
      pinned.append(os.sched_getaffinity(0))
      raise RuntimeError('the policy failed')
    finished(process, value)

  monkeypatch.setattr(executor, 'task_finished', fail_once_pinned)
  with own_pool, pytest.raises(RuntimeError, match='the policy failed'):
    train(ddg.roles(2), executor)
  assert pinned == [{core}] and os.sched_getaffinity(0) == before


@pytest.mark.parametrize(
  'roles, gradients_back',
  [(ddg.roles(2), True), (ddg.roles(2, 'recompute'), True), (local.roles(2), False)],
  ids=['ddg', 'ddg-recompute', 'local'],
)
def test_pipelines_moving_values_on_the_device_path_are_bit_identical_to_the_virtual_clock(
  head, roles, gradients_back
):
  """The device path (lanes/device_path.py; CPU lanes with `moves=device` here): the
  activations, gradients and VJPs cross as device buffers, and the run's bits are the
  virtual clock's."""

  virtual = train(roles, VirtualExecutor(UNIT_COSTS))
  placement = LanePlacement.parse('stage0@moves=device; stage1@moves=device')
  with LanePool(placement, address=head.address, verbose=False) as device_pool:
    on_device_path = train(roles, ProcessExecutor(pool=device_pool))
    pulled = {lane: device_pool.lane_info(lane)['pulled'] for lane in device_pool.placement.names}
  assert gone(device_pool.pids().values()) == []
  chex.assert_trees_all_equal(on_device_path[0], virtual[0])
  chex.assert_trees_all_equal(on_device_path[1], virtual[1])
  assert on_device_path[2] == virtual[2]
  assert pulled['stage1'] >= STEPS  # the activations
  # the gradients: every batch's but the last one's (local parallelism sends none back)
  assert pulled['stage0'] >= STEPS - 1 if gradients_back else pulled['stage0'] == 0


@pytest.mark.parametrize('run_ahead', [0, 1, 2, 3])
def test_running_ahead_leaves_at_most_run_ahead_tasks_waiting_on_a_lane(
  pool, monkeypatch, run_ahead
):
  """Unbounded, the driver queued a whole run's tasks on the lanes at once, and no lane
  freed a value until the run ended (a DDG K=2 lane reached 3 GB in 300 steps)."""
  most = {}
  start = pool.start

  def start_and_count(lane, task, args=(), **options):
    pending = start(lane, task, args, **options)
    most[lane] = max(most.get(lane, 0), pool.unfinished(lane))
    held.append(pending.held)
    return pending

  held = []  # whether each task's end may be held by its lane (its process went on)

  monkeypatch.setattr(pool, 'start', start_and_count)
  executor = ProcessExecutor(pool=pool, run_ahead=run_ahead)
  got = train(ddg.roles(2), executor)
  monkeypatch.undo()
  # Each process of a lane that did not run ahead waits for its own task, dispatched at
  # once where the bound is below 2; from 2 on it waits for room before its dispatch.
  processes = collections.Counter(
    lane_name(executor.cluster.lanes[p.lane].name) for p in executor.processes
  )
  assert set(most) == {'stage0', 'stage1'}
  for lane, unfinished in most.items():
    assert unfinished <= run_ahead + (processes[lane] if run_ahead < 2 else 0)
  assert any(held) == (run_ahead > 0)  # never where every task is waited for
  want = train(ddg.roles(2), VirtualExecutor(UNIT_COSTS))
  chex.assert_trees_all_equal(got[0], want[0])
  chex.assert_trees_all_equal(got[1], want[1])


def test_room_on_a_lane_is_counted_from_the_executors_own_tasks(pool, monkeypatch):
  """A task dropped with a lost lane whose value it read can stay in the pool's count of
  its own lane's unfinished tasks; read from there, the room a process waits for never
  came (a lost replica's LPP-SGD run waited for ever). With the pool's count stuck high,
  DDG K=2 still runs to the end, running ahead (its ends held by the lanes), to the
  virtual clock's values."""
  monkeypatch.setattr(pool, 'unfinished', lambda lane: 99)
  held = []
  start = pool.start

  def start_and_note(lane, task, args=(), **options):
    pending = start(lane, task, args, **options)
    held.append(pending.held)
    return pending

  monkeypatch.setattr(pool, 'start', start_and_note)
  got = train(ddg.roles(2), ProcessExecutor(pool=pool, run_ahead=2))
  monkeypatch.undo()
  assert any(held)
  want = train(ddg.roles(2), VirtualExecutor(UNIT_COSTS))
  chex.assert_trees_all_equal(got[0], want[0])
  chex.assert_trees_all_equal(got[1], want[1])


def test_the_outputs_name_each_lane_by_the_device_its_process_ran_on(pool, monkeypatch):
  """A GPU lane's rows were `stage 0 (cpu:0)` in `trace.json` and `utilization`: the
  driver's stand-in device (seen on the lent H200 machine, `stage0@gpu=1`)."""
  monkeypatch.setitem(pool.info, 'stage0', {**pool.info['stage0'], 'device': 'cuda:0'})
  timelines = []
  train(ddg.roles(2), ProcessExecutor(pool=pool), timelines)
  host, device = pool.info['stage1']['host'], pool.info['stage1']['device']
  first, second = f'stage 0 (stage0: cuda:0 on {host})', f'stage 1 (stage1: {device} on {host})'
  assert set(timelines[0].utilization()) == {
    first,
    second,
    f'link {first} → {second}',
    f'link {second} → {first}',
  }


def test_stage_functions_are_named_tasks_in_process_too():
  stages = PlacedStages(
    mlp(),
    2,
    optimizers.make_optimizer(OPTIMIZER, STEPS),
    placement=Placement.create(2, jax.devices()[:2]),
    batch_size=BATCH,
    optimizer=(OPTIMIZER, STEPS),
  )
  ops = stages.ops(0, ddg.roles(2)[0])
  assert isinstance(ops.forward, Task) and isinstance(ops.update, Task)
  # Roles that differ only in their delay share one recipe (one compilation).
  assert stages.ops(1, ddg.roles(2)[1]).forward.recipe == (
    stages.ops(1, sequential_roles(2)[1]).forward.recipe
  )


def _probe(name, *args):
  """A process on its lane that runs probe task `name` and then stops."""
  yield Compute(Task(PROBES, name), args)


def _cluster(*names):
  cluster = Cluster()
  for name in names:
    cluster.add_lane(name)
  return cluster


def test_a_task_that_raises_names_lane_and_host(pool):
  cluster = _cluster('stage 0 (cpu)', 'stage 1 (cpu)')
  processes = [
    Process('stage 0', 0, _probe('hang', 0.2)),
    Process('stage 1', 1, _probe('fail', np.zeros((3, 8), np.float32))),
  ]
  host = pool.info['stage1']['host']
  with pytest.raises(LaneError, match=rf"lane 'stage1' on host {host}: .*bad input of shape"):
    ProcessExecutor(pool=pool).run(cluster, processes)
  assert all(p.done for p in processes)  # every process closed


def test_a_failed_task_is_named_though_its_error_comes_after_a_lane_that_took_in_its_value(
  pool,
):
  """Stage 0's second task raises an error that takes 3 s to reach the driver; running
  ahead, its value was already sent to stage 1, whose task fails at once taking it in.
  The run names stage 0's task, not stage 1's (it named stage 1's when the driver waited
  only 2 s for the task that was to make a value, as an ASGD worker's injected fault was
  once blamed on the server that took in its push)."""
  from jaxsgd.scheduler.core import Send

  cluster = _cluster('stage 0', 'stage 1')
  inbox = cluster.channel('inbox', 1)

  def producer():
    for value in (0.0, 1.0):  # the second call's handles are known: it runs ahead
      made = yield Compute(Task(PROBES, 'fail_if_positive'), (np.full((2,), value, np.float32),))
      yield Send(inbox, made)

  def consumer():
    for _ in range(2):
      got = yield Get(inbox)
      yield Compute(Task(PROBES, 'add'), (got, got))

  processes = [Process('stage 0', 0, producer()), Process('stage 1', 1, consumer())]
  host = pool.info['stage0']['host']
  with pytest.raises(
    LaneError, match=rf"lane 'stage0' on host {host}: Task\('fail_if_positive'.*SlowToReport"
  ):
    ProcessExecutor(pool=pool, run_ahead=4).run(cluster, processes)


def test_a_finished_task_is_heard_while_other_processes_keep_each_other_ready(pool):
  """Two processes passing a number back and forth are always ready; they stop once a
  third's task on a lane has finished, which the executor must hear meanwhile. (Once all
  of PD-ASGD's steps were claimed, its workers passed tokens so, forever, while the update
  that would end the run waited unheard for its lane.) Without run-ahead the third waits
  for its task whatever ran before on that lane."""
  cluster = _cluster('stage 0', 'stage 1')
  ping, pong = cluster.channel('ping', 1), cluster.channel('pong', 1)
  finished, started = [], time.monotonic()

  def waiter():
    yield Compute(Task(PROBES, 'hang'), (0.05,))
    finished.append(time.monotonic() - started)

  def passer(mine, other, first: bool):
    if first:
      yield Put(other, 0)
    while not finished:
      assert time.monotonic() - started < 60, 'the finished task was never heard'
      n = yield Get(mine)
      yield Put(other, n + 1)

  processes = [
    Process('stage 0', 0, waiter()),
    Process('ping', 1, passer(ping, pong, True)),
    Process('pong', 1, passer(pong, ping, False)),
  ]
  ProcessExecutor(pool=pool, run_ahead=False).run(cluster, processes)
  assert finished and all(p.done for p in processes)


def test_the_summary_gives_the_drivers_cpu_per_task_of_a_process_executor_only():
  """`clocks.executor_summary`: 0.5 s of the driver's CPU over 200 tasks is 2.5 ms a
  task; with a steady state counted (0.3 s over 150 tasks: 2 ms), that; an executor
  that counts none (in-process clocks) adds nothing. Copies and the driver placed by
  load: each lane's load, the moves, the driver's load and cores."""
  from jaxsgd.algorithms import clocks

  ran = ProcessExecutor()  # (starts nothing until it runs)
  ran.run_cpu_seconds, ran.dispatched = 0.5, 200
  assert clocks.executor_summary(ran) == {'driver_cpu_ms_per_task': 2.5}
  ran.steady_cpu_seconds, ran.steady_dispatched = 0.3, 150
  assert clocks.executor_summary(ran) == {'driver_cpu_ms_per_task': 2.0}
  assert clocks.executor_summary(types.SimpleNamespace()) == {}
  # `copies='auto'`: what it measured, moved and pinned, in % of a core.
  ran.copies_by_load = types.SimpleNamespace(
    loads={'stage0': (0.5, 0.125), 'stage1': (0.75, 0.0625)},
    moved={'stage1': (0,)},
    driver_load=0.0625,
    driver_cores=None,
  )
  assert clocks.executor_summary(ran)['copies_by_load'] == {
    'load_percent': {'stage0': [50.0, 12.5], 'stage1': [75.0, 6.2]},
    'moved_to_cores': {'stage1': [0]},
    'driver_load_percent': 6.2,
    'driver_pinned_to_cores': None,
  }
  ran.copies_by_load.driver_cores = (1,)
  assert clocks.executor_summary(ran)['copies_by_load']['driver_pinned_to_cores'] == [1]


def _spin(seconds: float) -> None:
  """Uses `seconds` of this process's CPU (as a policy computing in the driver would)."""
  spent = time.process_time()
  while time.process_time() - spent < seconds:
    pass


def test_the_run_cpu_counts_all_the_drivers_work_and_dispatch_only_its_calls(pool):
  """`run_cpu_seconds` is the driver's CPU over the run, whatever did it: a process that
  computes 0.3 s and then 0.2 s of CPU in the driver between its tasks is in it, and
  not in `dispatch_cpu_seconds`, the calls' own share, which it holds. With
  `steady_from_batch=1` the steady count starts at batch 1's task: the 0.2 s and the two
  tasks from there are in it, the 0.3 s before is not."""
  cluster = _cluster('stage 0')

  def busy_between():
    x = yield Compute(Task(PROBES, 'add'), (1.0, 2.0), batch=0)
    _spin(0.3)
    x = yield Compute(Task(PROBES, 'add'), (x, x), batch=1)
    _spin(0.2)
    yield Compute(Task(PROBES, 'add'), (x, x), batch=2)

  executor = ProcessExecutor(pool=pool, steady_from_batch=1)
  executor.run(cluster, [Process('stage 0', 0, busy_between())])
  assert executor.dispatched == 3
  assert executor.run_cpu_seconds >= 0.5 + executor.dispatch_cpu_seconds
  assert 0 < executor.dispatch_cpu_seconds < 0.2
  assert executor.steady_dispatched == 2
  assert 0.2 <= executor.steady_cpu_seconds <= executor.run_cpu_seconds - 0.3


def test_a_task_marked_not_ahead_is_waited_for_before_its_process_goes_on(pool):
  """Running ahead, a process goes on with its task's handles while the lane computes;
  `Compute(ahead=False)` (LPP-SGD's mean) makes it wait for the task to end."""
  cluster = _cluster('stage 0')
  waited = {}

  def worker(ahead: bool):
    for _ in range(2):  # the second call has known handles: it could run ahead
      started = time.monotonic()
      yield Compute(Task(PROBES, 'hang'), (0.2,), ahead=ahead)
      waited.setdefault(ahead, []).append(time.monotonic() - started)

  runs = {}
  for ahead in (True, False):
    runs[ahead] = ProcessExecutor(pool=pool, run_ahead=4).run(
      cluster, [Process('stage 0', 0, worker(ahead))]
    )
  assert waited[False][1] >= 0.2  # the process went on only once the 0.2 s task ended
  assert waited[True][1] < 0.1  # it went on at once with the task's handles
  # Each record says when the driver heard of the task's end (`TaskRecord.heard`), after
  # it; a task waited for was heard of before the next one could start.
  first, second = runs[False].records
  assert first.end <= first.heard <= second.start <= second.end <= second.heard
  assert all(r.end <= r.heard for r in runs[True].records)
  # And when the driver dispatched it (`TaskRecord.dispatched`): before it started; a task
  # waited for, only once the one before had been heard of.
  assert first.dispatched <= first.start and first.heard <= second.dispatched <= second.start
  assert all(r.dispatched <= r.start for r in runs[True].records)
  # And the CPU its lane's process used meanwhile (`TaskRecord.cpu`, in the trace too): a
  # task that sleeps 0.2 s uses next to none (one that computes: `Pending.cpu`'s test).
  assert all(0 <= r.cpu < 0.1 for r in runs[False].records)
  slices = [e for e in runs[False].chrome_trace()['traceEvents'] if e.get('ph') == 'X']
  assert [e['args']['cpu'] for e in slices] == [r.cpu * 1e6 for r in runs[False].records]


def test_ready_goes_on_once_the_task_that_made_its_value_has_finished(pool):
  """Running ahead, a process holds its task's handles while the lane computes; `Ready`
  makes it go on only once that task has finished (PD-ASGD's layer updates are
  dispatched so, once their gradients exist), while another process goes on meanwhile.
  A value already made is ready at once."""
  cluster = _cluster('stage 0', 'stage 1')
  executor = ProcessExecutor(pool=pool, run_ahead=4)
  resumed, other = [], []

  def worker():
    for _ in range(2):  # the second call's handles are known: it runs ahead
      made = yield Compute(Task(PROBES, 'hang'), (0.2,))
      yield Ready((made, None))
      resumed.append(executor.now())
    yield Ready(made)
    resumed.append(executor.now())

  def meanwhile():
    for _ in range(3):
      yield Compute(Task(PROBES, 'hang'), (0.01,), ahead=False)
      other.append(executor.now())

  timeline = executor.run(
    cluster, [Process('stage 0', 0, worker()), Process('stage 1', 1, meanwhile())]
  )
  first, second = [r for r in timeline.records if r.lane == 0]
  assert first.heard <= resumed[0] and second.end <= second.heard <= resumed[1]
  assert resumed[2] - resumed[1] < 0.1  # made already: at once
  assert other[-1] < second.end  # the other process was not held up


@pytest.mark.parametrize('asks', [True, False])
def test_a_ready_gets_the_end_of_a_task_queued_behind_by_asking_its_lane(pool, monkeypatch, asks):
  """A task run ahead whose lane has two calls queued behind it has its end held by the
  lane until a later reply; a `Ready` on its result asks the lane for it
  (`LanePool.hasten`): the other process goes on once the first 0.2 s task has ended, not
  only after the 0.5 s task queued behind it (without the request, `asks=False`: after
  it, when that task's end, with one call behind it, is sent)."""
  if not asks:
    monkeypatch.setattr(pool, 'hasten', lambda pending: None)
  cluster = _cluster('stage 0', 'stage 1')
  inbox = cluster.channel('inbox', 1)
  executor = ProcessExecutor(pool=pool, run_ahead=4)
  resumed = []
  hang = Task(PROBES, 'hang')

  def producer():  # (seconds as arrays: a Python float is part of a call's signature)
    yield Compute(hang, (np.float64(0.0),), ahead=False)  # (its outline known after)
    made = yield Compute(hang, (np.float64(0.2),))
    yield Put(inbox, made)  # (the handle as it is, on stage 0)
    yield Compute(hang, (np.float64(0.5),))  # queued behind it
    yield Compute(hang, (np.float64(0.5),))  # and another

  def consumer():
    made = yield Get(inbox)
    yield Ready(made)
    resumed.append(executor.now())

  timeline = executor.run(
    cluster, [Process('stage 0', 0, producer()), Process('stage 1', 1, consumer())]
  )
  _, first, behind, _ = [r for r in timeline.records if r.lane == 0]
  if asks:
    assert first.end <= resumed[0] < behind.end
  else:
    assert resumed[0] >= behind.end


def test_a_copy_is_recorded_as_the_lanes_made_it_not_as_the_driver_sent_it(pool):
  """Running ahead, stage 0's process sends each 0.2 s task's result before the task has
  ended (its handles are known from the first call). Each copy's record starts when its
  value existed on stage 0 (at or after its task's end) and ends when the export was
  done; stage 1's task on the copy starts after it. (The record was the driver's sending
  of it: 0.2 s before the value existed.)"""
  from jaxsgd.scheduler.core import Send

  cluster = _cluster('stage 0', 'stage 1')
  inbox = cluster.channel('inbox', 1)

  def producer():
    for _ in range(3):
      made = yield Compute(Task(PROBES, 'hang'), (0.2,), kind='forward')
      yield Send(inbox, made)

  def consumer():
    for _ in range(3):
      got = yield Get(inbox)
      yield Compute(Task(PROBES, 'add'), (got, got), kind='backward')

  timeline = ProcessExecutor(pool=pool, run_ahead=4).run(
    cluster, [Process('stage 0', 0, producer()), Process('stage 1', 1, consumer())]
  )
  made, copies, used = (timeline.tasks(kind=k) for k in ('forward', 'transfer', 'backward'))
  assert len(made) == len(copies) == len(used) == 3
  for task, copy, use in zip(made, copies, used):
    assert task.end <= copy.start <= copy.end
    assert copy.start <= use.start


def test_a_lane_value_is_ready_only_when_its_lane_has_nothing_queued(pool):
  """The loss checks between logging points read only ready values: a fetch runs after
  every call sent to its lane before it, so a lane with a task still queued is not ready
  even for a value made before that task (reading it would wait for the task)."""
  executor = ProcessExecutor(pool=pool)
  made = pool.run('stage0', Task(PROBES, 'init'), (0,))
  queued = pool.start('stage0', Task(PROBES, 'hang'), (0.3,))
  value = executor.deferred(made)
  assert not value.is_ready()
  pool.wait_any([queued])
  assert value.is_ready() and np.asarray(value).shape == (8, 4)


def test_a_closure_is_refused_naming_the_process(pool):
  def policy():
    yield Compute(lambda: 1.0, ())

  with pytest.raises(TypeError, match='stage 0 yielded Compute.*named tasks only'):
    ProcessExecutor(pool=pool).run(_cluster('stage 0'), [Process('stage 0', 0, policy())])


def test_a_placement_without_a_lane_of_the_run_is_refused(head):
  executor = ProcessExecutor(LanePlacement.parse('stage0@cores=0'), address=head.address)
  with pytest.raises(ValueError, match='placement.lanes: no lane for worker1; this run needs'):
    executor.run(_cluster('stage 0', 'worker 1'), [])
  assert executor.pool is None  # nothing was started
  # A placed lane the run lacks would start a process that idles (a typo of a name).
  executor = ProcessExecutor(LanePlacement.parse('stage0@cores=0; stag1@cores=0'))
  with pytest.raises(ValueError) as refused:
    executor.run(_cluster('stage 0'), [])
  assert (
    str(refused.value)
    == "placement.lanes: no lane of this run is named 'stag1'; its lanes: stage0."
  )
  assert executor.pool is None
  assert lane_name('stage 0 (TFRT_CPU_0)') == 'stage0' and lane_name('worker 12') == 'worker12'


def test_a_pool_without_a_lane_of_the_run_is_refused_before_it_runs(pool):
  """A lane of the run that the given pool lacks, and that no task ran on, ended a
  finished run in a bare KeyError (naming its row); now it is refused at the start."""
  ran = []

  def policy():
    ran.append(True)
    yield Compute(Task(PROBES, 'hang'), (0.05,))

  executor = ProcessExecutor(pool=pool)
  with pytest.raises(ValueError, match=r'^placement.lanes: no lane for stage7; this run needs'):
    executor.run(_cluster('stage 0', 'stage 7'), [Process('stage 0', 0, policy())])
  assert ran == []


def test_config_executor_processes_is_checked_before_anything_starts(head):
  from experiments.configs import default

  config = default.get_config()
  config.executor = 'processes'
  config.clock = 'virtual'
  with pytest.raises(ValueError, match="executor: 'processes' runs the real clock"):
    shared_settings(config)
  config.clock = 'real'
  config.placement.lanes = 'stage0@cores=x'
  with pytest.raises(ValueError, match=r"placement.lanes: lane 'stage0': cores like"):
    shared_settings(config)
  config.placement.lanes = 'stage0@cores=0; stage1@cores=1'
  config.cluster_address = head.address
  settings = shared_settings(config)
  assert (settings.executor, settings.cluster_address) == ('processes', head.address)
  # A cluster nobody answers for: one line once cluster_timeout_s has passed, not Ray's
  # retries every 5 s for ever.
  closed = socket.create_server(('127.0.0.1', 0))
  config.cluster_address = f'127.0.0.1:{closed.getsockname()[1]}'
  closed.close()
  config.cluster_timeout_s = 1.0
  started = time.monotonic()
  with pytest.raises(
    ValueError,
    match=r'^cluster_address: nothing answers at 127.0.0.1:\d+ .*waited 1 s, cluster_timeout_s',
  ):
    shared_settings(config)
  assert time.monotonic() - started < 5
  config.executor = 'threads'
  with pytest.raises(ValueError, match='executor: .*allowed: in_process, processes'):
    shared_settings(config)


def asgd(num_workers, executor, steps=STEPS):
  """ASGD with `num_workers` workers (MLP, Adam), every function a named task."""
  stages = make_pipeline(
    mlp(),
    sequential_roles(1),
    optimizers.make_optimizer(OPTIMIZER, steps),
    optimizer=(OPTIMIZER, steps),
  )
  settings = server.ServerSettings(num_workers)
  variables = stages.initial_variables(0, sequential_roles(1)[0])
  tx = optimizers.make_optimizer(
    OPTIMIZER, steps, gradient_transforms=server.server_gradient_transforms(settings)
  )
  device = jax.devices()[0]
  ps = server.ParameterServer(
    tx,
    variables['params'],
    num_workers,
    device,
    record_pulls=False,
    apply_fn=server.named_apply(OPTIMIZER, steps, settings),
  )
  names = [f'worker {m}' for m in range(num_workers)]
  session = server.AsgdSession(
    stages,
    ps,
    {},
    [batches(seed=m) for m in range(num_workers)],
    [device] * (1 + num_workers),
    common.StepCounter(steps),
    common.WorkerLog(names, {}, executor.now),
  )
  try:
    executor.run(session.cluster, session.processes())
    params = executor.fetch(session.variables()['params'])
  finally:
    executor.close()
  return stages, params, session.server.store.staleness().tolist()


def test_asgd_one_worker_on_lane_processes_is_sequential_sgd_bit_for_bit(pool):
  stages, params, staleness = asgd(1, ProcessExecutor(pool=pool))
  ops = stages.ops(0, sequential_roles(1)[0])
  expected = stages.initial_variables(0, sequential_roles(1)[0])['params']
  opt_state = stages.tx.init(expected)
  stream = batches(seed=0)
  for _ in range(STEPS):  # sequential SGD: forward, backward, update
    batch = next(stream)
    vjp = ops.forward({'params': expected}, batch['image'], batch['label'])[3]
    grads, _ = ops.backward(vjp, None)
    expected, opt_state = ops.update(expected, opt_state, grads)
  chex.assert_trees_all_equal(params, expected)
  assert staleness == [0] * STEPS
  _, in_process, _ = asgd(1, RealExecutor(threads=True))
  chex.assert_trees_all_equal(params, in_process)


def test_a_lost_worker_whose_lane_cannot_be_replaced_is_dropped_and_the_run_goes_on(
  head, monkeypatch
):
  """`tolerate_lost=True`: worker 1's first forward raises, and no new process can
  take its place (`LanePool.replace` ended the old one, then failed to start another):
  the lane is dropped, its process closed, and the run ends with worker 0 alone. (Its
  first forward, dispatched as the run starts, always runs: a later task may never come
  where worker 0 takes every step while worker 1's lane compiles.)"""
  monkeypatch.setenv(FAULT_VAR, 'worker1:forward:1')  # (read by lanes as they start)
  placement = LanePlacement.spread(['server', 'worker0', 'worker1'])
  with LanePool(placement, address=head.address, verbose=False) as lanes:

    def replace_fails(lane):
      lanes.remove(lane)
      raise RuntimeError('no node could start it')

    monkeypatch.setattr(lanes, 'replace', replace_fails)
    executor = ProcessExecutor(pool=lanes, tolerate_lost=True)
    _, params, staleness = asgd(2, executor, steps=8)
    assert not lanes.has_process('worker1') and lanes.has_process('worker0')
  [lost] = executor.lost
  assert (lost.lane, lost.replaced_at) == ('worker1', None) and 'injected fault' in lost.reason
  assert len(staleness) == 8 and np.all(np.isfinite(jax.tree.leaves(params)[0]))
  assert gone(lanes.pids().values()) == []


def test_a_process_left_waiting_on_a_replaced_lane_stops_the_run_in_one_line(head, monkeypatch):
  """`tolerate_lost=True`: worker 1's first forward raises and its lane is replaced, but
  its `on_rejoin` says it holds nothing of the lane (None: it goes on where it is) while it
  waited for that forward, dropped with the lane: nothing would wake it. The run stops
  at once, saying so (it ended later, at the executor's deadlock check, with only
  'worker 1 waits on None')."""
  monkeypatch.setenv(FAULT_VAR, 'worker1:forward:1')  # (read by lanes as they start)
  monkeypatch.setattr(server.AsgdSession, '_rejoin', lambda self, m, worker, reason: None)
  placement = LanePlacement.spread(['server', 'worker0', 'worker1'])
  with LanePool(placement, address=head.address, verbose=False) as lanes:
    executor = ProcessExecutor(pool=lanes, tolerate_lost=True)
    with pytest.raises(
      RuntimeError, match=r'^worker 1: on_rejoin returned None .* nothing would wake it'
    ):
      asgd(2, executor, steps=8)
  assert gone(lanes.pids().values()) == []


def test_asgd_two_workers_on_lane_processes_apply_every_step(pool):
  _, params, staleness = asgd(2, ProcessExecutor(pool=pool), steps=8)
  # Real timing decides the order; every push is applied, the first at staleness 0.
  assert len(staleness) == 8 and staleness[0] == 0 and min(staleness) >= 0
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize('config_name', ['ddg', 'asgd', 'async_local_sgd'])
def test_a_config_run_on_lane_processes_matches_the_in_process_run(
  config_name, head, data_dir, tmp_path, capsys, monkeypatch
):
  """`--config.executor=processes` end to end (`cluster_address`: the multi-host path);
  the lanes are ended when the run is over.

  Each lane gets this process's cores: XLA:CPU splits some operations over the cores a
  process may use, so a lane pinned to one core computes the CNN's DDG run to other
  bits (its train loss differed in the 8th digit on a 2-core VM) than this process on
  two; the same run of this process pinned to one core gave the lanes' bits. Same
  cores, same programs, same bits."""
  import importlib

  from jaxsgd import training

  cores = ','.join(map(str, sorted(os.sched_getaffinity(0))))

  def summary(executor, **fields):
    config = importlib.import_module(f'experiments.configs.{config_name}').get_config('smoke')
    overrides = dict(
      data_dir=data_dir, clock='real', executor=executor, train_steps=20, eval_every=10
    )
    config.update(overrides)
    config.update_from_flattened_dict(fields)
    if config_name == 'ddg':
      config.stages = 2
    else:
      config.workers = 1  # one worker: a deterministic order, as in process
    workdir = str(tmp_path / executor)
    return training.train_and_evaluate(config, workdir, show_progress=False)['final']

  names = ('stage0', 'stage1') if config_name == 'ddg' else ('server', 'worker0')
  lanes = '; '.join(f'{name}@cores={cores}' for name in names)
  before = set(_lane_processes(head))
  sent = []  # the driver's arrays sent to the lanes as call arguments: (type, shape)
  host_copies = pool_module._HostCopies.__call__
  monkeypatch.setattr(
    pool_module._HostCopies,
    '__call__',
    lambda self, leaf: sent.append((type(leaf), np.shape(leaf))) or host_copies(self, leaf),
  )
  pools = spy_pools(monkeypatch)
  on_lanes = summary('processes', cluster_address=head.address, **{'placement.lanes': lanes})
  assert [pool.started_early for pool in pools] == [names]  # started as the model was built
  # The training path sends each batch's images as the feed's numpy, not placed on the
  # driver's device first.
  batch = importlib.import_module(f'experiments.configs.{config_name}').get_config('smoke')
  images = [kind for kind, shape in sent if shape == (batch.batch_size, 40, 1)]  # MNIST-1D
  assert len(images) >= 20 and set(images) == {np.ndarray}
  printed = capsys.readouterr().out
  assert all(f'  {name}: host=' in printed for name in names)  # the placement, at start
  assert gone(set(_lane_processes(head)) - before) == []
  in_process = summary('in_process')
  for key in ('train_loss', 'test_loss', 'test_accuracy'):
    assert on_lanes[key] == in_process[key], key


def test_a_run_in_which_no_lane_finishes_anything_says_what_it_waits_for(pool, caplog):
  """After `stall_report_s` seconds in which no lane finished a task, a warning names each
  lane's unfinished tasks (kind, stage, batch, when sent, for which process) with the
  lane's pid, and the processes waiting on a channel; the next comes once the quiet has
  lasted twice as long, and so on. A lane that goes on finishing tasks, each sooner than
  that, is not reported."""
  cluster = _cluster('stage 0', 'stage 1')
  inbox = cluster.channel('inbox', 1)
  hang = Task(PROBES, 'hang')

  def slow():
    # (waited for: run ahead, the process would hand the handle on at once)
    made = yield Compute(hang, (np.float64(2.5),), kind='forward', stage=0, batch=3, ahead=False)
    yield Put(inbox, made)

  def waiting():
    yield Get(inbox)

  def making(inbox):
    yield Compute(hang, (np.float64(0.0),), ahead=False)  # (its outline known after)
    made = yield Compute(hang, (np.float64(2.5),), kind='forward', stage=0, batch=3)
    yield Send(inbox, made)  # run ahead: sent while the lane still computes it

  def taking_in(inbox):
    got = yield Get(inbox)
    yield Compute(Task(PROBES, 'add'), (got, got), kind='backward', stage=1, batch=3)

  def quick():  # 2 s in all, a task every 0.25 s
    for k in range(8):
      yield Compute(hang, (np.float64(0.25),), kind='forward', stage=0, batch=k)

  with caplog.at_level(logging.WARNING):
    ProcessExecutor(pool=pool, stall_report_s=0.5).run(
      cluster, [Process('stage 0', 0, slow()), Process('stage 1', 1, waiting())]
    )
  reports = [r.getMessage() for r in caplog.records if 'no lane has finished' in r.getMessage()]
  # After 0.5 s of quiet, 1 s and 2 s (the task takes 2.5 s): each report in a doubling
  # of the bound of its own, however late it came.
  quiet = [float(re.search(r'for (\d+\.\d) s', report)[1]) for report in reports]
  doublings = [math.floor(math.log2(q / 0.5)) for q in quiet]
  assert len(quiet) >= 2 and doublings == sorted(set(doublings)) and doublings[0] >= 0, quiet
  lines = reports[0].splitlines()
  assert re.fullmatch(
    r'lanes: no lane has finished anything for \d+\.\d s; the run waits for:', lines[0]
  )
  assert lines[1] == f'  stage0 (pid {pool.pids()["stage0"]}):'
  assert lines[2].startswith('    forward of stage 0, batch 3, sent ')
  assert lines[2].endswith(' s ago, for stage 0')
  assert lines[3:] == ["  stage 1: waits on Channel('inbox', lane=1)"]

  # A task whose call takes in a value still being made on another lane names that lane.
  caplog.clear()
  cluster = _cluster('stage 0', 'stage 1')
  inbox = cluster.channel('inbox', 1)
  with caplog.at_level(logging.WARNING):
    ProcessExecutor(pool=pool, stall_report_s=1.0).run(
      cluster, [Process('stage 0', 0, making(inbox)), Process('stage 1', 1, taking_in(inbox))]
    )
  reports = [r.getMessage() for r in caplog.records if 'no lane has finished' in r.getMessage()]
  lines = reports[0].splitlines()
  assert lines[1] == f'  stage0 (pid {pool.pids()["stage0"]}):'
  assert lines[2].startswith('    forward of stage 0, batch 3, sent ')
  assert lines[3] == f'  stage1 (pid {pool.pids()["stage1"]}):'
  assert lines[4].startswith('    backward of stage 1, batch 3, sent ')
  assert lines[4].endswith(' s ago, taking in values of stage0, for stage 1')
  assert len(lines) == 5

  caplog.clear()
  with caplog.at_level(logging.WARNING):
    ProcessExecutor(pool=pool, stall_report_s=1.0).run(
      _cluster('stage 0'), [Process('stage 0', 0, quick())]
    )
  assert not [r for r in caplog.records if 'no lane has finished' in r.getMessage()]

  for bad in (0, -1.0, float('nan')):  # (each would have the driver spin)
    with pytest.raises(ValueError, match='stall_report_s: a positive number of seconds'):
      ProcessExecutor(pool=pool, stall_report_s=bad)
