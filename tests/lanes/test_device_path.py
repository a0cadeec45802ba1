"""The device path (`lanes/device_path.py`): values move lane to lane as device buffers
through JAX's transfer servers, and arrive as the host path delivers them.

A machine without GPUs tests the code path with CPU lanes that have it on
(`moves=device`); on a GPU lane it is on by default.
"""

import os
import signal
import time

import jax
import numpy as np
import pytest

import lane_tasks
from ray_head import serve_head
from test_lanes import G, RECIPE, X, gone

from jaxsgd.scheduler.lanes import LanePlacement, LanePool, LaneSpec
from jaxsgd.scheduler.lanes.device_path import DevicePath, Offer, SourceGone, uses_device_path
from jaxsgd.scheduler.tasks import Task


def task(name):
  return Task(RECIPE, name)


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.fixture(scope='module')
def pool(head):
  placement = LanePlacement.parse(
    'a@cores=0@moves=device; b@cores=0@moves=device; c@cores=0; d@cores=0@moves=socket'
  )
  with LanePool(placement, address=head.address, verbose=False) as lanes:
    yield lanes
  assert gone(lanes.pids().values()) == []


def pulled(pool: LanePool, lane: str) -> int:
  """The copies `lane` has taken in on the device path so far."""
  return pool.lane_info(lane)['pulled']


def test_moves_in_the_placement_text_form_and_bad_input():
  placement = LanePlacement.parse('a@moves=device; b@gpu=1; c@moves=host; d@moves=socket')
  assert [lane.moves for lane in placement.lanes] == ['device', 'auto', 'host', 'socket']
  assert placement['a'] == LaneSpec('a', moves='device')
  assert 'a: host=driver cores=any gpu=no moves=device' in placement.describe()
  assert 'b: host=driver cores=any gpu=yes\n' in placement.describe()  # auto: not printed
  with pytest.raises(
    ValueError,
    match=r"^placement: lane 'a': moves must be one of auto, device, host, socket, got 'gpu'.$",
  ):
    LanePlacement.parse('a@moves=gpu')
  # auto: the device path on any device but a CPU
  kinds = ('auto', 'device', 'host', 'socket')
  assert [uses_device_path(m, 'cpu') for m in kinds] == [False, True, False, False]
  assert [uses_device_path(m, 'gpu') for m in kinds] == [True, True, False, False]


def test_an_offer_is_pulled_whole_onto_the_pulling_device_and_odd_leaves_go_inline():
  device = jax.local_devices()[0]
  source, target = DevicePath(jax, device, '127.0.0.1'), DevicePath(jax, device, '127.0.0.1')
  leaves = [
    jax.device_put(X, device),
    np.arange(3, dtype=np.int32),  # a host array (a CPU lane's copy as it came): inline
    jax.device_put(np.zeros((0, 4), np.float32), device),  # empty: inline
    jax.device_put(G, device),
  ]
  offer = source.offer(leaves)
  assert isinstance(offer, Offer) and sorted(offer.specs) == [0, 3]
  assert offer.specs[0] == (X.shape, np.dtype(np.float32))
  assert offer.inline[0] is None and offer.inline[3] is None
  got = target.pull(offer)
  assert [isinstance(leaf, jax.Array) for leaf in got] == [True, False, False, True]
  assert isinstance(got[0], jax.Array) and got[0].sharding.device_set == {device}
  np.testing.assert_array_equal(got[0], X)
  np.testing.assert_array_equal(got[1], np.arange(3))
  assert got[2].shape == (0, 4)
  np.testing.assert_array_equal(got[3], G)
  assert (source.pulled, target.pulled) == (0, 1)


_SOURCE_THAT_DIES = """
import json, os, sys
import jax, numpy as np
from jaxsgd.scheduler.lanes.device_path import DevicePath
source = DevicePath(jax, jax.local_devices()[0], '127.0.0.1')
value = [jax.device_put(np.ones((256, 256), np.float32))]
first, second = source.offer(value), source.offer(value)
print(json.dumps([first.address, first.uuid, second.uuid]), flush=True)
sys.stdin.readline()
os._exit(0)
"""


def _source_that_dies():
  """A process with a transfer server offering two values, which exits when told to on
  its stdin: `(the process, (its server's address, the two offers' numbers))`."""
  import json
  import subprocess
  import sys

  source = subprocess.Popen(
    [sys.executable, '-c', _SOURCE_THAT_DIES],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  return source, json.loads(source.stdout.readline())


def test_a_pull_from_a_source_that_died_fails_at_once(tmp_path):
  import time

  source, (address, first, second) = _source_that_dies()
  device = jax.local_devices()[0]
  target = DevicePath(jax, device, '127.0.0.1')
  specs = {0: ((256, 256), np.dtype(np.float32))}
  np.testing.assert_array_equal(target.pull(Offer(address, first, specs, [None]))[0], 1.0)
  source.stdin.write('die\n')  # after a pull: the lanes' connection exists, as in a run
  source.stdin.flush()
  assert source.wait(timeout=30) == 0
  offer = Offer(address, second, specs, [None])
  start = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError):  # (the connection closed)
    target.pull(offer)
  assert time.monotonic() - start < 5
  assert target.pulled == 1 and target._connections == {}  # not kept for another pull


