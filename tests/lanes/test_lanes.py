"""Lanes in their own processes (jaxsgd.scheduler.lanes): placement, tasks by name,
values that stay in their lane, lane-to-lane moves, faults and signals.

The lanes join a Ray head started with `ray start --head` (`ray_head.py`), by address:
the code path of a run over several hosts. One test starts a cluster of its own, as a
run on one machine does. Every test checks that no process is left behind.
"""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import jax
import numpy as np
import psutil
import pytest

import lane_tasks
from ray_head import gone, serve_head  # (`gone`: imported from here by other modules)

from jaxsgd.scheduler.lanes import (
  Handle,
  LaneError,
  LanePlacement,
  LanePool,
  LaneSpec,
  cluster,
  runtime,
  wire,
)
from jaxsgd.scheduler.lanes.forked import LaneEnded
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR, MakerFailed, Ref
from jaxsgd.scheduler.process import LaneValue
from jaxsgd.scheduler.tasks import Task, TaskRecipe

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.5)
X = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
G = np.linspace(1, 2, 12, dtype=np.float32).reshape(3, 4)


def task(name):
  return Task(RECIPE, name)


def described(pids) -> list[str]:
  """What each of `pids` is doing, for a failure's message: its name, state, and each
  thread's state and the kernel function it waits in (a process that cannot run, say,
  against one that waits for something)."""
  rows = []
  for pid in pids:
    try:
      process = psutil.Process(pid)
      threads = []
      for thread in process.threads():
        task = f'/proc/{pid}/task/{thread.id}'
        with open(f'{task}/stat') as stat, open(f'{task}/wchan') as wchan:
          threads.append(f'{thread.id}:{stat.read().rsplit(")", 1)[1].split()[0]}:{wchan.read()}')
      rows.append(f'{pid} {process.name()} {process.status()} threads {" ".join(threads)}')
    except (psutil.Error, OSError) as error:
      rows.append(f'{pid}: {type(error).__name__}')
  return rows


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.fixture(scope='module')
def pool(head):
  with LanePool(LanePlacement.spread(['a', 'b']), address=head.address) as lanes:
    yield lanes
  assert gone(lanes.pids().values()) == []


def test_placement_text_form_and_bad_input():
  placement = LanePlacement.parse('server@cores=0; w0@host=10.0.0.2@cores=1-3@gpu=1')
  assert placement.lanes == (
    LaneSpec('server', cores=(0,)),
    LaneSpec('w0', host='10.0.0.2', cores=(1, 2, 3), gpu=True),
  )
  assert 'w0: host=10.0.0.2 cores=1,2,3 gpu=yes' in placement.describe()
  assert LanePlacement.spread(['a', 'b', 'c'], cores=[0, 1]).lanes[2].cores == (0,)
  assert placement['w0'].environment() == {
    'JAX_PLATFORMS': '',
    'OMP_NUM_THREADS': '3',
    'MKL_NUM_THREADS': '3',
    'OPENBLAS_NUM_THREADS': '3',
    'XLA_FLAGS': '',
  }  # a GPU lane: JAX's default platforms, not the driver's; 3 cores: Eigen's pool on them
  assert placement['server'].environment()['JAX_PLATFORMS'] == 'cpu'
  with pytest.raises(ValueError, match=r"lane 'w0': cores like '0,1' or '0-3'"):
    LanePlacement.parse('w0@cores=x')
  with pytest.raises(ValueError, match='unique'):
    LanePlacement.parse('a; a')
  with pytest.raises(ValueError, match=r"'speed=2' is not host=\.\.\."):
    LanePlacement.parse('a@speed=2')
  # A lane's copy threads on other cores than its tasks: in its spec, its environment
  # (which the lane reads) and its line.
  apart = LanePlacement.parse('s1@cores=1@copies=0,2-3')
  assert (apart['s1'].cores, apart['s1'].copy_cores) == ((1,), (0, 2, 3))
  assert apart['s1'].environment()['JAXSGD_LANE_COPY_CORES'] == '0,2,3'
  assert 's1: host=driver cores=1 copies=0,2,3 gpu=no' in apart.describe()
  assert 'JAXSGD_LANE_COPY_CORES' not in placement['server'].environment()
  with pytest.raises(ValueError, match=r"lane 's1': copies like '0,1' or '0-3' expected, got 'x'"):
    LanePlacement.parse('s1@copies=x')
  with pytest.raises(ValueError, match=r"lane 's1': copy_cores must be a non-empty list"):
    LaneSpec('s1', copy_cores=())
  from jaxsgd.scheduler.lanes import runtime  # the lane refuses cores its host has not

  with pytest.raises(ValueError, match=r'placement: copies \[9999\] are not cores of this host'):
    runtime.check_cores((9999,), 'copies')


def test_copies_leave_the_busiest_cores_for_the_least_busy_while_it_stays_the_less_busy():
  """`placement.copies_toward_idle`, by hand (ms an iteration: tasks + copies)."""
  from jaxsgd.scheduler.lanes.placement import copies_toward_idle

  ms = lambda tasks, copies: (tasks / 1e3, copies / 1e3)
  # PD-ASGD 1:1: core 1 110.8 + 4.4 = 115.2; core 0 (61.0 + 9.1) + (3.9 + 5.8) = 79.8;
  # 79.8 + 4.4 = 84.2 <= 115.2 - 4.4 = 110.8: the backward worker's copies go to core 0.
  pd = {'backwardworker0': ms(110.8, 4.4), 'forwardworker0': ms(61.0, 9.1)}
  pd['sharedmodel'] = ms(3.9, 5.8)
  cores = {'backwardworker0': (1,), 'forwardworker0': (0,), 'sharedmodel': (0,)}
  assert copies_toward_idle(pd, cores) == {'backwardworker0': (0,)}
  # DDG K=2: 88.8 + 1.1 against 82.5 + 1.1; 83.6 + 1.1 = 84.7 <= 88.8: stage 1's go.
  ddg = {'stage0': ms(82.5, 1.1), 'stage1': ms(88.8, 1.1)}
  assert copies_toward_idle(ddg, {'stage0': (0,), 'stage1': (1,)}) == {'stage1': (0,)}
  # ASGD M=2: core 0 (server 4.8 + 6.1, worker0 85.6 + 3.2) 99.7, core 1 86.1 + 3.3 =
  # 89.4; 89.4 + 9.3 = 98.7 > 99.7 - 9.3 = 90.4: core 1 would become the busier, none
  # moves. Near balance likewise: 85.0 + 4.0 + 3.5 = 92.5 > 88.0 + 3.5 - 3.5.
  asgd = {'server': ms(4.8, 6.1), 'worker0': ms(85.6, 3.2), 'worker1': ms(86.1, 3.3)}
  assert copies_toward_idle(asgd, {'server': (0,), 'worker0': (0,), 'worker1': (1,)}) == {}
  near = {'stage0': ms(85.0, 4.0), 'stage1': ms(88.0, 3.5)}
  assert copies_toward_idle(near, {'stage0': (0,), 'stage1': (1,)}) == {}
  # Three core groups, busiest a core first: a (100) gives 10 to c (60 on two cores, 30
  # a core -> 35 <= 90); b (95) gives 10 to c, the least busy of those that gave none
  # (35 -> 40 <= 85); c took copies: it keeps its own. A group on several cores gives
  # to them all; an unpinned lane (no cores) is left out; one group alone has nowhere
  # to give.
  three = {'a': ms(90.0, 10.0), 'b': ms(85.0, 10.0), 'c': ms(55.0, 5.0), 'free': ms(99, 9)}
  cores = {'a': (0,), 'b': (1,), 'c': (2, 3), 'free': None}
  assert copies_toward_idle(three, cores) == {'a': (2, 3), 'b': (2, 3)}
  assert copies_toward_idle({'a': ms(90.0, 10.0)}, {'a': (0,)}) == {}
  # Loads are compared a core: wide on two cores at 120 (60 a core) is less busy than
  # narrow on one at 90. Narrow gives: (120 + 10) / 2 = 65 <= 90 - 10. (Summed without
  # the cores, wide would have given its 10 to narrow, the bottleneck: 100 <= 110.)
  wide = {'wide': ms(110.0, 10.0), 'narrow': ms(80.0, 10.0)}
  assert copies_toward_idle(wide, {'wide': (0, 1), 'narrow': (2,)}) == {'narrow': (0, 1)}


