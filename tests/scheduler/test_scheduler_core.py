"""The executor, stores and cost model on toy policies (no model needed)."""

import collections
import json
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsgd.scheduler import Cluster, Compute, CostModel, DeadlockError, Get, Process, Put
from jaxsgd.scheduler import RealExecutor, Send, VersionedStore, VirtualExecutor
from jaxsgd.algorithms import settings as settings_lib
from jaxsgd.scheduler import real, transfer
from jaxsgd.scheduler.executor import Executor
from jaxsgd.scheduler.real import ThreadedExecutor
from jaxsgd.scheduler.timeline import TaskRecord, Timeline
from scheduler_helpers import run_with_timeout

EXECUTORS = {
  'virtual': lambda: VirtualExecutor(CostModel({'work': 1.0, 'gradient': 1.0, 'update': 0.01})),
  'real': RealExecutor,
  'threads': lambda: RealExecutor(threads=True),
}


# --- stores -------------------------------------------------------------------------------------
def test_store_counts_writes_between_read_and_update():
  store = VersionedStore('w', 0)
  first, second = store.read(), store.read()
  store.write(1, read_version=first.version)  # nobody wrote in between
  store.write(2)  # a state write: recorded nowhere
  record = store.write(3, read_version=second.version)  # two writes since its read
  assert (first.version, store.version) == (0, 3)
  assert [u.staleness for u in store.updates] == [0, 2]
  assert (record.read_version, record.version) == (0, 3)
  assert store.read() == (3, 3)
  with pytest.raises(ValueError, match='read_version 7'):
    store.write(4, read_version=7)


# --- the virtual clock on hand-computed cases ------------------------------------------------
def _producer(out, n):
  for i in range(n):
    value = yield Compute(
      lambda i=i: jnp.full((250,), i, jnp.float32), kind='work', stage=0, batch=i
    )
    yield Send(out, value, batch=i)


def _consumer(inbox, n, seen):
  for i in range(n):
    value = yield Get(inbox)
    seen.append((yield Compute(lambda v=value: v * 2, kind='work', stage=1, batch=i)))


def test_virtual_clock_gives_the_hand_computed_schedule_with_link_costs():
  # Producer tasks take 1 s, consumer tasks 2 s; each 1000-byte message takes
  # 0.5 s latency + 1000 B / 4000 B/s = 0.75 s on the link.
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox, seen = cluster.channel('inbox', b), []
  model = CostModel({(0, 'work'): 1.0, (1, 'work'): 2.0}, link_latency=0.5, link_bandwidth=4000.0)
  timeline = VirtualExecutor(model).run(
    cluster, [Process('a', a, _producer(inbox, 3)), Process('b', b, _consumer(inbox, 3, seen))]
  )
  spans = lambda lane: [(r.kind, r.batch, r.start, r.end) for r in timeline.tasks(lane=lane)]
  assert spans(a) == [('work', 0, 0.0, 1.0), ('work', 1, 1.0, 2.0), ('work', 2, 2.0, 3.0)]
  assert spans(2) == [
    ('transfer', 0, 1.0, 1.75),
    ('transfer', 1, 2.0, 2.75),
    ('transfer', 2, 3.0, 3.75),
  ]
  assert spans(b) == [('work', 0, 1.75, 3.75), ('work', 1, 3.75, 5.75), ('work', 2, 5.75, 7.75)]
  assert timeline.makespan == 7.75
  assert timeline.utilization() == {'a': 3 / 7.75, 'b': 6 / 7.75, 'link a → b': 2.25 / 7.75}
  np.testing.assert_array_equal([np.asarray(v)[0] for v in seen], [0, 2, 4])


def test_device_speeds_and_seeded_stragglers():
  model = CostModel({'work': 2.0}, device_speeds=(1.0, 4.0), straggler_std=0.5, seed=3)
  draws = lambda m: [m.sampler().duration('work', None, lane) for lane in (0, 1)]
  assert draws(model) == draws(model)  # Same seed, same durations.
  assert draws(model) != draws(
    CostModel({'work': 2.0}, device_speeds=(1.0, 4.0), straggler_std=0.5, seed=4)
  )
  sampler = CostModel({'work': 2.0}, device_speeds=(1.0, 4.0)).sampler()
  assert [sampler.duration('work', None, lane) for lane in (0, 1, 2)] == [2.0, 0.5, 2.0]
  # The straggler factor has mean one.
  sampler = CostModel({'work': 1.0}, straggler_std=0.5).sampler()
  assert abs(np.mean([sampler.duration('work', 0, 0) for _ in range(20000)]) - 1) < 0.02


