"""The lanes' wire (lanes/wire.py) without Ray: frames over both kinds of socket, the
address a process picks, and failures as the driver reads them."""

import errno
import os
import pickle
import threading
import time
import types
from multiprocessing import connection

import numpy as np
import pytest

from jaxsgd.scheduler.lanes import cluster, wire
from jaxsgd.scheduler.lanes.runtime import MakerFailed

KEY = b'k' * 16


def _echo_through(listener, where, background: bool):
  """Sends two messages to `listener` at `where` and returns what the other end read."""
  got = []

  served = threading.Event()

  def serve(end, hello):
    got.extend([hello, end.receive(), end.receive()])
    end.send(('bye',))
    served.set()

  threading.Thread(target=wire.accept_forever, args=(listener, KEY, serve), daemon=True).start()
  batch = np.arange(300_000, dtype=np.float32).reshape(600, 500)  # 1.2 MB: a frame of its own
  small = np.arange(10, dtype=np.int8)
  client = wire.connect(where, KEY, ('driver',), background=background)
  client.send(('run', 7, (batch, small, 'x')))
  client.send(('count', 8, ()))
  assert client.receive() == ('bye',)  # (also: the background writer sent both, in order)
  assert served.wait(5)
  client.close()
  return got, batch, small


def _check(got, batch, small):
  hello, run, count = got
  assert hello == ('driver',) and count == ('count', 8, ())
  op, number, (got_batch, got_small, text) = run
  assert (op, number, text) == ('run', 7, 'x')
  np.testing.assert_array_equal(got_batch, batch)
  np.testing.assert_array_equal(got_small, small)


@pytest.mark.parametrize('kind', ['tcp', 'unix, written by a background thread'])
def test_a_message_with_a_large_array_crosses_a_socket_whole_and_in_order(kind):
  remote, local = wire.listen('127.0.0.1')
  listener = remote if kind == 'tcp' else local
  try:
    _check(*_echo_through(listener, listener.address, background=kind != 'tcp'))
  finally:
    remote.close()
    local.close()


def test_a_connection_has_ended_only_once_its_other_end_closed_and_nothing_is_read():
  import multiprocessing

  here, there = multiprocessing.Pipe()  # a socket pair
  assert not wire.ended(here, within=0.05)  # open, nothing sent: not ended
  there.send_bytes(b'next message')
  assert not wire.ended(here, within=0.05)  # a message waits: not ended, and not read
  assert here.recv_bytes() == b'next message'
  there.close()
  assert wire.ended(here, within=1.0)


@pytest.mark.parametrize('kind', ['tcp', 'unix'])
def test_closing_a_connection_wakes_the_thread_reading_it_though_the_other_end_is_open(kind):
  """A reader blocked on a connection ends with an end (`EOFError`) as soon as its own
  side closes it, while the other side stays open and says nothing."""
  remote, local = wire.listen('127.0.0.1')
  listener = remote if kind == 'tcp' else local
  held = []
  threading.Thread(
    target=wire.accept_forever, args=(listener, KEY, lambda end, _: held.append(end)), daemon=True
  ).start()
  client = wire.connect(listener.address, KEY, ('driver',))
  ended = []

  def read():
    try:
      client.receive()
    except (EOFError, OSError) as e:
      ended.append(type(e))

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  deadline = time.monotonic() + 5
  while not held and time.monotonic() < deadline:
    time.sleep(0.01)
  assert held and not wire.ended(client.link, within=0.1)  # open, silent: the read waits
  client.close()
  reader.join(1.0)
  try:
    assert not reader.is_alive() and ended  # (closing the descriptor alone: still reading)
  finally:
    held[0].close()
    remote.close()
    local.close()


def test_a_large_array_is_a_frame_of_its_own_a_small_one_is_in_the_pickle():
  big, small = np.zeros(wire.OUT_OF_BAND, np.uint8), np.zeros(wire.OUT_OF_BAND - 1, np.uint8)
  frames = wire.frames(('m', big, small))
  assert len(frames) == 2 and int.from_bytes(frames[0][:4], 'little') == 1
  assert frames[1].nbytes == wire.OUT_OF_BAND and len(frames[0]) > wire.OUT_OF_BAND - 1