def test_lanes_sharing_a_gpu_take_their_share_of_it_and_of_its_memory(monkeypatch):
  from jaxsgd.scheduler.lanes import cluster

  placement = LanePlacement.parse('s0@gpu=0.5; s1@gpu=0.5@cores=1; cpu')
  assert [lane.gpu for lane in placement.lanes] == [0.5, 0.5, 0.0]
  assert 's0: host=driver cores=any gpu=0.5 of one' in placement.describe()
  # JAX alone takes 0.75 of the GPU's memory; each of two sharing processes half of that.
  assert placement['s0'].environment() == {
    'JAX_PLATFORMS': '',
    'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.375',
  }
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in LaneSpec('g', gpu=1).environment()
  for bad in ('1.5', '-0.5', 'x', 'nan'):
    with pytest.raises(ValueError, match=rf"lane 'g': gpu must be 0, 1 or a share .* got '{bad}'"):
      LanePlacement.parse(f'g@gpu={bad}')
  # Shares are added up per node: two halves fit one GPU, three do not.
  monkeypatch.setattr(cluster, '_node_id', lambda spec: 'node')
  monkeypatch.setattr(
    cluster.ray, 'nodes', lambda: [{'NodeID': 'node', 'Alive': True, 'Resources': {'GPU': 1}}]
  )
  cluster.check_gpus(placement.lanes)
  three = LanePlacement.parse('a@gpu=0.5; b@gpu=0.5; c@gpu=0.5').lanes
  with pytest.raises(ValueError, match=r"ask for 1\.5 GPU\(s\) .* but the driver's host has 1 "):
    cluster.check_gpus(three)
  # A share is never split over GPUs: three of 0.6 need three GPUs, not 1.8.
  assert cluster._gpus_needed([0.6, 0.6, 0.6]) == 3  # pylint: disable=protected-access
  assert cluster._gpus_needed([1.0, 0.5, 0.25, 0.25]) == 2  # pylint: disable=protected-access


@pytest.mark.timeout(120, func_only=True)  # a placement Ray could wait on for ever
def test_gpu_lanes_their_host_cannot_take_are_refused_before_any_lane_starts(head, pool):
  node = pool.info['a']['host']  # this machine, as the cluster names it
  before = _lane_processes(head)
  # 64 GPU lanes on one node (more than any has), half named by host, half not: counted
  # together, per node.
  gpus = [f'g{i}@gpu=1' for i in range(32)] + [f'h{i}@host={node}@gpu=1' for i in range(32)]
  refused = (
    r"lane\(s\) 'g0', .*'h31' ask for 64 GPU\(s\) \(gpu=1 each.*\), but the driver's host has \d+"
  )
  with pytest.raises(ValueError, match=refused):
    LanePool(LanePlacement.parse('; '.join(['a', *gpus])), address=head.address, verbose=False)
  assert set(_lane_processes(head)) - set(before) == set()  # none started


def test_a_lane_takes_the_drivers_xla_flags_but_its_device_count_then_its_own():
  driver = '--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false'
  one_core = {'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false'}
  assert cluster.lane_xla_flags(driver, one_core) == (
    '--xla_cpu_enable_fast_math=false --xla_cpu_multi_thread_eigen=false'
  )
  assert cluster.lane_xla_flags(driver, {'JAX_PLATFORMS': ''}) == (
    '--xla_cpu_enable_fast_math=false'
  )
  assert cluster.lane_xla_flags('', {}) == ''


def test_the_drivers_xla_flags_reach_an_unpinned_lane_but_its_device_count(head, monkeypatch):
  # An unpinned lane sets no XLA flag of its own; it ran with what its Ray worker had
  # (the head's: conftest's 8 fake devices), not the driver's.
  driver = '--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false'
  monkeypatch.setenv('XLA_FLAGS', driver)  # (the tests' JAX has started: nothing here moves)
  with LanePool(LanePlacement.parse('u'), address=head.address, verbose=False) as lanes:
    flags = lanes.fetch(lanes.run('u', task('env'), ('XLA_FLAGS',)))
    devices = lanes.fetch(lanes.run('u', task('device_count')))
  assert (flags, devices) == ('--xla_cpu_multi_thread_eigen=false', 1)