def test_each_lane_draws_its_own_seeded_stream_from_one_generator(monkeypatch):
  """Lane L's k-th straggler factor is exp(σ·z_k − σ²/2), z_k the k-th normal of
  `default_rng([seed, L])`, however the lanes' draws interleave; each lane's generator is
  made once (making one costs ~100x a draw, and the emulated driver draws per dispatch)."""
  sigma, seed = 0.5, 3
  streams = {lane: np.random.default_rng([seed, lane]) for lane in (0, 1)}
  made = []
  real_default_rng = np.random.default_rng
  monkeypatch.setattr(np.random, 'default_rng', lambda s: made.append(s) or real_default_rng(s))
  sampler = CostModel({'work': 2.0}, straggler_std=sigma, seed=seed).sampler()
  for lane in (0, 1, 1, 0, 1, 1, 0):
    factor = math.exp(sigma * streams[lane].standard_normal() - sigma * sigma / 2)
    assert sampler.duration('work', None, lane) == 2.0 * factor
  assert made == [[seed, 0], [seed, 1]]


@pytest.mark.parametrize(
  'settings,message',
  [
    (
      {'calibrate': False, 'compute': {'forward': 1.0, 'backward': -2.0, 'update': 0.0}},
      r'cost.compute.backward: stage 0 cost must be a finite number of seconds >= 0',
    ),
    (
      {'calibrate': False, 'compute': {'forward': 1.0, 'update': 0.0}},
      r'cost.compute.backward: missing',
    ),
    (
      {'calibrate': False, 'compute': {'forward': [1.0], 'backward': 1.0, 'update': 0.0}},
      r'cost.compute.forward: 1 values for 2 stages',
    ),
    ({'speeds': (1.0, 0.0)}, r'cost.speeds: must be > 0'),
    ({'speeds': (1.0,)}, r'cost.speeds: 1 values for 2 lanes'),
    ({'link_latency': -1.0}, r'cost.link_latency: must be >= 0'),
    ({'straggler_std': -0.1}, r'cost.straggler_std: must be >= 0'),
    ({'warp_speed': 9}, r'cost\.warp_speed: unknown field'),
  ],
)
def test_bad_cost_settings_are_refused_naming_the_field(settings, message):
  with pytest.raises(ValueError, match=message):
    cost = settings_lib.cost_settings(settings, clock='virtual')
    if cost.explicit_compute:
      cost.explicit(('forward', 'backward', 'update'), 2)
    settings_lib.check_lane_speeds(cost, 2)


def test_a_task_without_a_cost_is_refused():
  with pytest.raises(ValueError, match=r"cost.compute: no cost for 'update' tasks of stage 1"):
    CostModel({'forward': 1.0}).sampler().duration('update', 1, 0)


# --- asynchronous workers: a toy parameter server (the follow-up's pattern) --------------
@jax.jit
def _gradient(w):
  return w - 3.0  # f(w) = ½‖w − 3‖²


@jax.jit
def _apply(w, g):
  return w - 0.05 * g


def _asgd(num_workers, rounds, executor):
  """Server on lane 0, workers on lanes 1..M; returns (store, timeline)."""
  cluster = Cluster()
  server = cluster.add_lane('server')
  workers = [cluster.add_lane(f'worker {m}') for m in range(num_workers)]
  store = VersionedStore('w', jnp.zeros((4,)))
  inbox = cluster.channel('gradients', server)
  replies = [cluster.channel(f'reply {m}', lane) for m, lane in enumerate(workers)]
  processes = [
    Process(f'worker {m}', lane, _tagged_worker(store, inbox, replies[m], rounds, m))
    for m, lane in enumerate(workers)
  ]
  processes.append(
    Process('server', server, _tagged_server(store, inbox, replies, num_workers * rounds))
  )
  return store, executor.run(cluster, processes)


def _tagged_worker(store, inbox, reply, rounds, m):
  for _ in range(rounds):
    snapshot = store.read()
    g = yield Compute(_gradient, (snapshot.value,), kind='gradient')
    yield Send(inbox, (m, snapshot.version, g))
    yield Get(reply)