def test_a_large_array_is_read_into_memory_of_its_own_and_a_cut_frame_is_an_end():
  """A frame's buffer is read straight from the socket into a buffer of its own, which the
  array is a view of (equal, writable); a connection that ends inside a message is an
  `EOFError`, as one that ends between messages."""
  here, there = connection.Pipe()
  batch = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: more than a socket buffer holds
  sent = threading.Thread(target=lambda: [here.send_bytes(f) for f in wire.frames(('x', batch))])
  sent.start()
  tag, got = wire.receive(there)
  sent.join()
  assert tag == 'x' and got.flags.writeable and isinstance(got.base, (np.ndarray, memoryview))
  np.testing.assert_array_equal(got, batch)
  header, _ = wire.frames(('cut', batch))
  here.send_bytes(header)  # the header says a buffer follows; none does
  here.close()
  with pytest.raises(EOFError):
    wire.receive(there)


def test_a_large_array_arrives_aligned_so_that_a_cpu_task_reads_it_where_it_lies():
  """Every frame's memory starts at a 64-byte boundary (numpy's own is 16), and JAX's CPU
  client then uses the array in place: at 16, every jitted call on it copied it first."""
  import jax

  here, there = connection.Pipe()
  arrays = [np.arange(n, dtype=np.float32) for n in (1 << 14, (1 << 14) + 3, 1 << 18)]
  sent = threading.Thread(target=lambda: [here.send_bytes(f) for f in wire.frames(arrays)])
  sent.start()
  got = wire.receive(there)
  sent.join()
  for array, arrived in zip(arrays, got, strict=True):
    np.testing.assert_array_equal(arrived, array)
    assert arrived.ctypes.data % wire.ALIGNMENT == 0
    assert jax.device_put(arrived, jax.devices('cpu')[0]).unsafe_buffer_pointer() == (
      arrived.ctypes.data
    )
  for size in (1, 63, 1000):
    assert wire.aligned_bytes(size).ctypes.data % wire.ALIGNMENT == 0
    assert wire.aligned_bytes(size).nbytes == size


def test_a_process_reaches_a_lane_of_its_host_by_its_unix_socket_else_by_tcp():
  addresses = {'remote': ['10.0.0.2', 5000], 'local': '\0jaxsgd-lane-x', 'host': '10.0.0.2'}
  assert wire.address(addresses, '10.0.0.2') == '\0jaxsgd-lane-x'
  assert wire.address(addresses, '10.0.0.3') == ('10.0.0.2', 5000)


def test_a_lanes_failure_keeps_its_cause_and_says_whether_a_process_died():
  made = wire.failure(MakerFailed('stage0', 12, (12, ())))
  read = pickle.loads(pickle.dumps(made))  # as it crosses the wire
  assert cluster.failed_maker(read) == ('stage0', 12)
  assert cluster.describe(read).startswith('MakerFailed: lane stage0: value (12, ())')
  assert not cluster.is_death(read)
  lost = pickle.loads(pickle.dumps(wire.failure(wire.SourceLost('10.0.0.2:5000'))))
  assert cluster.is_death(lost) and lost.type_name == 'SourceLost'

  class Unpicklable(Exception):
    def __reduce__(self):
      raise TypeError('no')

  opaque = wire.failure(Unpicklable('inner text'))
  assert opaque.cause is None and str(opaque) == 'Unpicklable: inner text'


def test_a_lane_listener_holds_many_connections_waiting_to_be_accepted():
  """A new lane (a replaced one) is connected to by the driver and every other lane at
  once; a Unix socket whose backlog is full refuses a connection at once (the value sent
  on it was lost, and a run hung). Ten raw connections, none accepted yet, all get in."""
  import socket

  remote, local = wire.listen('127.0.0.1')
  ends = []
  try:
    for _ in range(10):
      end = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      end.setblocking(False)
      end.connect(local.address)  # raises (EAGAIN) once the backlog is full
      ends.append(end)
    assert len(ends) == 10
  finally:
    for end in ends:
      end.close()
    remote.close()
    local.close()