def test_each_lane_is_a_process_pinned_to_its_cores(pool):
  pids = pool.pids()
  assert len({*pids.values(), os.getpid()}) == 3
  cores = sorted(os.sched_getaffinity(0))
  for i, lane in enumerate(['a', 'b']):
    assert pool.fetch(pool.run(lane, task('pid'))) == pids[lane]
    assert pool.fetch(pool.run(lane, task('affinity'))).tolist() == [cores[i % len(cores)]]
    # The driver's XLA flags but its fake device count (conftest's 8), then the lane's.
    flags = pool.fetch(pool.run(lane, task('env'), ('XLA_FLAGS',)))
    assert flags == '--xla_cpu_multi_thread_eigen=false'
    assert pool.fetch(pool.run(lane, task('env'), ('OMP_NUM_THREADS',))) == '1'
    assert pool.fetch(pool.run(lane, task('env'), ('JAX_PLATFORMS',))) == 'cpu'
    # A lane is a ready Ray worker that imported JAX with the lane's code, before its
    # variables were set: JAX's own flags are set in its config too.
    assert pool.fetch(pool.run(lane, task('jax_flag'), ('jax_platforms',))) == 'cpu'
    cache = pool.fetch(pool.run(lane, task('jax_flag'), ('jax_compilation_cache_dir',)))
    assert cache == pool.fetch(pool.run(lane, task('env'), ('JAX_COMPILATION_CACHE_DIR',)))
    assert (
      pool.fetch(pool.run(lane, task('jax_flag'), ('jax_persistent_cache_min_compile_time_secs',)))
      == '0.0'
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs two cores')
def test_a_lanes_copy_threads_run_on_their_own_cores_and_its_values_still_move(head):
  """`c@cores=0@copies=1`: c's tasks run on core 0 (the task thread, XLA's), its copy
  threads — the reader of the driver's calls, its export thread, and the reader of the
  values d sends it — on core 1; values move both ways as with every thread on core 0.
  The same once they are moved while the lanes run, which a lane answers beside the
  calls queued on it."""
  first, second = sorted(os.sched_getaffinity(0))[:2]
  placement = LanePlacement.parse(f'c@cores={first}@copies={second}; d@cores={second}')
  with LanePool(placement, address=head.address, verbose=False) as lanes:
    x = np.arange(6, dtype=np.float32)
    on_c = lanes.run('c', task('add'), (x, x))
    on_d = lanes.run('d', task('add'), (on_c, x))  # c -> d
    back = lanes.run('c', task('add'), (on_d, on_c))  # d -> c
    np.testing.assert_array_equal(lanes.fetch(back), 5 * x)
    assert lanes.fetch(lanes.run('c', task('affinity'))).tolist() == [first]
    threads = lanes.fetch(lanes.run('c', task('thread_affinities'))).split('|')
    assert set(threads) == {str(first), str(second)}
    assert threads.count(str(second)) >= 3  # the two readers and the export thread
    assert set(lanes.fetch(lanes.run('d', task('thread_affinities'))).split('|')) == {str(second)}
    # Moved while the lanes run (`LanePool.place_copies`): c's copies back to its own
    # core, d's to c's; the values still move, and the copies' CPU goes on counting.
    copied = lanes.copy_cpu('d')
    assert lanes.place_copies('c', None) == (first,)
    assert lanes.place_copies('d', [first]) == (first,)
    assert set(lanes.fetch(lanes.run('c', task('thread_affinities'))).split('|')) == {str(first)}
    threads = lanes.fetch(lanes.run('d', task('thread_affinities'))).split('|')
    assert threads.count(str(first)) >= 3 and str(second) in threads  # its tasks stay
    again = lanes.run('d', task('add'), (lanes.run('c', task('add'), (back, x)), x))
    np.testing.assert_array_equal(lanes.fetch(again), 7 * x)
    assert lanes.copy_cpu('d') > copied > 0
    # Answered beside the calls queued on the lane: while c runs a 3-s task.
    held = lanes.start('c', task('hang'), (3.0,))
    assert lanes.place_copies('c', [second]) == (second,) and lanes.copy_cpu('c') > 0
    assert lanes.wait_any([held], timeout=0) is None  # (in its ordered thread: after it)
    lanes.wait_all([held])
    with pytest.raises(LaneError, match=r'placement: copies \[9999\] are not cores of this host'):
      lanes.place_copies('c', [9999])


def _thread_names(pid: int) -> set[str]:
  """The OS names of process `pid`'s threads (Linux)."""
  names = set()
  for tid in os.listdir(f'/proc/{pid}/task'):
    try:
      with open(f'/proc/{pid}/task/{tid}/comm') as comm:
        names.add(comm.read().strip())
    except OSError:  # the thread ended meanwhile
      pass
  return names


def test_a_lane_names_its_threads_for_the_os_by_their_roles(pool):
  """Each lane thread says what it does where `/proc` (`top -H`, `perf`,
  `benchmarks/lane_threads.py`) reads it (`runtime.THREAD_NAMES`): the calls thread, the
  export thread and the driver's reader in every lane, and once a lane has taken in a
  value another sent, the reader of that lane's connection; in the driver, the reader of
  each lane's connection and their writer (`benchmarks/driver_cpu.py`)."""
  names = runtime.THREAD_NAMES
  assert all(len(name.encode()) <= 15 for name in names.values())  # (else the OS cuts it)
  x = np.arange(4, dtype=np.float32)
  on_b = pool.run('b', task('add'), (pool.run('a', task('add'), (x, x)), x))  # a -> b
  np.testing.assert_array_equal(pool.fetch(on_b), 3 * x)
  pids = pool.pids()
  common = {names['calls'], names['exports'], names['driver reader']}
  assert common <= _thread_names(pids['a'])
  assert common | {names['lane reader']} <= _thread_names(pids['b'])
  # The driver's side: a reader of each lane's connection, and the connections' writer.
  assert {wire.REPLIES_THREAD, wire.WRITER_THREAD} <= _thread_names(os.getpid())
  assert len(wire.REPLIES_THREAD.encode()) <= 15 and len(wire.WRITER_THREAD.encode()) <= 15


def _main_thread_switches(pid: int) -> int:
  """How many times the main thread of process `pid` has been switched out (Linux)."""
  with open(f'/proc/{pid}/task/{pid}/status') as status:
    return sum(int(line.split()[1]) for line in status if 'ctxt_switches' in line)


def test_an_idle_lanes_main_thread_sleeps_in_its_watch_and_its_info_comes_over_its_socket(pool):
  """Ray's task loop on a worker's main thread wakes every 10 ms to check for signals,
  taking Python's lock each time; a lane's main thread waits in `watch` instead, so an
  idle lane's main thread is not switched in at all (Ray's loop woke it ~100 times a
  second). Ray's calls end there: the lane's `info` now comes over its socket."""
  pids = pool.pids()
  pool.fetch(pool.run('a', task('pid')))  # (the lane has served a task, then idles)
  before = {lane: _main_thread_switches(pid) for lane, pid in pids.items()}
  time.sleep(1.0)
  assert {lane: _main_thread_switches(pid) - before[lane] for lane, pid in pids.items()} == {
    'a': 0,
    'b': 0,
  }
  for lane, pid in pids.items():
    info = pool.lane_info(lane)
    assert (info['name'], info['pid'], info['address']) == (lane, pid, pool.info[lane]['address'])


def test_results_stay_in_the_lane_until_the_driver_drops_them(pool):
  before = pool.held('a')
  w = pool.run('a', task('init'), (0,))
  y, vjp = pool.run('a', task('forward'), (w, X))
  assert isinstance(y, Handle) and y.lane == 'a' and y.description == 'float32[3, 4]'
  assert vjp.description.startswith('VJP(') and vjp.nbytes > 0
  assert pool.held('a') == before + 3
  expected_w = 0.5 * jax.random.normal(jax.random.key(0), (8, 4))
  np.testing.assert_array_equal(pool.fetch(w), expected_w)
  # The same jitted layer in this process: bit for bit.
  np.testing.assert_array_equal(pool.fetch(y), jax.jit(lane_tasks.layer)(expected_w, X))
  del y, vjp
  assert pool.held('a') == before + 1
  del w
  assert pool.held('a') == before


def test_a_number_a_task_returns_comes_with_its_reply_and_is_read_without_a_call(pool, monkeypatch):
  """A loss is read by the driver's checks while its lane has calls queued: it came with
  its task's reply, so no `fetch` waits behind those calls (`LanePool.scalar`)."""
  w = pool.run('a', task('init'), (3,))
  y, loss, key = pool.run('a', task('loss'), (w, X))
  _, expected, _ = lane_tasks.build_layer_tasks(0.5)['loss'](pool.fetch(w), X)
  assert pool.scalar(y) is None and pool.scalar(key) is None  # not one number: kept there
  np.testing.assert_array_equal(pool.scalar(loss), expected)
  busy = pool.start('a', task('hang'), (1.0,))  # a call would wait for this one
  executor = types.SimpleNamespace(pool=pool)
  value = LaneValue(executor, loss)

  def no_call(*args):
    raise AssertionError(f'a call to a lane: {args[:2]}')

  monkeypatch.setattr(pool, '_call', no_call)
  assert not pool.idle('a') and value.is_ready()
  np.testing.assert_array_equal(np.asarray(value), expected)
  monkeypatch.undo()
  pool.wait_any([busy])
  key = loss.key
  del loss, value
  assert pool.scalar(types.SimpleNamespace(key=key)) is None  # dropped with its handle


def test_a_copy_of_a_number_is_read_without_a_call_as_its_source_is(pool, monkeypatch):
  """A loss moved to another lane (an ASGD worker's, sent to the server with its push) is
  the number its task replied with: the driver's loss checks read it with no call to the
  receiving lane, which would wait behind the calls queued there (fetched one by one
  from an idle server, a 32-worker run's check took 4-9 ms while the server's next
  update waited). Known at the move, or once the task that made it replies; a copy of
  a copy too."""
  w = pool.run('a', task('init'), (3,))
  _, loss, _ = pool.run('a', task('loss'), (w, X))  # its outline known from now on
  loss_fn = lane_tasks.build_layer_tasks(0.5)['loss']
  first, second = (float(loss_fn(pool.fetch(w), x)[1]) for x in (X, 2 * X))
  assert first != second and pool.scalar(loss) == first
  busy = pool.start('a', task('hang'), (1.0,))
  late = pool.start('a', task('loss'), (w, 2 * X))  # behind `hang`: no reply yet
  _, late_loss, _ = pool.early(late)
  moved_now = pool.move(loss, 'b')
  moved_late, dropped = pool.move(late_loss, 'b'), pool.move(late_loss, 'b')
  moved_on = pool.move(moved_late, 'a')
  moved_twice = pool.move(pool.move(late_loss, 'b'), 'a')  # its middle copy dropped
  assert pool.scalar(moved_now) == first
  assert all(pool.scalar(h) is None for h in (moved_late, moved_on, moved_twice))
  dropped_key = dropped.key
  del dropped
  pool.wait_any([busy])
  pool.wait_any([late])
  assert [pool.scalar(h) for h in (moved_late, moved_on, moved_twice)] == [second] * 3
  assert pool.scalar(types.SimpleNamespace(key=dropped_key)) is None  # (not kept for it)
  assert late.key not in pool._scalar_copies  # nothing left waiting for its reply
  values = [LaneValue(types.SimpleNamespace(pool=pool), h) for h in (moved_late, moved_on)]
  busy = pool.start('b', task('hang'), (1.0,))  # a call would wait for this one

  def no_call(*args):
    raise AssertionError(f'a call to a lane: {args[:2]}')

  monkeypatch.setattr(pool, '_call', no_call)
  assert not pool.idle('b') and all(value.is_ready() for value in values)
  for value in values:
    np.testing.assert_array_equal(np.asarray(value), second)
  monkeypatch.undo()
  pool.wait_any([busy])
  np.testing.assert_array_equal(pool.fetch(moved_on), np.float32(second))  # the copy itself


def test_only_named_tasks_reach_a_lane(pool):
  with pytest.raises(TypeError, match=r'a tasks\.Task \(recipe and name\) expected'):
    pool.start('a', lambda: 0)


def test_a_task_reaches_a_lane_once_then_goes_by_its_number(pool, monkeypatch):
  calls = []
  pickled = pool._task_call
  monkeypatch.setattr(
    pool, '_task_call', lambda *args: calls.append(pickled(*args)[0]) or (calls[-1], [])
  )
  recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.25)  # new to both lanes
  for lane in ('a', 'a', 'b', 'b'):
    w = pool.run(lane, Task(recipe, 'init'), (1,))  # an equal task, a new object each time
    np.testing.assert_array_equal(
      pool.fetch(w), 0.25 * jax.random.normal(jax.random.key(1), (8, 4))
    )
  assert [b'build_layer_tasks' in call for call in calls] == [True, False, True, False]
  assert len(calls[1]) < len(calls[0]) / 2


def test_a_prepared_task_is_built_before_its_first_call_and_a_broken_one_fails_that_call(pool):
  prepared, probe, broken = (
    Task(TaskRecipe.of(lane_tasks.build_noted_tasks, tag=tag), 'built')
    for tag in ('prepared', 'probe', 'broken')
  )
  pool.prepare('b', [broken, prepared])
  # The probe's call, sent after it, finds the prepared recipe built (a lane runs what it
  # is sent in order) though no call of it has reached the lane: the broken one before it
  # did not stop it.
  assert pool.fetch(pool.run('b', probe)) == 'prepared probe'
  assert pool.fetch(pool.run('b', prepared)) == 'prepared probe'
  with pytest.raises(LaneError, match='the broken recipe cannot be built'):
    pool.run('b', broken)
  assert pool.fetch(pool.run('b', probe)) == 'prepared probe'  # the lane goes on
  assert not pool._preparing  # (its reply was read and dropped)


def test_a_call_pickles_what_only_cloudpickle_can_write():
  from jaxsgd.scheduler.lanes.pool import _dumps

  class Local:  # pickle refuses a local class; cloudpickle writes it by value
    def __init__(self, n):
      self.n = n

  assert pickle.loads(_dumps((Local(3), Ref(4)))[0])[0].n == 3
  assert pickle.loads(_dumps((1, Ref((4, (0,)))))[0])[1].key == (4, (0,))