def _tagged_server(store, inbox, replies, updates):
  for _ in range(updates):
    m, version, g = yield Get(inbox)
    w = yield Compute(_apply, (store.read().value, g), kind='update')
    store.write(w, read_version=version, lane=m)
    yield Put(replies[m], None)


def _assert_replays(store):
  """Replaying w_{j+1} = w_j − η (w_{read_j} − 3) from the recorded versions gives the result."""
  w = [np.zeros(4, np.float32)]
  for update in store.updates:
    w.append(w[-1] - np.float32(0.05) * (w[update.read_version] - np.float32(3.0)))
  np.testing.assert_allclose(store.read().value, w[-1], rtol=1e-6)


def test_64_simulated_workers_have_staleness_m_minus_one():
  """ASGD with M equal-speed workers in round-robin: τ = M − 1 after the first round."""
  store, timeline = _asgd(64, 3, EXECUTORS['virtual']())
  staleness = store.staleness()
  assert staleness[:64].tolist() == list(range(64))  # All pulled version 0.
  assert set(staleness[64:].tolist()) == {63}
  assert len({r.lane for r in timeline.records if r.kind == 'gradient'}) == 64
  assert timeline.makespan == pytest.approx(3 * 1.0 + 3 * 0.01 + 63 * 0.01)
  _assert_replays(store)


def test_virtual_asgd_with_stragglers_is_bit_identical_run_to_run():
  def run():
    model = CostModel(
      {'gradient': 1.0, 'update': 0.01},
      straggler_std=0.3,
      device_speeds=(1.0,) + (1.0, 0.5) * 4,
      seed=7,
    )
    store, timeline = _asgd(8, 4, VirtualExecutor(model))
    return store, timeline

  (first, t1), (second, t2) = run(), run()
  assert first.staleness().tolist() == second.staleness().tolist()
  assert t1.records == t2.records
  np.testing.assert_array_equal(first.read().value, second.read().value)
  assert len(set(first.staleness().tolist())) > 2  # Stragglers do change the order.


def test_worker_threads_on_the_real_clock():
  store, timeline = _asgd(4, 5, RealExecutor(threads=True))
  assert len(store.updates) == 20
  assert sorted(u.lane for u in store.updates) == sorted(list(range(4)) * 5)
  _assert_replays(store)  # Whatever the interleaving, the recorded versions explain it.
  for lane in range(5):
    spans = timeline.tasks(lane=lane)
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # One task at a time.


# --- failures -----------------------------------------------------------------------------------
class Boom(RuntimeError):
  pass


def _fails_at(n):
  for i in range(10):

    def work(i=i):
      if i == n:
        raise Boom(f'task {i} failed')
      return jnp.ones(())

    yield Compute(work, kind='work')


def _waits_forever(channel):
  yield Get(channel)


@pytest.mark.parametrize('clock', list(EXECUTORS))
def test_an_exception_in_a_task_stops_the_whole_run(clock):
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  never = cluster.channel('never', b)
  processes = [Process('a', a, _fails_at(3)), Process('b', b, _waits_forever(never))]
  outcome = run_with_timeout(lambda: EXECUTORS[clock]().run(cluster, processes), 20)
  assert isinstance(outcome.get('error'), Boom), outcome


@pytest.mark.parametrize('clock', list(EXECUTORS))
def test_a_deadlock_is_reported_not_hung(clock):
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  to_a, to_b = cluster.channel('to a', a), cluster.channel('to b', b)
  processes = [Process('a', a, _waits_forever(to_a)), Process('b', b, _waits_forever(to_b))]
  outcome = run_with_timeout(lambda: EXECUTORS[clock]().run(cluster, processes), 20)
  assert isinstance(outcome.get('error'), DeadlockError), outcome


def _works(n):
  for i in range(n):
    yield Compute(lambda i=i: jnp.full((4,), i, jnp.float32), kind='work', batch=i)