def test_a_first_pull_from_a_source_already_dead_ends_once_its_lane_is_seen_gone():
  """A first pull from a source's transfer server waits in JAX without bound for a
  server that is gone: it gives up once `gone()` says the source's lane ended (the
  lane's reader: its wire connection ended), and a pull from another source is not held
  up meanwhile."""
  import threading
  import time

  source, (address, first, _) = _source_that_dies()
  source.stdin.write('die\n')  # before any pull: no connection yet
  source.stdin.flush()
  assert source.wait(timeout=30) == 0
  device = jax.local_devices()[0]
  target, live = DevicePath(jax, device, '127.0.0.1'), DevicePath(jax, device, '127.0.0.1')
  specs = {0: ((256, 256), np.dtype(np.float32))}
  seen_gone = threading.Event()
  threading.Timer(1.0, seen_gone.set).start()  # the lane's reader sees its source gone
  start = time.monotonic()
  failed = []
  pulling = threading.Thread(
    target=lambda: failed.append(
      pytest.raises(SourceGone, target.pull, Offer(address, first, specs, [None]), seen_gone.is_set)
    )
  )
  pulling.start()
  # Meanwhile another source's copy comes through the same lane's server.
  offer = live.offer([jax.device_put(np.full((4,), 2.0, np.float32), device)])
  np.testing.assert_array_equal(target.pull(offer)[0], 2.0)
  pulling.join(timeout=10)
  assert not pulling.is_alive() and failed, 'the pull from the dead source still waits'
  assert time.monotonic() - start < 10
  assert address not in target._connections and target.pulled == 1


def test_a_value_and_a_vjp_move_on_the_device_path_between_lanes_that_have_it(pool):
  before = pulled(pool, 'b')
  w = pool.run('a', task('init'), (2,))
  y, vjp = pool.run('a', task('forward'), (w, X))
  message = pool.move({'y': y, 'w': w}, 'b')  # a copy per handle
  there = pool.run('b', task('backward'), (vjp, G))  # the VJP moves a -> b, rebuilt there
  np.testing.assert_array_equal(pool.fetch(message['y']), pool.fetch(y))
  np.testing.assert_array_equal(pool.fetch(message['w']), pool.fetch(w))
  reference = jax.jit(lambda w, x, g: jax.vjp(lane_tasks.layer, w, x)[1](g))
  for got, want in zip(there, reference(np.asarray(pool.fetch(w)), X, G)):
    np.testing.assert_array_equal(pool.fetch(got), want)
  assert pulled(pool, 'b') - before == 3  # y, w and the VJP


def test_a_lane_without_the_device_path_gets_and_sends_its_copies_on_the_host_path(pool):
  before = {lane: pulled(pool, lane) for lane in 'abc'}
  w = pool.run('a', task('init'), (4,))
  on_c = pool.move(w, 'c')
  back_on_b = pool.move(pool.run('c', task('add'), (on_c, on_c)), 'b')
  np.testing.assert_array_equal(pool.fetch(back_on_b), 2 * pool.fetch(w))
  assert {lane: pulled(pool, lane) for lane in 'abc'} == before
  assert 'moves=device' in pool.describe().split('\n  b:')[1].split('\n')[0]
  assert 'moves=device' not in pool.describe().split('\n  c:')[1]


def shared_in(pool: LanePool) -> dict[str, int]:
  """Each lane's large buffers that came in memory their sender shares with it so far."""
  return {lane: pool.lane_info(lane)['shared_in'] for lane in 'abcd'}


def test_within_a_host_a_value_moves_through_shared_memory_unless_a_lane_says_socket(pool):
  """The host path within a host: a large buffer is written into memory its sender shares
  with the receiver (wire.Arena) — from the driver and from another lane —, unless either
  end's `moves` is `socket`; either way the value arrives bit for bit."""
  big = np.linspace(-1, 1, 1 << 16, dtype=np.float32).reshape(-1, 8)  # 256 KiB: out of band
  before = shared_in(pool)
  on_c, on_d = pool.put('c', big), pool.put('d', big)  # driver -> c shared, -> d socket
  from_c = pool.move(pool.run('c', task('add'), (on_c, on_c)), 'd')  # c -> d: socket
  from_d = pool.move(pool.run('d', task('add'), (on_d, on_d)), 'c')  # d -> c: socket
  on_a = pool.put('a', big)  # a has the device path and c not: host path, shared
  from_a = pool.move(pool.run('a', task('add'), (on_a, on_a)), 'c')
  for moved in (from_c, from_d, from_a):
    np.testing.assert_array_equal(pool.fetch(moved), big + big)
  np.testing.assert_array_equal(pool.fetch(on_d), big)
  came = {lane: n - before[lane] for lane, n in shared_in(pool).items()}
  assert came == {'a': 1, 'b': 0, 'c': 2, 'd': 0}  # put on a, c; a -> c
  # a's region goes back to a once c has let go of the copy (its value freed there).
  assert pool.lane_info('a')['shared_lent'] == 1
  del from_a, from_c, from_d, moved
  pool.held('c')  # (the frees queued for c applied)
  assert pool.lane_info('a')['shared_lent'] == 0


def test_a_lane_lets_go_of_its_arena_for_a_lane_that_died_holding_a_region(head):
  """A sender's shared memory for a lane that died still holding a value of it is
  dropped once the driver says that lane died (nothing is sent there again), rather than
  kept, region lent, for the rest of the run."""
  big = np.linspace(-1, 1, 1 << 16, dtype=np.float32).reshape(-1, 8)  # 256 KiB: out of band
  placement = LanePlacement.parse('p@cores=0; q@cores=0')
  with LanePool(placement, address=head.address, verbose=False) as lanes:
    on_q = lanes.move(lanes.put('p', big), 'q')  # p -> q through p's arena for q
    np.testing.assert_array_equal(lanes.fetch(on_q), big)
    assert lanes.lane_info('p')['shared_lent'] == 1  # q holds the copy: its region lent
    os.kill(lanes.pids()['q'], signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while 'q' not in lanes.dead_lanes() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert lanes.dead_lanes() == {'q'}
    # p heard of the death before this call: both come over its one driver connection.
    assert lanes.lane_info('p')['shared_lent'] == 0