def test_a_large_array_goes_beside_the_call_and_arrives_equal(pool):
  from jaxsgd.scheduler.lanes.pool import _dumps
  from jaxsgd.scheduler.lanes.wire import OUT_OF_BAND as _OUT_OF_BAND

  big = np.arange(_OUT_OF_BAND // 4, dtype=np.float32).reshape(-1, 64)  # _OUT_OF_BAND bytes
  small = np.arange(_OUT_OF_BAND // 8, dtype=np.float32)
  call, buffers = _dumps((big, small, Ref(1)))
  assert len(call) < small.nbytes + 1024  # the big array is not in the pickle
  assert [b.nbytes for b in buffers] == [big.nbytes]
  assert np.shares_memory(buffers[0], big)  # a view, not a copy
  out = pickle.loads(call, buffers=buffers)
  np.testing.assert_array_equal(out[0], big)
  np.testing.assert_array_equal(out[1], small)
  # Through a lane: a task on it reads the array that went beside its call.
  recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.25)
  doubled = pool.run('a', Task(recipe, 'add'), (big, big))
  np.testing.assert_array_equal(pool.fetch(doubled), big + big)


def test_put_sends_driver_values_to_a_lane(pool):
  params = {'w': jax.numpy.ones((2, 3)), 'b': np.arange(3, dtype=np.int32)}
  handle = pool.put('b', params)
  assert handle.lane == 'b' and handle.nbytes == 2 * 3 * 4 + 3 * 4
  fetched = pool.fetch(handle)
  np.testing.assert_array_equal(fetched['w'], np.ones((2, 3)))
  np.testing.assert_array_equal(fetched['b'], np.arange(3))


def test_early_handles_let_the_driver_run_ahead_of_the_lanes(pool):
  x, g = X[:, None].repeat(2, 1).reshape(6, 8), G[:, None].repeat(2, 1).reshape(6, 4)
  w = pool.run('a', task('init'), (5,))
  first = pool.start('a', task('forward'), (w, x))
  assert pool.early(first) is None  # not known before this task has run on such shapes
  pool.wait_any([first])
  y, vjp = first.result()
  # Same shapes: the handles are known at once; chain three tasks without waiting.
  second = pool.start('a', task('forward'), (w, 2 * x))
  y2, vjp2 = pool.early(second)
  grads = pool.start('b', task('backward'), (vjp2, g))  # moves vjp2 a -> b, in order
  total = pool.start('b', task('add'), (y2, y))
  for pending in (second, grads, total):
    pool.wait_any([pending])
  assert second.result() == (y2, vjp2)  # the same handles, not copies
  np.testing.assert_array_equal(
    pool.fetch(total.result()), pool.fetch(y) + pool.fetch(second.result()[0])
  )
  reference = pool.run('a', task('backward'), (pool.run('a', task('forward'), (w, 2 * x))[1], g))
  for got, want in zip(grads.result(), reference):
    np.testing.assert_array_equal(pool.fetch(got), pool.fetch(want))


@pytest.mark.parametrize('hastened', [False, True])
def test_a_task_started_ahead_is_heard_with_the_next_reply_unless_hastened(pool, hastened):
  """Started `ahead` (its handles known), a task's end is held by its lane while two calls
  are queued behind it: the driver hears it only with the next reply the lane sends, the
  second task's (one call behind it), before the last call (0.3 s) has ended. `hasten`
  (the driver now waits for it) has it sent at its end, before the second has ended."""
  seconds = np.float64(0.3)  # (an array: a Python float is part of the signature)
  pool.run('a', task('hang'), (np.float64(0.0),))  # the outline known: its handles can be
  first = pool.start('a', task('hang'), (seconds,), ahead=True)
  second = pool.start('a', task('hang'), (seconds,), ahead=True)
  last = pool.start('a', task('hang'), (seconds,))
  assert (first.held, second.held, last.held) == (True, True, False)
  if hastened:
    pool.hasten(first)
  pool.wait_any([first])
  heard = time.time()
  for pending in (second, last):
    pool.wait_any([pending])
  if hastened:
    assert heard < second.ended
  else:
    assert second.ended <= heard < last.ended


def test_a_lane_describes_a_result_only_until_it_has_kept_one_of_the_same_shapes(pool, monkeypatch):
  # A result's outline reads every leaf of it, on the lane between two calls: a lane
  # sends one per task and argument shapes, then the driver reuses it.
  described = []  # (lane, whether the reply carried an outline), per task reply
  heard = pool._heard

  def spy(event):
    lane, _, kind, number, value = event
    if kind == 'ok' and number in pool._unfinished:
      described.append((lane, value[0] is not None))
    heard(event)

  monkeypatch.setattr(pool, '_heard', spy)

  def forward(lane, w, x):
    pending = pool.start(lane, task('forward'), (w, x))
    pool.wait_any([pending])
    return pending.result()

  w = pool.run('a', task('init'), (4,))
  x = np.linspace(-1, 1, 56, dtype=np.float32).reshape(7, 8)  # shapes no other test uses
  described.clear()
  y1, _ = forward('a', w, x)
  y2, vjp2 = forward('a', w, 2 * x)  # the same shapes: not described
  forward('a', w, x[:5])  # other shapes: described
  y_b, _ = forward('b', w, 2 * x)  # the same shapes on another lane: described there
  forward('b', w, x)
  assert described == [('a', True), ('a', False), ('a', True), ('b', True), ('b', False)]
  assert (y2.nbytes, y2.description) == (y1.nbytes, y1.description)
  np.testing.assert_array_equal(pool.fetch(y2), pool.fetch(y_b))  # same task, same inputs
  # An undescribed result's parts are kept as a described one's: its VJP moves a -> b.
  g = np.linspace(1, 2, 28, dtype=np.float32).reshape(7, 4)
  moved = pool.run('b', task('backward'), (vjp2, g))
  here = pool.run('a', task('backward'), (vjp2, g))
  for got, want in zip(moved, here):
    np.testing.assert_array_equal(pool.fetch(got), pool.fetch(want))


def test_a_replaced_lanes_process_describes_its_results_again(head):
  # The new process has checked no result's structure: it is asked to, as a new lane is.
  described = []

  with LanePool(LanePlacement.spread(['r']), address=head.address, verbose=False) as lanes:
    heard = lanes._heard

    def spy(event):
      _, _, kind, number, value = event
      if kind == 'ok' and number in lanes._unfinished:
        described.append(value[0] is not None)
      heard(event)

    lanes._heard = spy

    def grads():  # init, forward, backward on the lane: three new values
      w = lanes.run('r', task('init'), (6,))
      _, vjp = lanes.run('r', task('forward'), (w, X))
      return lanes.fetch(lanes.run('r', task('backward'), (vjp, G))[0])

    before = grads()
    lanes.run('r', task('forward'), (lanes.run('r', task('init'), (6,)), X))
    lanes.replace('r')
    np.testing.assert_array_equal(grads(), before)
  # Before: init, forward, backward described, then init and forward known; after: all anew.
  assert described == [True, True, True, False, False, True, True, True]


def test_a_lane_whose_task_lost_an_input_is_reset_not_replaced(head, monkeypatch):
  """A task on a live lane that was taking in a value of a lane process since lost and
  replaced fails naming that lane (`LaneError.lost_input`), known from the failure itself
  (no wait for a death). `reset` keeps the live lane's process and forgets its unanswered
  calls: it runs a new task at once, behind those; their replies are dropped (read
  already, or when they come) and their results freed in the lane."""
  with LanePool(LanePlacement.spread(['s', 't']), address=head.address, verbose=False) as lanes:
    lanes.run('s', task('init'), (2,))  # its outline known: `early` hands out the next one's
    busy = lanes.start('s', task('hang'), (30.0,))
    made = lanes.start('s', task('init'), (2,))  # queued behind the hang
    taking = lanes.start('t', task('forward'), (lanes.early(made), X))  # waits for its copy
    queued = lanes.start('t', task('add'), (np.float32(1), np.float32(2)))  # behind it
    os.kill(lanes.pids()['s'], signal.SIGKILL)
    with pytest.raises(LaneError, match=r"^lane 's' on host \S+: pid \d+: its process died"):
      lanes.wait_all([busy, made, taking, queued])
    lanes.replace('s')
    waited = []
    monkeypatch.setattr(lanes, '_dead_end', lambda *names, **_: waited.append(names))
    with pytest.raises(LaneError) as lost:
      lanes.wait_any([taking])
    assert (lost.value.lane, lost.value.lost_input, waited) == ('t', 's', []), lost.value
    assert "a value it takes in was in the lost process of lane 's'" in str(lost.value)
    monkeypatch.undo()
    pid = lanes.pids()['t']
    after = lanes.start('t', task('hang'), (2.0,))  # unanswered at the reset, whatever the load
    lanes.reset('t')
    # (the call queued behind the failed task may have answered before the reset)
    assert lanes.unfinished('t') == 0 and after.key in lanes._forgotten
    assert set(lanes._forgotten) <= {queued.key, after.key}
    assert lanes.fetch(lanes.run('t', task('add'), (np.float32(2), np.float32(3)))) == 5
    assert lanes.pids()['t'] == pid and 't' not in lanes.dead_lanes()
    lanes.settle()
    assert not lanes._replies and not lanes._forgotten  # heard, and dropped
    assert not queued.done and not after.done
    assert lanes.held('t') == 0  # the forgotten calls' results freed, as the add's


def test_a_value_of_a_replaced_lanes_lost_process_fails_where_it_is_used(head):
  """A handle to a value the lost process of a replaced lane held is void: a task given
  one fails naming that lane (`LaneError.lost_input`), on another lane (its copy) or on
  the new process itself, and so does a fetch of one; the lanes go on. The new process
  never had the value: an export of it waited there for ever, and the lane taking the
  copy in with it (an LPP-SGD worker holding its replica's parameters from before the
  replica was replaced: the run never ended)."""
  with LanePool(LanePlacement.spread(['s', 't']), address=head.address, verbose=False) as lanes:
    old = lanes.run('s', task('init'), (2,))
    lanes.replace('s')
    with pytest.raises(LaneError) as lost:  # (a fetch, not a task: named all the same)
      lanes.fetch(old)
    assert (lost.value.lane, lost.value.lost_input) == ('s', 's'), lost.value
    for lane in ('t', 's'):
      taking = lanes.start(lane, task('forward'), (old, X))
      with pytest.raises(LaneError) as lost:
        lanes.wait_any([taking], timeout=30)  # (None, not a failure, if it waited on)
      assert (lost.value.lane, lost.value.lost_input) == (lane, 's'), lost.value
      assert "was in the lost process of lane 's'" in str(lost.value)
      lanes.reset(lane)
      assert lanes.fetch(lanes.run(lane, task('add'), (np.float32(2), np.float32(3)))) == 5
    new = lanes.run('s', task('init'), (2,))  # the new process's own values move as ever
    _, vjp = lanes.run('t', task('forward'), (new, X))
    np.testing.assert_array_equal(
      lanes.fetch(lanes.run('t', task('backward'), (vjp, G))[0]),
      lanes.fetch(lanes.run('s', task('backward'), (vjp, G))[0]),
    )


def test_a_vjp_moves_when_its_task_made_only_arrays_before(pool):
  # A lane notes how a result was made only where it may not pickle: a task whose first
  # result was arrays alone still has its later VJP rebuilt on another lane.
  w = pool.run('a', task('init'), (2,))
  pool.run('a', task('by_shape'), (w, X[:2]))  # arrays only
  _, vjp = pool.run('a', task('by_shape'), (w, X))  # a VJP (3 rows)
  there = pool.run('b', task('backward'), (vjp, G))  # the VJP moves a -> b
  w_host = np.asarray(pool.fetch(w))
  reference = jax.jit(lambda w, x, g: jax.vjp(lane_tasks.layer, w, x)[1](g))
  for got, want in zip(there, reference(w_host, X, G)):
    np.testing.assert_array_equal(pool.fetch(got), want)


def test_wait_any_returns_every_task_once_across_lanes(pool):
  before = time.time()
  pending = [
    pool.start(lane, task('add'), (np.float32(i), np.float32(10)))
    for i, lane in enumerate(['a', 'b', 'a', 'b'])
  ]
  after = time.time()
  sent = [p.sent for p in pending]
  assert before <= sent[0] <= sent[1] <= sent[2] <= sent[3] <= after  # the driver's clock
  finished = []
  while len(finished) < len(pending):
    finished.append(pool.wait_any([p for p in pending if not p.done]))
  assert sorted(pool.fetch(p.result()) for p in finished) == [10, 11, 12, 13]
  assert all(p.sent <= p.entered <= p.started <= p.ended for p in finished)
  for lane in 'ab':  # a lane takes its calls one at a time, in the order started
    calls = [p for p in pending if p.lane == lane]
    assert all(a.ended <= b.entered for a, b in zip(calls, calls[1:]))
  assert pool.wait_any([pool.start('a', task('hang'), (0.5,))], timeout=0.01) is None


def test_a_lane_times_the_cpu_its_process_used_over_each_task(pool):
  """`Pending.cpu`: the CPU seconds the lane's process used from the task's start to its
  end: at least what a computing task spun for, next to nothing of a sleeping one's."""
  spinning = pool.start('a', task('spin'), (0.2,))
  sleeping = pool.start('b', task('hang'), (0.2,))
  finished = []
  while len(finished) < 2:
    finished.append(pool.wait_any([p for p in (spinning, sleeping) if not p.done]))
  assert 0.2 <= spinning.cpu < 0.3  # (the lane's other threads idle meanwhile)
  assert 0 <= sleeping.cpu < 0.1 and sleeping.ended - sleeping.started >= 0.2


def test_a_vjp_moves_lane_to_lane_rebuilt_from_its_recipe(pool):
  w = pool.run('a', task('init'), (2,))
  _, vjp = pool.run('a', task('forward'), (w, X))
  here = pool.run('a', task('backward'), (vjp, G))
  there = pool.run('b', task('backward'), (vjp, G))  # the VJP moves a -> b
  assert [h.lane for h in there] == ['b', 'b']
  moved = pool.move(vjp, 'b')
  again = pool.run('b', task('backward'), (moved, G))
  for a, b, c in zip(here, there, again):
    np.testing.assert_array_equal(pool.fetch(a), pool.fetch(b))
    np.testing.assert_array_equal(pool.fetch(a), pool.fetch(c))
  w_host = np.asarray(pool.fetch(w))
  reference = jax.jit(lambda w, x, g: jax.vjp(lane_tasks.layer, w, x)[1](g))
  for got, want in zip(here, reference(w_host, X, G)):
    np.testing.assert_array_equal(pool.fetch(got), want)


def test_a_copy_is_waited_for_only_by_the_call_that_needs_it(pool):
  """A copy is taken in by the first call on its lane that uses it: until then the
  lane's other calls do not wait for the source lane to export it. (Taken in by a call
  of its own, sent with the copy, it held up every call queued behind it: DDG's first
  stage idled waiting for a gradient while the next stage waited for an activation.)"""
  w = pool.run('a', task('init'), (5,))
  twice = pool.run('a', task('add'), (w, w))  # its outline is known from now on
  busy = pool.start('a', task('hang'), (1.5,))
  y = pool.start('a', task('add'), (twice, w))  # behind `hang` on lane a
  moved = pool.move(pool.early(y), 'b')  # exported once `hang` and `y` are done
  other = pool.start('b', task('add'), (np.float32(1), np.float32(2)))
  assert pool.wait_any([other, busy]) is other  # lane b did not wait for lane a
  used = pool.start('b', task('add'), (moved, w))  # takes the copy in: waits for lane a
  for pending in (busy, y, used):
    pool.wait_any([pending])
  assert used.started >= busy.ended
  # It entered lane b while lane a still computed, and waited there for its import.
  assert used.sent <= used.entered < busy.ended <= used.started
  np.testing.assert_allclose(pool.fetch(used.result()), 4 * pool.fetch(w), rtol=1e-6)
  np.testing.assert_array_equal(pool.fetch(other.result()), 3)


def test_an_export_waiting_for_its_value_holds_up_no_export_behind_it(pool):
  """A lane exports a value that exists at once, though an export asked for earlier
  still waits for its value to be made. (Served strictly in order, PD-ASGD's backward
  worker idled for the residuals of an earlier batch, long made on the forward lane,
  behind the export of the next batch's, which waited for that batch's forward.)"""
  w = pool.run('a', task('init'), (6,))
  twice = pool.run('a', task('add'), (w, w))  # its outline is known from now on
  busy = pool.start('a', task('hang'), (1.5,))
  late = pool.start('a', task('add'), (twice, w))  # made once `hang` is done
  late_on_b = pool.move(pool.early(late), 'b')  # asked first: waits for `late`
  w_on_b = pool.move(w, 'b')  # asked second: `w` exists
  early = pool.start('b', task('add'), (w_on_b, w_on_b))
  assert pool.wait_any([early, busy]) is early  # lane a's export of `w` did not wait
  used = pool.start('b', task('add'), (late_on_b, w_on_b))
  for pending in (busy, late, used):
    pool.wait_any([pending])
  assert early.ended < busy.ended <= used.started
  np.testing.assert_allclose(pool.fetch(early.result()), 2 * pool.fetch(w), rtol=1e-6)
  np.testing.assert_allclose(pool.fetch(used.result()), 4 * pool.fetch(w), rtol=1e-6)


def test_a_lane_reports_the_time_its_export_thread_gave_each_copy(pool):
  """`export_times`: each copy a lane sent since last asked, under the number `move`
  gave it, with the seconds from its value existing there to its last frame written —
  a part of the copy's span from there to its arrival (`exported`), and asked once."""
  w = pool.run('a', task('init'), (7,))
  pool.export_times('a')  # (what earlier tests' copies left)
  exports = []
  moved = pool.move(w, 'b', exports=exports)
  used = pool.start('b', task('add'), (moved, moved))
  pool.wait_any([used])
  pool.settle()
  start, arrival = pool.exported(exports)
  spans = pool.export_times('a', exports)  # (noted once the write returned: may be late)
  assert list(spans) == exports
  assert 0 < spans[exports[0]] <= arrival - start
  assert pool.export_times('a') == {}


def test_a_message_of_handles_moves_as_one_pytree(pool):
  w = pool.run('a', task('init'), (3,))
  y, _ = pool.run('a', task('forward'), (w, X))
  message = (7, {'y': y, 'w': w})
  moved = pool.move(message, 'b')
  assert moved[0] == 7 and {h.lane for h in moved[1].values()} == {'b'}
  assert pool.nbytes(message) == pool.nbytes(moved) == (3 * 4 + 8 * 4) * 4
  np.testing.assert_array_equal(pool.fetch(moved[1]['y']), pool.fetch(y))


def test_a_value_that_cannot_be_rebuilt_is_refused_when_moved(pool):
  w = pool.run('a', task('init'), (4,))
  _, vjp = pool.run('a', task('forward'), (w, X))
  same = pool.run('a', task('same'), (vjp,))  # made from a VJP: no picklable recipe
  pending = pool.start('b', task('backward'), (same, G))
  with pytest.raises(
    LaneError,
    match=r"lane 'b' on host .*moving .* to it: .*cannot be "
    'moved: its structure does not pickle',
  ):
    while pool.wait_any([pending]) is not pending:
      pass


def test_a_task_that_raises_names_its_lane_and_host(pool):
  host = pool.info['b']['host']
  pending = pool.start('b', task('fail'), (X,))
  with pytest.raises(
    LaneError,
    match=rf"lane 'b' on host {host}: .*fail.* raised: "
    r'ValueError: bad input of shape \(3, 8\)',
  ):
    pool.wait_any([pending])
  assert pool.fetch(pool.run('b', task('add'), (np.float32(1), np.float32(1)))) == 2  # lives on


@pytest.mark.alone  # bounds how long the lanes take to end (5 s)
def test_a_killed_lane_stops_the_wait_within_5s_naming_it(head):
  with LanePool(LanePlacement.spread(['c', 'd']), address=head.address, verbose=False) as lanes:
    busy = lanes.start('c', task('hang'), (1.0,))
    os.kill(lanes.pids()['d'], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
      LaneError,
      match=rf"lane 'd' on host {lanes.info['d']['host']}: "
      r'pid \d+: its process died',
    ):
      lanes.wait_any([busy])
    assert time.monotonic() - start < 5
    lanes.remove('d')  # tolerate the loss: the other lane carries on
    assert lanes.fetch(lanes.run('c', task('add'), (np.float32(2), np.float32(3)))) == 5
  assert gone(lanes.pids().values()) == []


def test_a_lane_that_dies_while_the_pool_starts_is_named_and_no_lane_is_left(head, monkeypatch):
  """A lane whose process dies at the pool's first call to it (the fault hook's `info`),
  before any lane is linked: the start raises `LaneError` naming it (the death heard
  either from Ray's watch or from that call's error), and the other lane is ended."""
  monkeypatch.setenv(FAULT_VAR, 'f:info:1:kill')
  before = set(_lane_processes(head))
  with pytest.raises(LaneError, match=r"^lane 'f' on host \S+: at start: its process died"):
    LanePool(LanePlacement.spread(['e', 'f']), address=head.address, verbose=False)
  assert gone(set(_lane_processes(head)) - before) == []


def _death_of(lanes: LanePool, lane: str) -> BaseException:
  """The error `lane`'s death is known by: Ray's, which an actor lane's finished watch
  raises; a forked lane's watch says how it ended (`forked.LaneEnded`, as its start
  raises if it ends then)."""
  try:
    ended = cluster.get(lanes._watch[lane])
  except Exception as error:  # pylint: disable=broad-except
    return error
  return LaneEnded(ended)


def test_a_death_that_reaches_a_task_on_a_live_lane_names_the_dead_lane(head):
  """A copy taken in from a lane that died on its way raises that death inside the task
  taking it in (a killed ASGD worker's push, inside the server's update), and a copy of
  that task's result then fails too; whichever the driver hears of first, the error
  names the lane whose process is gone, not the live lane the death passed through."""
  from jaxsgd.scheduler.lanes import cluster

  with LanePool(LanePlacement.spread(['x', 'y']), address=head.address, verbose=False) as lanes:
    os.kill(lanes.pids()['x'], signal.SIGKILL)
    assert lanes._dead_end('x', within=10) == 'x'  # the cluster has noticed
    death = _death_of(lanes, 'x')  # the error x's death is known by wherever it reaches
    assert cluster.is_death(death)
    error = lanes._describe('y', death, task('same'), None)
    assert error.lane == 'x' and re.search(r'pid \d+: its process died', str(error)), error
    lanes.remove('x')
    assert lanes.fetch(lanes.run('y', task('add'), (np.float32(2), np.float32(3)))) == 5
    # A lane that died under its own task is still the one named.
    os.kill(lanes.pids()['y'], signal.SIGKILL)
    assert lanes._dead_end('y', within=10) == 'y'
    error = lanes._describe('y', _death_of(lanes, 'y'), task('same'), None)
    assert error.lane == 'y' and 'while running' in str(error), error


def test_a_failed_copy_is_blamed_on_the_call_that_was_to_make_its_value(head):
  """An export of a value whose task failed fails at once on its lane, and the driver may
  hear of that before the task's own failure: the copy's error (`MakerFailed`, naming
  that call) waits for the call that was to make the value and names that call's failure,
  not the lane the copy was going to."""
  with LanePool(LanePlacement.spread(['x', 'y']), address=head.address, verbose=False) as lanes:
    lanes.start('x', task('hang'), (1.0,))  # the failing call below ends a second later
    failing = lanes.start('x', task('fail'), (np.zeros(3, np.float32),))
    value = Handle(lanes, 'x', (failing.key, ()), 12, 'float32[3]')
    export = MakerFailed('x', failing.key, value.key)
    error = lanes._error('y', export, f'moving {value!r} to it', key=failing.key + 1)
    assert error.lane == 'x' and 'bad input of shape (3,)' in str(error), error


def test_a_failure_blamed_on_another_lane_is_still_read_once_that_lane_is_dealt_with(head):
  """A task that fails after an earlier task on another lane failed is blamed on that one
  (`_error`: its failure is the likely cause). Its own failure must still be read: the
  caller deals with the lane blamed (replaces it, say) and waits again. Taken with the
  first error, it never was, and an elastic run that replaced the blamed lane waited for
  this task for ever (every step done, the run never ended)."""
  with LanePool(LanePlacement.spread(['x', 'y']), address=head.address, verbose=False) as lanes:
    earlier = lanes.start('x', task('fail'), (np.zeros(3, np.float32),))
    later = lanes.start('y', task('fail'), (np.zeros(2, np.float32),))
    while not {earlier.key, later.key} <= set(lanes._replies):
      lanes._hear(time.monotonic() + 10)
    with pytest.raises(LaneError) as blamed:
      lanes.wait_any([later])
    assert blamed.value.lane == 'x' and 'shape (3,)' in str(blamed.value), blamed.value
    lanes.replace('x')
    with pytest.raises(LaneError) as own:
      lanes.wait_any([later], timeout=10)  # (None after 10 s if its failure was lost)
    assert own.value.lane == 'y' and 'shape (2,)' in str(own.value), own.value


def _lane_processes(head) -> list[int]:
  lanes = []
  for process in head.processes():
    try:
      if 'LaneRuntime' in ' '.join(process.cmdline()):
        lanes.append(process.pid)
    except (psutil.Error, OSError):  # it ended meanwhile (a helper Ray started, say)
      pass
  return lanes


def test_cpu_lanes_are_forked_from_one_process_per_host_unless_asked_to_be_actors(
  head, monkeypatch
):
  """A lane without a GPU is a process forked by its host's `LaneHost` (which imported
  JAX once) — a child of that process, named as a lane — unless `FORK_VAR` is 0: then a
  Ray actor of its own. Both run the same task to the same bits."""
  results, parents = {}, {}
  for fork in ('1', '0'):
    monkeypatch.setenv(cluster.FORK_VAR, fork)
    placement = LanePlacement.spread(['f', 'g'])
    with LanePool(placement, address=head.address, verbose=False) as lanes:
      processes = [psutil.Process(pid) for pid in lanes.pids().values()]
      titles = [' '.join(p.cmdline()).strip() for p in processes]
      parents[fork] = {(p.ppid(), psutil.Process(p.ppid()).name()) for p in processes}
      w = lanes.run('f', task('init'), (3,))
      y, vjp = lanes.run('g', task('forward'), (w, X))  # w moved f -> g
      dw, dx = lanes.run('f', task('backward'), (vjp, G))  # the VJP moved back
      results[fork] = (lanes.fetch(y), lanes.fetch(dw), lanes.fetch(dx))
    if fork == '1':
      assert titles == ['jaxsgd::LaneRuntime f (forked)', 'jaxsgd::LaneRuntime g (forked)']
    else:
      assert all('LaneRuntime' in t and 'forked' not in t for t in titles), titles
  assert len(parents['1']) == 1 and 'LaneHost' in parents['1'].pop()[1]  # one host, both
  assert {name for _, name in parents['0']} == {'raylet'}  # actor lanes: the raylet's workers
  jax.tree.map(np.testing.assert_array_equal, results['1'], results['0'])


def _host_driver(address: str, scenario: str) -> dict:
  """What `lane_host_driver.py` found running `scenario` on its own connection."""
  with tempfile.TemporaryDirectory(prefix='lane-host-') as folder:
    out = os.path.join(folder, 'out.json')
    done = subprocess.run(
      [sys.executable, os.path.join(HERE, 'lane_host_driver.py'), address, out, scenario],
      env={**os.environ, 'PYTHONPATH': os.getcwd()},
      capture_output=True,
      text=True,
      timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
      return json.load(f)


def test_a_lane_host_that_died_is_replaced_at_the_next_pools_start(head):
  """A forked lane's host killed, on a connection that outlives the pool: the pool's next
  task fails with its lane's death, and a later pool on the same connection starts its
  lanes on a new host and runs, once Ray has heard of the death (a few ms; a pool
  started before that fails at start); before, every later pool asked the dead host."""
  found = _host_driver(head.address, 'host-dies')
  assert 'its process died' in found['said'], found
  assert found['new_host'] != found['host'] and found['shape'] == [8, 4]


def test_lanes_killed_that_nobody_watched_are_reaped_by_their_host(head):
  """Two lanes started with the connection, killed without a watch (a run stopped
  before its pool took them): both processes are gone within seconds, not zombies of
  their host until it ends."""
  found = _host_driver(head.address, 'unwatched-kill')
  assert len(found['pids']) == 2 and found['left'] == {}, found


def test_a_heads_lane_processes_are_found_while_they_run(head, pool):
  """`_lane_processes`, with which the tests check that no lane is left on a head after a
  run, finds the lanes a pool runs there."""
  assert set(pool.pids().values()) <= set(_lane_processes(head))


def spy_pools(monkeypatch) -> list[LanePool]:
  """Every `LanePool` that starts its lanes from now on, in order (for `started_early`)."""
  pools = []
  start_lanes = LanePool._start_lanes  # pylint: disable=protected-access

  def spied(self, specs):
    pools.append(self)
    return start_lanes(self, specs)

  monkeypatch.setattr(LanePool, '_start_lanes', spied)
  return pools


def _new_lanes(head, before: set, count: int, within: float = 60.0) -> set[int]:
  """The lane processes on `head` not in `before`, once there are `count` of them."""
  deadline = time.monotonic() + within
  while len(new := set(_lane_processes(head)) - before) < count:
    assert time.monotonic() < deadline, f'{len(new)} of {count} lane processes started'
    time.sleep(0.05)
  return new


def test_lanes_started_with_the_connection_are_taken_by_the_pool_placing_them(head, pool):
  """`cluster.connect_soon(address, lanes)` starts the run's lane processes while the
  driver builds its model (here Ray is connected already, so they start at once; a
  driver's own cluster, started in the background: `background_start.py`). The pool
  placing the same lanes takes those processes (and their key) rather than starting its
  own, and ends an early one it does not place; `abandon` ends the early lanes no pool
  took. Nothing is left either way."""
  early = LanePlacement.spread(['e0', 'e1']).lanes
  before = set(_lane_processes(head))
  try:
    cluster.connect_soon(head.address, early)
    started = _new_lanes(head, before, 2)
    with LanePool(LanePlacement.spread(['e0']), address=head.address, verbose=False) as lanes:
      assert lanes.started_early == ('e0',)
      assert lanes.pids()['e0'] in started
      assert gone(started - {lanes.pids()['e0']}) == []  # e1: placed by no pool
      recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=1.0)
      assert float(lanes.fetch(lanes.run('e0', Task(recipe, 'add'), (1.0, 2.0)))) == 3.0
    assert gone(started) == []
    cluster.connect_soon(head.address, early)
    started = _new_lanes(head, before, 2)
    cluster.abandon()
    assert gone(started) == []
    # A pool with an environment of its own, or placing the lane otherwise (unpinned),
    # starts its lanes itself.
    for placement, env in (
      (LanePlacement(early[:1]), {'JAXSGD_TEST_VARIABLE': '1'}),
      (LanePlacement((LaneSpec('e0'),)), None),
    ):
      cluster.connect_soon(head.address, early[:1])
      started = _new_lanes(head, before, 1)
      with LanePool(placement, address=head.address, env=env, verbose=False) as lanes:
        assert lanes.started_early == () and lanes.pids()['e0'] not in started
        assert gone(started) == []
  finally:
    cluster.abandon()
  assert gone(set(_lane_processes(head)) - before) == []


def test_lanes_go_to_the_host_they_name_and_a_wrong_host_is_refused(head, pool):
  node = pool.info['a']['host']  # this machine, as the cluster names it
  with LanePool(
    LanePlacement((LaneSpec('here', host=node),)), address=head.address, verbose=False
  ) as lanes:
    assert lanes.info['here']['host'] == node
  before = _lane_processes(head)
  with pytest.raises(
    ValueError,
    match=rf"placement: lane 'far': host '10.255.0.1' is not "
    rf"a node of the Ray cluster; its nodes: \['{node}'\]",
  ):
    LanePool(
      LanePlacement((LaneSpec('ok', host=node), LaneSpec('far', host='10.255.0.1'))),
      address=head.address,
      verbose=False,
    )
  assert gone(set(_lane_processes(head)) - set(before)) == []


def _driver(address: str, *flags: str) -> tuple[subprocess.Popen, dict]:
  """Starts `lane_driver.py` and waits (at most two minutes) for the record it writes
  once its lanes are up; if none comes, the driver is killed (its lanes end with it)."""
  folder = tempfile.mkdtemp(prefix='lane-driver-')
  out = os.path.join(folder, 'started.json')
  process = subprocess.Popen(
    [sys.executable, os.path.join(HERE, 'lane_driver.py'), address, out, *flags],
    cwd=os.getcwd(),
    env={**os.environ, 'PYTHONPATH': os.getcwd()},
  )
  try:
    deadline = time.monotonic() + 120
    while not os.path.exists(out):
      ended = process.poll() is not None
      assert not ended or os.path.exists(out), 'the driver ended before its lanes were up'
      assert time.monotonic() < deadline, "the driver's lanes were not up within 120 s"
      time.sleep(0.05)
    with open(out) as f:
      return process, json.load(f)
  except BaseException:
    process.kill()
    process.wait()
    raise
  finally:
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(
  not {0, 1} <= os.sched_getaffinity(0), reason='needs cores 0 and 1 for its two lanes'
)
def test_driver_figures_with_every_core_busy_are_measured_on_a_lane_per_core(head):
  from jaxsgd.scheduler import lane_timing

  busy = lane_timing.dispatch_tasks()['busy']
  assert float(busy(np.float32(3.0))) == 3.0  # a chain of it carries its value unchanged
  figures = lane_timing.measure_loaded_driver(cores=(0, 1), address=head.address, tasks=6)
  assert set(figures) == {'driver_loaded', 'driver_latency_loaded', 'driver_loaded_lanes'}
  assert figures['driver_loaded_lanes'] == 2.0
  # The driver's thread spends CPU on every event; the latency is the median hear delay
  # less that (it may be 0, never negative).
  assert figures['driver_loaded'] > 0 and figures['driver_latency_loaded'] >= 0


@pytest.mark.alone  # bounds how long the lanes take to end (5 s)
def test_sigterm_of_the_driver_ends_every_lane(head):
  process, started = _driver(head.address)
  time.sleep(0.5)  # inside its wait
  process.send_signal(signal.SIGTERM)
  assert process.wait(timeout=10) != 0
  assert gone(started['lanes']) == []


@pytest.mark.alone  # bounds how long the lanes take to end (5 s)
def test_a_sigterm_whose_interrupt_was_lost_still_ends_the_run(head):
  """Python runs a signal handler wherever the main thread is; inside a garbage-collector
  callback its `KeyboardInterrupt` is printed and dropped. The pool's waits look again
  (every `_STOP_CHECK` s), so the run still ends at once, not after its minute-long task."""
  process, started = _driver(head.address, 'lost-sigterm')
  assert process.wait(timeout=10) != 0
  assert gone(started['lanes']) == []


@pytest.mark.alone  # bounds how long the lanes take to end (5 s)
@pytest.mark.slow
def test_ctrl_c_of_a_driver_with_its_own_cluster_leaves_no_process():
  process, started = _driver('local')
  assert len(started['started']) > len(started['lanes'])  # Ray's own processes too
  time.sleep(0.5)
  process.send_signal(signal.SIGINT)
  assert process.wait(timeout=20) != 0
  assert gone(started['started'] + started['lanes'], within=10) == []


@pytest.mark.slow
@pytest.mark.parametrize('use', ['use', 'abandon', 'crash'])
def test_a_cluster_started_in_the_background_serves_a_pool_and_leaves_no_process(use, tmp_path):
  """`cluster.connect_soon` starts the run's cluster in a thread while the driver builds
  its model. Ray's processes die with the thread that started them (their parent-death
  signal is that thread's): they lived only while it ran, and the pool opened after it
  had returned found no cluster. Used or abandoned, nothing of it is left. The cluster
  runs none of Ray's daemons that it has no use for (`cluster._IDLE_DAEMONS`, the API
  server), and keeps no idle Ray worker once the lanes are up (`_without_idle_workers`:
  each wakes every 10 ms for the whole run); with no log monitor to show a lane's last
  words, the error of a lane that died says them."""
  out = tmp_path / 'outcome.json'
  hook = {FAULT_VAR: 'a:add:1:kill'} if use == 'crash' else {}
  done = subprocess.run(
    [sys.executable, os.path.join(HERE, 'background_start.py'), use, str(out)],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'PYTHONPATH': os.getcwd(), **hook},
  )
  assert done.returncode == 0, done.stderr[-3000:]
  outcome = json.loads(out.read_text())
  assert len(outcome['started']) >= 2  # Ray's GCS and raylet at least
  if use != 'abandon':  # (abandoned as soon as it began: not all up yet)
    commands = ' '.join(outcome['commands'].values())
    assert 'gcs_server' in commands and 'raylet' in commands, commands
    assert 'monitor.py' not in commands, commands  # the autoscaler's, nor the log monitor
    assert 'dashboard.py' not in commands, commands  # nor the API server
  assert outcome['result'] == (3.0 if use == 'use' else None)
  assert outcome['taken'] == ([] if use == 'abandon' else ['a'])  # started as it came up
  assert outcome['idle'] == []
  if use == 'crash':
    assert re.search(
      r"^lane 'a' on host \S+: pid \d+: its process died \(killed, or crashed\)\. Its last "
      rf"output \(standard error\):\n  injected fault \({FAULT_VAR}\): killed in task 'add'$",
      outcome['error'],
    ), outcome['error']
  assert gone(outcome['started']) == []