def _ctrl_c_during_a_workers_save(monkeypatch, ctrl_cs: int) -> list:
  """Two worker threads; after the first op a worker takes a snapshot and writes it for
  1 s, `ctrl_cs` Ctrl-Cs (0.3 s apart) reaching the main thread as it begins. `run` must
  raise `KeyboardInterrupt`; what happened, in order."""
  monkeypatch.setattr(real, '_GRACE_S', 0.1)  # Shorter than the save: only a wait holds it.
  executor = ThreadedExecutor()
  monkeypatch.setattr(executor, 'drained_snapshot', lambda ready: {'going on': len(ready)})
  happened = []

  def between_events():
    if happened:
      return
    executor.snapshot()  # Drained: the other worker stopped between two ops.
    happened.append('save begins')
    for k in range(ctrl_cs):
      time.sleep(0.3 * k)
      if 'run raised' in happened:  # (sent now, it would reach the test, not the run)
        break
      os.kill(os.getpid(), signal.SIGINT)  # Python runs its handler in the main thread.
    time.sleep(1.0)
    happened.append('save ends')

  executor.between_events = between_events
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  processes = [Process('a', a, _works(10**6)), Process('b', b, _works(10**6))]
  with pytest.raises(KeyboardInterrupt):
    try:
      executor.run(cluster, processes)
    finally:
      happened.append('run raised')
  return happened


def test_a_ctrl_c_on_worker_threads_stops_the_run_once_the_checkpoint_is_written(
  monkeypatch, capfd, ctrl_c_raises
):
  """The run's files are closed once `run` has raised (`Run.abort`): a save going on
  after it would be cut short. The workers are given `_GRACE_S` in all to end; the one
  writing a checkpoint is waited for, and one line says so."""
  happened = _ctrl_c_during_a_workers_save(monkeypatch, ctrl_cs=1)
  assert happened == ['save begins', 'save ends', 'run raised']
  assert capfd.readouterr().err.count(real.WAITING_FOR_THE_SAVE) == 1


def test_a_second_ctrl_c_on_worker_threads_stops_waiting_for_the_save(monkeypatch, ctrl_c_raises):
  happened = _ctrl_c_during_a_workers_save(monkeypatch, ctrl_cs=2)
  assert happened == ['save begins', 'run raised']  # (the worker's save goes on, then it ends)
  try:
    time.sleep(1.0)
  except KeyboardInterrupt:
    pytest.fail('a Ctrl-C came after the run had raised: it did not wait for the save')


def test_no_checkpoint_begins_on_worker_threads_once_the_run_has_failed(monkeypatch):
  executor = ThreadedExecutor()
  monkeypatch.setattr(executor, 'drained_snapshot', lambda ready: {'going on': len(ready)})
  snapshots = []

  def between_events():
    if not snapshots:
      executor.fail(KeyboardInterrupt())  # As the main thread does at a Ctrl-C.
    try:
      snapshots.append(executor.snapshot())
    except real.Stopped:
      snapshots.append('stopped')
      raise

  executor.between_events = between_events
  cluster = Cluster()
  processes = [Process('a', cluster.add_lane('a'), _works(3))]
  with pytest.raises(KeyboardInterrupt):
    executor.run(cluster, processes)
  assert snapshots == ['stopped']


# --- the trace ----------------------------------------------------------------------------------
def test_chrome_trace_has_one_row_per_lane_and_one_slice_per_task(tmp_path):
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)
  timeline = VirtualExecutor(CostModel({(0, 'work'): 1.0, (1, 'work'): 2.0})).run(
    cluster, [Process('a', a, _producer(inbox, 2)), Process('b', b, _consumer(inbox, 2, []))]
  )
  timeline.write_chrome_trace(str(tmp_path / 'trace.json'))
  events = json.load(open(tmp_path / 'trace.json'))['traceEvents']
  names = {e['tid']: e['args']['name'] for e in events if e['name'] == 'thread_name'}
  assert names == {0: 'a', 1: 'b', 2: 'link a → b'}
  slices = [(e['tid'], e['name'], e['ts'], e['dur']) for e in events if e['ph'] == 'X']
  assert sorted(slices) == sorted(
    [
      (0, 'work b0', 0.0, 1e6),
      (0, 'work b1', 1e6, 1e6),
      (2, 'transfer b0', 1e6, 0.0),
      (2, 'transfer b1', 2e6, 0.0),
      (1, 'work b0', 1e6, 2e6),
      (1, 'work b1', 3e6, 2e6),
    ]
  )