@pytest.mark.parametrize('kind', ['tcp', 'unix'])
def test_a_peer_that_dies_in_the_handshake_does_not_stop_the_lane_accepting(kind):
  """A lane killed while it connected to another closed its socket in the middle of the
  handshake; when the accepting thread did the handshake, that ended the thread and
  every later connection waited forever (a run hung). Here two peers die at once (one
  before it says a word, one after a wrong answer), a third brings the wrong key; then a
  real peer connects, within 5 s, and its hello is read."""
  import socket

  remote, local = wire.listen('127.0.0.1')
  listener = remote if kind == 'tcp' else local
  family = socket.AF_INET if kind == 'tcp' else socket.AF_UNIX
  heard = []
  handled = threading.Event()

  def handle(end, hello):
    heard.append(hello)
    handled.set()

  threading.Thread(target=wire.accept_forever, args=(listener, KEY, handle), daemon=True).start()
  try:
    silent = socket.socket(family, socket.SOCK_STREAM)
    silent.connect(listener.address)
    silent.close()
    rude = socket.socket(family, socket.SOCK_STREAM)
    rude.connect(listener.address)
    rude.sendall(b'\x00\x00\x00\x05hello')
    rude.close()
    with pytest.raises((connection.AuthenticationError, EOFError, OSError)):
      wire.connect(listener.address, b'x' * 16, ('lane', 'wrong key'))
    connected = []
    peer = threading.Thread(
      target=lambda: connected.append(wire.connect(listener.address, KEY, ('lane', 'real'))),
      daemon=True,
    )
    peer.start()
    peer.join(5)
    assert connected, 'the handshake of a real peer never came'
    assert handled.wait(5) and heard == [('lane', 'real')]
    connected[0].close()
  finally:
    remote.close()
    local.close()