def test_a_head_started_here_skips_the_api_server_only_where_rays_method_is_the_one_known(
  monkeypatch,
):
  """`cluster._without_api_server` replaces Ray's `Node.start_api_server` while a head
  starts, and puts it back after; a method of another signature (another Ray) is left
  alone, so the head starts as Ray's default."""
  from ray._private.node import Node

  from jaxsgd.scheduler.lanes import cluster

  def known(self, *, include_dashboard, raise_on_failure):
    return 'started'

  def other(self, *, include_dashboard, raise_on_failure, port=None):
    return 'started'

  for method, skipped in ((known, True), (other, False)):
    monkeypatch.setattr(Node, 'start_api_server', method)
    with cluster._without_api_server():
      started = Node.start_api_server(None, include_dashboard=False, raise_on_failure=False)
    assert started == (None if skipped else 'started'), method
    assert Node.start_api_server is method  # put back


def test_a_head_started_here_gives_its_raylet_no_idle_worker_unless_the_user_says(monkeypatch):
  """`cluster._without_idle_workers` gives the raylet's environment (Ray's
  `RayParams.env_vars`) `RAY_num_workers_soft_limit=0` beside what the caller gives it,
  with the idle daemons left out too (both patches read Ray's own signature), and puts
  `RayParams` back after; this process's environment is left as it was. A value the
  user's environment sets is left to the raylet, which inherits it."""
  from ray._private.parameter import RayParams

  original = RayParams.__init__
  monkeypatch.delenv(cluster.IDLE_WORKERS_VAR, raising=False)
  with cluster._without_idle_daemons(), cluster._without_idle_workers():
    params = RayParams(env_vars={'A': '1'})
  assert params.env_vars == {cluster.IDLE_WORKERS_VAR: '0', 'A': '1'}
  assert (params.no_monitor, params.include_log_monitor) == (True, False)
  assert RayParams.__init__ is original and cluster.IDLE_WORKERS_VAR not in os.environ
  monkeypatch.setenv(cluster.IDLE_WORKERS_VAR, '2')
  with cluster._without_idle_workers():
    assert RayParams.__init__ is original
    assert RayParams(env_vars={'A': '1'}).env_vars == {'A': '1'}