def test_a_chrome_trace_reads_back_into_the_timeline_it_was_written_from():
  """`Timeline.from_chrome_trace` inverts `chrome_trace`: lanes, kinds, stages, batches,
  and the times in seconds (dyadic, exact through microseconds), the driver's and the
  CPU's where a record has them and None where it has not."""
  records = [
    TaskRecord(0, 'forward', 0.5, 1.25, stage=0, batch=0),
    TaskRecord(1, 'backward', 1.5, 2.75, 1, 0, heard=3.0, dispatched=0.25, cpu=1.125),
    TaskRecord(2, 'transfer', 1.25, 1.5, batch=0),
  ]
  timeline = Timeline(['stage 0', 'stage 1', 'link 0 → 1'], records, 'real')
  assert Timeline.from_chrome_trace(timeline.chrome_trace()) == timeline
  virtual = Timeline(['a'], records[:1], 'virtual')
  assert Timeline.from_chrome_trace(json.loads(json.dumps(virtual.chrome_trace()))) == virtual


def test_real_clock_measures_every_task_in_order():
  cluster = Cluster()
  devices = jax.devices()[:2]
  a, b = cluster.add_lane('a', devices[0]), cluster.add_lane('b', devices[1])
  inbox, seen = cluster.channel('inbox', b), []
  timeline = RealExecutor().run(
    cluster, [Process('a', a, _producer(inbox, 4)), Process('b', b, _consumer(inbox, 4, seen))]
  )
  assert [r.batch for r in timeline.tasks(lane=b)] == [0, 1, 2, 3]
  for lane in (a, b):
    spans = timeline.tasks(lane=lane)
    assert all(0 <= s.start <= s.end for s in spans)
    assert all(x.end <= y.start + 1e-9 for x, y in zip(spans, spans[1:]))
  assert {v.devices().pop() for v in seen} == {devices[1]}  # Sent to the consumer's device.
  assert not math.isnan(timeline.makespan)


# --- one executor base: a third clock needs only the hooks -----------------------------------
class _LockStep(Executor):
  """A third clock in a few lines: one task at a time, each waited for, a tick per task.

  It overrides only the hooks (when a process goes on, how a task runs); channels,
  transfers and deadlocks are the base's.
  """

  clock = 'lock-step'

  def begin(self):
    self.ticks, self.ready = 0, collections.deque()

  def now(self):
    return float(self.ticks)

  def execute(self):
    self.ready.extend((p, None) for p in self.processes)
    while self.ready:
      self.advance(*self.ready.popleft())

  def resume(self, process, value):
    self.ready.append((process, value))

  def start_task(self, process, lane, op):
    result = jax.block_until_ready(op.fn(*op.args))
    self.record(TaskRecord(lane, op.kind, self.now(), self.now() + 1, op.stage, op.batch))
    self.ticks += 1
    self.task_finished(process, result)


def test_a_third_executor_needs_only_the_hooks():
  cluster = Cluster()
  devices = jax.devices()[:2]
  a, b = cluster.add_lane('a', devices[0]), cluster.add_lane('b', devices[1])
  inbox, seen = cluster.channel('inbox', b), []
  timeline = _LockStep().run(
    cluster, [Process('a', a, _producer(inbox, 3)), Process('b', b, _consumer(inbox, 3, seen))]
  )
  np.testing.assert_array_equal([np.asarray(v)[0] for v in seen], [0, 2, 4])
  assert {v.devices().pop() for v in seen} == {devices[1]}  # The base's transfer copied it.
  assert [r.kind for r in timeline.tasks(lane=2)] == ['transfer'] * 3  # On the link lane.
  assert timeline.clock == 'lock-step' and len(timeline.records) == 9
  # One worker's ASGD is sequential SGD whatever the clock: the same bits as the virtual one.
  store, _ = _asgd(1, 6, _LockStep())
  reference, _ = _asgd(1, 6, EXECUTORS['virtual']())
  np.testing.assert_array_equal(store.read().value, reference.read().value)
  assert store.staleness().tolist() == [0] * 6
  with pytest.raises(DeadlockError, match='lock-step clock: a waits on'):
    cluster = Cluster()
    lane = cluster.add_lane('a')
    _LockStep().run(cluster, [Process('a', lane, _waits_forever(cluster.channel('c', lane)))])


def _yields_junk():
  yield 'not an op'


@pytest.mark.parametrize('clock', list(EXECUTORS))
def test_an_unknown_op_is_refused_naming_the_process(clock):
  cluster = Cluster()
  lane = cluster.add_lane('a')
  outcome = run_with_timeout(
    lambda: EXECUTORS[clock]().run(cluster, [Process('junk maker', lane, _yields_junk())]), 20
  )
  assert isinstance(outcome.get('error'), TypeError), outcome
  assert "junk maker yielded 'not an op'" in str(outcome['error'])