def test_a_driver_array_sent_again_is_converted_to_numpy_once_and_forgotten_with_it():
  """`LanePool` sends a driver-side jax.Array as numpy; the same array (a parameter
  server's constants, with every update) is converted once."""
  import gc

  import jax.numpy as jnp

  from jaxsgd.scheduler.lanes import pool as pool_module

  copies = pool_module._HostCopies()
  one, two = jnp.int32(1), jnp.int32(1)  # equal values, two arrays
  first = copies(one)
  assert isinstance(first, np.ndarray) and first == 1
  assert copies(one) is first  # not converted again
  assert copies(two) is not first and copies(two) == 1
  host = np.ones(3)
  assert copies(host) is host and copies(7) == 7  # not jax arrays: as they are
  large = jnp.zeros(copies.SMALL // 4 + 1, jnp.float32)
  assert isinstance(copies(large), np.ndarray) and id(large) not in copies._copies  # not kept
  assert not first.flags.writeable  # one copy serves every call: nobody may write into it
  del one
  gc.collect()
  assert len(copies._copies) == 1  # `one`'s copy went with it (`first` no longer holds it)
  assert first == 1


@pytest.fixture
def served_lane(monkeypatch):
  """A `LaneRuntime` in this process, serving its sockets with `KEY`, and the event its
  threads set where the lane's process would exit (`wire.exit_now`: not pytest's; the
  thread that calls it waits for ever instead). Afterwards a thread still waiting for a
  driver (`_reply`) is given one that reads nothing, before `wire.exit_now` is itself
  again: else it would end pytest, with status 0, once its wait ran out."""
  from jaxsgd.scheduler.lanes.runtime import LaneRuntime

  ended = threading.Event()

  def end_the_thread(grace: float = 0.0, status: int = 0):
    ended.set()
    threading.Event().wait()

  monkeypatch.setattr(wire, 'exit_now', end_the_thread)
  runtime = LaneRuntime('lane', None)
  yield runtime, runtime.serve(KEY), ended
  if runtime.driver is None:
    runtime.driver = types.SimpleNamespace(send=lambda message: None)
    runtime.driver_connected.set()


def test_a_value_from_another_lane_read_before_the_drivers_hello_is_told_once_it_connects(
  served_lane,
):
  """A lane reads each connection in a thread of its own, so another lane's value can be
  read before the driver's hello (a replaced lane is sent copies as soon as it is up): its
  arrival reaches the driver once it connects. The reading thread had failed on the
  missing connection, the arrival was never told, and the run waited for it for ever."""
  runtime, address, ended = served_lane
  peer = wire.connect(address['local'], KEY, ('lane', ('127.0.0.1', 1)))
  driver = None
  try:
    peer.send(('value', ('copy', ()), 7, False, 123.0, np.arange(3)))
    deadline = time.monotonic() + 10
    while ('copy', ()) not in runtime.arrived and time.monotonic() < deadline:
      time.sleep(0.01)
    assert ('copy', ()) in runtime.arrived  # read, and its arrival to be told
    driver = wire.connect(address['local'], KEY, ('driver',))
    told = []
    reader = threading.Thread(target=lambda: told.append(driver.receive()), daemon=True)
    reader.start()
    reader.join(10)
    assert told and told[0][:2] == ('arrived', 7) and told[0][2][0] == 123.0, told
    assert not ended.is_set()
  finally:
    peer.close()
    if driver is not None:
      driver.close()
      assert ended.wait(10)  # the lane's reader of the driver ended (its run is over)


def test_a_lane_thread_that_fails_ends_the_lanes_process(served_lane):
  """A message another lane sent that its reader cannot take (too short): the failure
  ends the lane's process, which the driver hears as a death, not the thread alone."""
  _, address, ended = served_lane
  peer = wire.connect(address['local'], KEY, ('lane', ('127.0.0.1', 1)))
  try:
    peer.send(('value', ('copy', ())))
    assert ended.wait(10)
  finally:
    peer.close()


def test_a_reply_that_does_not_pickle_fails_its_call_not_the_lane(served_lane):
  """A call whose result cannot be sent (it does not pickle): the driver reads the call's
  failure, naming why, and the lane goes on serving."""
  runtime, address, ended = served_lane
  driver = wire.connect(address['local'], KEY, ('driver',))
  try:
    assert runtime.driver_connected.wait(10)
    runtime._reply('ok', 5, threading.Lock())
    runtime._reply('ok', 6, 'next')
    kind, number, failure = driver.receive()
    assert (kind, number) == ('err', 5) and 'pickle' in str(failure), failure
    assert driver.receive() == ('ok', 6, 'next')
    assert not ended.is_set()
  finally:
    driver.close()
    assert ended.wait(10)


def _serve_messages(listener):
  """Accepts `listener`'s connections; returns the list each (hello, endpoint) and then
  each message read is appended to, and an event set at every append."""
  got, came = [], threading.Event()

  def serve(end, hello):
    got.append((hello, end))
    came.set()
    while True:
      try:
        got.append(end.receive())
      except (EOFError, OSError):
        return
      came.set()

  threading.Thread(target=wire.accept_forever, args=(listener, KEY, serve), daemon=True).start()
  return got, came


def _next(got: list, came: threading.Event, count: int):
  """Waits until `got` holds `count` entries."""
  deadline = time.monotonic() + 5
  while len(got) < count and time.monotonic() < deadline:
    came.wait(0.1)
    came.clear()
  assert len(got) >= count, 'a message never came'


def test_within_a_host_a_large_array_is_written_once_into_memory_both_ends_share():
  """Over a Unix socket the connection's sender has an arena (wire.Arena) whose
  descriptor went with its hello: a large array is placed in its first free region
  (first fit from the arena's data start, 64-byte aligned) and the receiver's array is a
  view of that region, writable and aligned. The region is the sender's again once no
  array of it is left at the receiver."""
  remote, local = wire.listen('127.0.0.1')
  got, came = _serve_messages(local)
  batch = np.arange(300_000, dtype=np.float32).reshape(600, 500)  # 1,200,000 bytes
  client = wire.connect(local.address, KEY, ('driver',), background=True)
  try:
    client.send(('x', batch))
    client.send(('y', batch + 1))  # while x's region is held
    _next(got, came, 3)
    (hello, end), (_, first), (_, second) = got
    assert hello == ('driver',) and end.shared is not None and end.shared.regions_read == 2
    start = np.frombuffer(end.shared.memory, np.uint8).ctypes.data
    assert first.ctypes.data - start == 4096 and second.ctypes.data - start == 4096 + 1_200_000
    assert first.flags.writeable and first.ctypes.data % wire.ALIGNMENT == 0
    np.testing.assert_array_equal(first, batch)
    np.testing.assert_array_equal(second, batch + 1)
    assert sorted(client.arena.regions.values()) == [(4096, 1_200_000), (1_204_096, 1_200_000)]
    del got[1], first  # the receiver lets go of x: its region is taken back and reused
    client.send(('z', batch + 2))
    _next(got, came, 3)
    assert got[2][1].ctypes.data - start == 4096
    np.testing.assert_array_equal(got[2][1], batch + 2)
  finally:
    client.close()
    remote.close()
    local.close()


def _no_memory(fd, size):
  """`ArenaView` in a process that may not map the arena (its address-space limit)."""
  del size
  os.close(fd)
  raise OSError(errno.ENOMEM, 'Cannot allocate memory')


@pytest.mark.parametrize('kind', ['tcp', 'unix, share=False', 'unix, not mapped'])
def test_between_hosts_when_told_not_to_or_not_mapped_a_connection_shares_no_memory(
  kind, monkeypatch, capsys
):
  """'not mapped': a receiver whose mapping of the sender's arena fails (`ENOMEM` raised
  in its place) answers so, and says so on stderr; the sender drops the arena and the
  array comes as a frame, equal, where the connection had ended before."""
  if kind == 'unix, not mapped':
    monkeypatch.setattr(wire, 'ArenaView', _no_memory)
  remote, local = wire.listen('127.0.0.1')
  listener = remote if kind == 'tcp' else local
  got, came = _serve_messages(listener)
  client = wire.connect(listener.address, KEY, ('driver',), share=kind != 'unix, share=False')
  try:
    batch = np.arange(300_000, dtype=np.float32)
    client.send(('x', batch))
    _next(got, came, 2)
    assert client.arena is None and got[0][1].shared is None
    np.testing.assert_array_equal(got[1][1], batch)
    mapped_line = "shared memory from ('driver',) not mapped" in capsys.readouterr().err
    assert mapped_line == (kind == 'unix, not mapped')
  finally:
    client.close()
    remote.close()
    local.close()


def test_an_arena_places_first_fit_and_a_buffer_it_has_no_room_for_goes_as_a_frame():
  """Hand-placed: an arena with 3,000 bytes after its slot table. Two 1,000-byte buffers
  at 4096 and 5120 (the first's end, 5096, rounded up to 64 bytes); a third has no room;
  once the receiver lets go of the first, its region is placed again, and a small buffer
  fits after the second. A message whose buffer has no room goes as a frame after its
  head, and arrives equal."""
  arena = wire.Arena(4096 + 3000)
  view = wire.ArenaView(os.dup(arena.fd), arena.size)
  arena.close_descriptor()
  ones = memoryview(np.ones(1000, np.uint8))
  assert arena.place(ones) == (0, 4096, 1000)
  assert arena.place(ones) == (1, 5120, 1000)
  assert arena.place(ones) is None  # 6144 + 1000 > 7096
  region = view.region(0, 4096, 1000)
  assert view.held[0] == 1 and int(region.sum()) == 1000
  del region  # the receiver's last array of it: its slot is cleared
  assert view.held[0] == 0
  assert arena.place(ones) == (0, 4096, 1000)
  assert arena.place(memoryview(np.ones(10, np.uint8))) == (2, 6144, 10)
  here, there = connection.Pipe()
  batch = np.arange(wire.OUT_OF_BAND // 4, dtype=np.float32)  # out of band; no room left
  message = wire.frames(('m', batch), arena)
  assert len(message) == 2  # the head, then the buffer as a frame
  for frame in message:
    here.send_bytes(frame)
  tag, arrived = wire.receive(there, view)
  assert tag == 'm' and view.regions_read == 1  # (the region asked for above)
  np.testing.assert_array_equal(arrived, batch)


def test_a_receiver_that_ends_before_answering_the_arena_is_a_reset_connection():
  """The sender waits for the receiver's answer to its arena: a receiver that ends the
  connection first (a lane killed as it connected) is `ConnectionResetError`, an
  `OSError` as a refused connection is, which the callers' retries already handle."""
  remote, local = wire.listen('127.0.0.1')

  def hang_up(link):
    connection.deliver_challenge(link, KEY)
    connection.answer_challenge(link, KEY)
    link.recv_bytes()  # the hello
    os.close(wire._receive_descriptor(link))  # pylint: disable=protected-access
    link.close()

  accepted = threading.Thread(target=lambda: hang_up(local.accept()), daemon=True)
  accepted.start()
  try:
    with pytest.raises(ConnectionResetError, match='before it took its memory'):
      wire.connect(local.address, KEY, ('driver',))
  finally:
    accepted.join(5)
    remote.close()
    local.close()