def test_a_background_start_that_hangs_is_given_up_in_one_line_and_leaves_no_state(
  monkeypatch, tmp_path
):
  """A start `connect_soon` began that does not end within `START_TIMEOUT` (Ray's own
  start has hung: its GCS up, no raylet) makes `connect` raise, naming the wait and the
  logs, instead of waiting forever, and leaves no start behind. The hung start, ending
  later, writes nowhere a later start reads: the next one returns its own outcome."""
  from jaxsgd.scheduler.lanes import cluster

  monkeypatch.setattr(cluster, '_SOON', {})
  monkeypatch.setattr(cluster, '_STARTED_HERE', {})
  monkeypatch.setattr(cluster, 'START_TIMEOUT', 0.5)
  monkeypatch.setattr(cluster.ray, 'is_initialized', lambda: False)
  release, reached = threading.Event(), threading.Event()
  outcomes = iter(['stale', 'fresh'])

  def start(address):
    outcome = next(outcomes)
    if outcome == 'stale':
      cluster._STARTED_HERE['temp_dir'] = str(tmp_path)  # as `_connect_now` does
      reached.set()
      release.wait(10)
    return outcome

  monkeypatch.setattr(cluster, '_connect_now', start)
  cluster.connect_soon(None)
  stale = cluster._SOON['thread']
  assert reached.wait(5)
  began = time.monotonic()
  expected = rf'^lanes: the Ray cluster did not start within 0.5 s \(its logs: {tmp_path}; every'
  with pytest.raises(RuntimeError, match=expected):
    cluster.connect(None)
  assert time.monotonic() - began < 5
  assert cluster._SOON == {} and cluster._STARTED_HERE == {}
  cluster.connect_soon('10.0.0.2:6379')  # the next start, while the first still hangs
  release.set()
  stale.join(5)  # its outcome written (to its own start) before the next is read
  assert not stale.is_alive()
  assert cluster.connect('10.0.0.2:6379') == 'fresh'