def test_threads_make_a_threaded_executor_with_the_same_interface():
  executor = RealExecutor(threads=True)
  assert isinstance(executor, ThreadedExecutor) and isinstance(executor, RealExecutor)
  assert (executor.clock, executor.threads, executor.max_inflight) == ('real', True, 16)
  assert type(RealExecutor()) is RealExecutor and not RealExecutor().threads


@pytest.mark.parametrize('clock', list(EXECUTORS))
def test_every_clock_delivers_sends_in_order_on_the_receivers_device(clock):
  cluster = Cluster()
  devices = jax.devices()[:2]
  a, b = cluster.add_lane('a', devices[0]), cluster.add_lane('b', devices[1])
  inbox, seen = cluster.channel('inbox', b), []
  timeline = run_with_timeout(
    lambda: EXECUTORS[clock]().run(
      cluster, [Process('a', a, _producer(inbox, 5)), Process('b', b, _consumer(inbox, 5, seen))]
    ),
    60,
  )['value']
  np.testing.assert_array_equal([np.asarray(v)[0] for v in seen], [0, 2, 4, 6, 8])
  assert {v.devices().pop() for v in seen} == {devices[1]}
  transfers = timeline.tasks(lane=cluster.link(a, b))
  assert [r.batch for r in transfers] == [0, 1, 2, 3, 4]
  assert all(x.end <= y.start + 1e-9 for x, y in zip(transfers, transfers[1:]))


# --- the real clock: nothing copied that is already in place -------------------------------
def test_to_device_copies_only_what_is_not_on_the_device():
  devices = jax.devices()[:2]
  on_first = jax.device_put(jnp.arange(3.0), devices[0])
  tree = {'a': on_first, 'b': [on_first * 2]}
  assert transfer.to_device(tree, devices[0]) is tree  # Nothing to move.
  moved = transfer.to_device(tree, devices[1])
  assert {leaf.devices().pop() for leaf in jax.tree_util.tree_leaves(moved)} == {devices[1]}
  host = {'a': np.arange(3.0), 'b': on_first}  # A host leaf: the tree is placed.
  placed = transfer.to_device(host, devices[0])
  assert placed is not host and all(
    isinstance(leaf, jax.Array) and leaf.committed for leaf in jax.tree_util.tree_leaves(placed)
  )
  batch = {
    'image': np.random.default_rng(0).standard_normal((4, 3)),  # float64 → float32
    'label': np.arange(4),
    'mask': np.array([True, False, True, True]),
  }
  with jax.transfer_guard('disallow'):  # An explicit placement, like jax.device_put.
    placed = transfer.to_device(batch, devices[1])
  for key, value in jax.device_put(batch, devices[1]).items():
    assert (placed[key].dtype, placed[key].committed) == (value.dtype, True)
    assert placed[key].devices() == {devices[1]}
    np.testing.assert_array_equal(placed[key], value)
  uncommitted = jnp.arange(3.0)  # On the default device, but not committed to it.
  assert not uncommitted.committed
  assert transfer.to_device(uncommitted, jax.devices()[0]).committed
  np.testing.assert_array_equal(moved['b'][0], [0.0, 2.0, 4.0])


def test_a_task_through_host_inputs_takes_a_host_batch_explicitly_and_computes_the_same():
  device = jax.devices()[1]
  w = transfer.to_device(np.arange(12.0, dtype=np.float32).reshape(3, 4), device)
  batch = {'x': np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)}
  task = jax.jit(lambda w, x: jnp.tanh(x @ w))
  assert transfer.for_task(batch, device) is batch  # host arrays: the call copies them in
  with jax.transfer_guard('disallow'):
    with pytest.raises(Exception, match='host-to-device'):  # as it is: an implicit copy
      task(w, batch['x'])
    out = transfer.HostInputs(task)(w, batch['x'])  # explicit, as `to_device` is
    placed = task(w, transfer.to_device(batch, device)['x'])
  assert out.devices() == {device} and out.committed
  np.testing.assert_array_equal(np.asarray(out), np.asarray(placed))  # the same bits
  on_device = transfer.to_device(batch, device)
  assert transfer.for_task(on_device, device) is on_device
  moved = transfer.for_task({'x': jax.device_put(batch['x'], jax.devices()[0])}, device)
  assert moved['x'].devices() == {device}  # arrays elsewhere are placed, as `to_device`