@pytest.mark.slow
def test_the_profile_command_measures_the_process_executors_host_profile(tmp_path):
  """`experiments.profile --host=processes`: the file `cost.host` reads, measured end to
  end (a cluster of its own; the loaded driver with a busy lane on every core)."""
  out = tmp_path / 'host.json'
  done = subprocess.run(
    # One chain per dispatch and driver figure (`--host_repeats`): the file, not its noise.
    [
      sys.executable,
      '-m',
      'experiments.profile',
      '--host=processes',
      '--host_repeats=1',
      f'--out={out}',
    ],
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert f'wrote {out}: host profile of processes' in done.stdout
  from jaxsgd.scheduler import host

  profile = host.load(str(out))
  assert (profile.executor, profile.cores) == ('processes', len(os.sched_getaffinity(0)))
  assert profile.moves == 'host'  # its links' copies came in memory the lanes share
  figures = dict(profile.figures)
  assert set(figures) == set(host.FIGURES['processes'])
  # A latency, and a move's time per array beyond its first, is a median less what is
  # counted elsewhere, at least 0 (`link_timing._fit`, `link_line`: on a loaded
  # machine the difference can be nothing); the rest is time (or bytes/s) that every
  # task or move pays.
  may_be_zero = {name for name in figures if 'latency' in name or name.endswith('per_array')}
  assert may_be_zero == {
    'driver_latency',
    'driver_latency_loaded',
    'link_latency',
    'link_per_array',
    'take_in_latency',
    'take_in_per_array',
    'export_latency',
    'export_per_array',
  }
  assert not [name for name in may_be_zero if not 0 <= figures[name] < float('inf')], figures
  assert not [name for name in figures.keys() - may_be_zero if not figures[name] > 0], figures


def test_dispatch_is_measured_in_cpu_only_with_a_cluster_of_its_own(head):
  """On a cluster started elsewhere Ray's processes are not this one's: no CPU figure.
  With a cluster of its own (`processes_cpu`, a host profile's `dispatch_loaded`):
  `test_the_profile_command_measures_the_process_executors_host_profile`."""
  from jaxsgd.scheduler import lane_timing

  measured = lane_timing.measure_process_dispatch(address=head.address, tasks=20, rounds=1)
  assert set(measured) == {'processes', 'driver', 'driver_latency'}
  # A lane's time between calls and the driver's CPU per event are never nothing; the
  # latency is the median hear delay less the CPU per event (at least 0): over a lane's
  # socket an end is heard within about that CPU, so it may be 0.
  assert measured['processes'] > 0 and measured['driver'] > 0
  assert measured['driver_latency'] >= 0


def test_a_closed_pool_leaves_no_thread_reading_its_lanes(head, monkeypatch):
  """`close` ends the reader thread of every lane's connection before it returns (and
  before Ray shuts down, where this pool owns the connection): none is left to run while
  Ray shuts down. Here Ray's kill of the lanes does nothing, so their ends stay open
  until they hear that the driver's closed: the readers end by their own side's close,
  and the lanes exit by themselves, `wire.DRIVER_GONE_GRACE` (3 s) after they heard it
  (a 5-s wait from the close missed one in a loaded test run)."""
  from jaxsgd.scheduler.lanes import cluster, wire

  monkeypatch.setattr(cluster, 'kill', lambda actor: None)
  with LanePool(LanePlacement.spread(['closing0', 'closing1']), address=head.address) as lanes:
    names = {f'jaxsgd-lane-{lane}' for lane in lanes.placement.names}
    assert names <= {thread.name for thread in threading.enumerate()}
    pids = list(lanes.pids().values())
  assert names.isdisjoint(thread.name for thread in threading.enumerate())
  left = gone(pids, within=wire.DRIVER_GONE_GRACE + 10)
  assert left == [], described(left)