def test_a_constant_is_the_array_device_put_makes_and_passes_the_transfer_guard():
  device = jax.devices()[1]
  for value, dtype in ((3, np.int32), (1.0, np.float32), (-2.5, np.float64), (7, np.int64)):
    with jax.transfer_guard('disallow'):  # An explicit placement.
      made = transfer.constant(value, device, dtype)
    expected = jax.device_put(np.asarray(value, dtype), device)
    assert (made.dtype, made.shape, made.weak_type, made.committed, made.sharding) == (
      expected.dtype,
      expected.shape,
      expected.weak_type,
      True,
      expected.sharding,
    )
    assert made.item() == expected.item() == value


def _committed_producer(out, device):
  for i in range(3):
    value = yield Compute(
      lambda i=i: jax.device_put(jnp.full((4,), i, jnp.float32), device), kind='work', stage=0
    )
    yield Send(out, value, batch=i)


def test_a_send_on_one_device_is_delivered_in_place_on_the_real_clock():
  device = jax.devices()[0]
  for executor, transfers in (
    (RealExecutor(), 0),
    (RealExecutor(threads=True), 0),
    (EXECUTORS['virtual'](), 3),
  ):
    cluster = Cluster()
    a, b = cluster.add_lane('a', device), cluster.add_lane('b', device)
    inbox, seen = cluster.channel('inbox', b), []

    timeline = executor.run(
      cluster,
      [
        Process('a', a, _committed_producer(inbox, device)),
        Process('b', b, _consumer(inbox, 3, seen)),
      ],
    )
    assert len(timeline.tasks(kind='transfer')) == transfers, executor
    np.testing.assert_array_equal([np.asarray(v)[0] for v in seen], [0, 2, 4])
    assert [r.kind for r in timeline.tasks(lane=b)] == ['work'] * 3


def test_lanes_sharing_a_device_are_timed_one_task_after_another():
  """One timing thread per device: tasks of two lanes on one device never overlap."""
  device = jax.devices()[0]
  cluster = Cluster()
  a, b = cluster.add_lane('a', device), cluster.add_lane('b', device)
  inbox = cluster.channel('inbox', b)
  heavy = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = jax.device_put(jnp.ones((256, 256)), device)

  def worker(n, receive):
    for i in range(n):
      if receive:
        yield Get(inbox)
      y = yield Compute(heavy, (x,), kind='work', batch=i)
      if not receive:
        yield Send(inbox, y, batch=i)

  timeline = RealExecutor().run(
    cluster, [Process('a', a, worker(6, False)), Process('b', b, worker(6, True))]
  )
  spans = sorted(timeline.records, key=lambda r: r.start)
  assert len(spans) == 12 and {r.lane for r in spans} == {a, b}
  assert all(x.end <= y.start + 1e-9 for x, y in zip(spans, spans[1:]))


class _Pending:
  """A task's output that is ready only once released (the timing thread waits on it
  through `block_until_ready`, as on a device array)."""

  def __init__(self):
    self.released = threading.Event()

  def block_until_ready(self):
    self.released.wait()
    return self


def test_a_full_real_clock_window_waits_until_half_of_it_has_finished():
  """max_inflight = 4: the loop dispatches tasks 0-4 (5 unfinished > 4), then waits; the
  6th task is dispatched only once 3 have finished (2 = 4 // 2 left), not at the first."""
  outputs = [_Pending() for _ in range(8)]
  dispatched = [threading.Event() for _ in outputs]

  def task(i):
    dispatched[i].set()
    return outputs[i]

  def program():
    for i in range(len(outputs)):
      yield Compute(task, (i,), kind='work')

  cluster = Cluster()
  lane = cluster.add_lane('a', jax.devices()[0])
  executor = RealExecutor(max_inflight=4)
  run = threading.Thread(target=executor.run, args=(cluster, [Process('p', lane, program())]))
  run.start()
  try:
    assert dispatched[4].wait(10) and not dispatched[5].is_set()
    for i in range(2):  # 4 and 3 unfinished: still more than 2
      outputs[i].released.set()
      assert not dispatched[5].wait(0.3)
    outputs[2].released.set()  # 2 unfinished: the loop goes on
    assert dispatched[5].wait(10)
  finally:
    for output in outputs:
      output.released.set()
    run.join(10)
  assert not run.is_alive() and executor.failure is None
