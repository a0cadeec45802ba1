"""The lanes' wire: calls, replies and values over direct sockets between processes.

Ray starts, places and watches the lane processes; everything a run sends while it
trains goes over sockets of their own (`multiprocessing.connection`, authenticated by
a key the pool draws at start):

    driver ──calls──▶ lane A ──values──▶ lane B          (one connection each way used)
       ◀──replies───     ◀──────replies──────

- **Driver to lane**: one connection per lane. A reader thread in the lane hands each
  call to the lane's *ordered* thread (tasks, puts, fetches: run one at a time, in the
  order sent) or to its *export* thread (a value for another lane, or one the driver
  keeps), so that an export never waits behind the calls queued after the one that
  makes its value. Every call is answered on the same connection, in the order done.
- **Lane to lane**: the source's export thread sends the value (its leaves in memory
  the two share within a host, `Arena`; else as raw frames) straight to the receiving
  lane, which keeps it until the first call that needs
  it takes it in, or — a message that must land whole (`landed`) — takes it in at once
  and tells the driver. The driver hears of every copy's arrival (for its timing, and
  so that a failed copy is reported).
- **Deaths**: a lane's process that ends closes its sockets: the driver's reader sees
  the end at once (and Ray's watch still reports a host that vanished); a lane whose
  import's source died is told by the driver (`dead`) or sees the source's connection
  end, and the call waiting for that import fails as a death. A lane whose driver
  connection ends exits, so that no lane outlives its run.

Why not Ray's actor calls: a classic actor call cost the driver many times the CPU of a
socket write, and its round trip many times longer (`benchmarks/dispatch_candidates.py`;
figures in benchmarks/results/dispatch_candidates.md and docs/engine.md, "Dispatch").

Frames: a message is one pickle (protocol 5) whose large buffers (numpy arrays of
`OUT_OF_BAND` bytes or more) are never copied into the pickle. Between two processes of
one host each connection has an `Arena`, memory shared by its two ends: the sender
writes a large buffer there once and the receiver's arrays are views of it — one copy
where a socket makes two (into the kernel and out of it), and none of them on the
receiving process's core. The receiver answers the arena's descriptor with whether it
mapped it; where it may not (a limit on its address space), the connection shares no
memory. A buffer the arena has no room for, and every buffer between hosts or on a
connection without an arena, goes as a frame of its own after the pickle, written from
and read into its own memory. Either memory starts at an `ALIGNMENT` boundary, so that a
CPU lane's tasks read a moved array where it lies.
"""

import ctypes
import errno
import functools
import mmap
import os
import pickle
import queue
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from multiprocessing import connection

import numpy as np

OUT_OF_BAND = 1 << 16  # bytes: a buffer this large goes as a frame of its own
# bytes: XLA's CPU client computes on a host array in place only if it is aligned as its
# kernels need (at most this), and otherwise copies it at every call that reads it; numpy's
# own 16 bytes were not enough.
ALIGNMENT = 64


WRITER_THREAD = 'jaxsgd-writer'  # an `Endpoint`'s writer (`background`), as the OS names it
REPLIES_THREAD = 'jaxsgd-replies'  # a driver's reader of one lane's connection (`LanePool`)
_PR_SET_NAME = 15  # prctl(2): the calling thread's name, as `/proc/PID/task/TID/comm` shows it
_NAME_BYTES = 15  # (the kernel's 16, with the terminating zero)


def name_thread(name: str) -> None:
  """Names the calling thread for the OS (`/proc/PID/task/TID/comm`; `top -H`, `perf`):
  Python names none, so every thread of a lane process showed as the process, and a
  reading of where a lane's CPU goes (`benchmarks/lane_threads.py`) could tell its task
  thread from the others only by which used the most. At most 15 bytes; where the system
  has no `prctl` (not Linux), nothing."""
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return
  prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_NAME_BYTES]), 0, 0, 0)


def frames(message, arena: 'Arena | None' = None) -> list:
  """`message` (a picklable tuple) as the frames that carry it: its head, then those of
  its large buffers that `arena` (if any) has no room for. The head: the number of large
  buffers (4 bytes), where each is (`_PLACEMENT`: its region of the arena, or a frame
  that follows), then the message's pickle."""
  return _framed(*_pickled(message), arena)


def _pickled(message) -> tuple[bytes, list]:
  """`message`'s pickle and its large buffers, left out of it."""
  buffers = []

  def keep_large(buffer: pickle.PickleBuffer):
    if buffer.raw().nbytes < OUT_OF_BAND:
      return True  # in the pickle
    buffers.append(buffer.raw())
    return False

  return pickle.dumps(message, protocol=5, buffer_callback=keep_large), buffers


def _framed(body: bytes, buffers: list, arena: 'Arena | None') -> list:
  head, following = [len(buffers).to_bytes(4, 'little')], []
  for buffer in buffers:
    placed = arena.place(buffer) if arena is not None else None
    if placed is None:
      following.append(buffer)
      placed = (_FOLLOWS, 0, buffer.nbytes)
    head.append(_PLACEMENT.pack(*placed))
  return [b''.join((*head, body)), *following]


def receive(link: connection.Connection, shared: 'ArenaView | None' = None):
  """The next message on `link` (raises `EOFError` once the other end has closed);
  `shared`: the view of the sender's arena, where some of its buffers may lie."""
  raw = memoryview(link.recv_bytes())
  count = int.from_bytes(raw[:4], 'little')
  buffers = []
  for i in range(count):
    slot, offset, size = _PLACEMENT.unpack_from(raw, 4 + i * _PLACEMENT.size)
    if slot == _FOLLOWS:
      buffers.append(_receive_buffer(link.fileno()))
    elif shared is None:
      raise ValueError('a message placed a buffer in shared memory the connection has none of')
    else:
      buffers.append(shared.region(slot, offset, size))
  return pickle.loads(raw[4 + count * _PLACEMENT.size :], buffers=buffers)


# A large buffer's place in a message's head: (slot, offset, bytes) of its region of the
# connection's arena, or slot `_FOLLOWS`: a frame of its own follows the head.
_PLACEMENT = struct.Struct('<iqq')
_FOLLOWS = -1


def _receive_buffer(fd: int) -> np.ndarray:
  """The next frame on the connection `fd` (`Connection.send_bytes`' framing: its size,
  4 bytes big-endian, or -1 and 8 bytes), read straight from the socket into memory of
  its own: the message's arrays are views of it. `recv_bytes` read a frame in chunks,
  each into a bytes object of its own, and joined them: every moved array copied two or
  three times on its way in, on the receiving lane's core. The memory starts at an
  `ALIGNMENT` boundary, so that a task on a CPU lane reads a moved array where it lies: at
  numpy's own alignment every such task copied its moved arrays first."""
  size = int.from_bytes(_read_exactly(fd, np.empty(4, np.uint8)), 'big', signed=True)
  if size == -1:
    size = int.from_bytes(_read_exactly(fd, np.empty(8, np.uint8)), 'big')
  return _read_exactly(fd, aligned_bytes(size))


def aligned_bytes(size: int) -> np.ndarray:
  """`size` uninitialized bytes whose first starts at an `ALIGNMENT` boundary."""
  raw = np.empty(size + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start : start + size]


def _read_exactly(fd: int, buffer: np.ndarray) -> np.ndarray:
  """`buffer` filled from `fd` (raises `EOFError` if it ends first)."""
  view, done = memoryview(buffer), 0
  while done < len(view):
    read = os.readv(fd, [view[done:]])
    if read == 0:
      raise EOFError('the connection ended within a frame')
    done += read
  return buffer


# Bytes of each connection's arena. Its memory is taken as it is first written and kept
# (the regions are reused), so a connection holds about the most its receiver has held
# at once, never this; a buffer the arena has no room for goes over the socket.
ARENA_BYTES = 1 << 30
_SLOTS = 4096  # regions an arena can have sent and not had back, at most
_SLOTS_BYTES = 4096  # the arena's first bytes: a byte a slot, 1 while its region is held


class Arena:
  """The sending end's side of the memory a connection's two processes share (a
  `memfd`, its descriptor passed over the connection's Unix socket at `connect`).

  A large buffer of a message is written once into a region of it (`place`), and the
  receiver's arrays are views of that region (`ArenaView`): over the socket alone it was
  copied twice, into the kernel on the sender's core and out of it on the receiver's
  (an 18 MiB gradient ~4.8 and ~3.5 ms of CPU; a copy into memory already mapped ~1 ms).
  A region stays the receiver's until every array of it is gone there, which the
  receiver says by clearing its slot's byte at the arena's start; the sender takes it
  back at its next `place`. Regions are placed first fit, from the lowest offset, so
  that the memory written — which the arena keeps — is about the most held at once.
  Used by one thread at a time (the endpoint's writer)."""

  def __init__(self, size: int = ARENA_BYTES):
    self.fd = os.memfd_create('jaxsgd-wire', os.MFD_CLOEXEC)
    try:
      os.ftruncate(self.fd, size)
      self.memory = mmap.mmap(self.fd, size)
    except OSError:
      os.close(self.fd)
      raise
    self.size = size
    self.held = np.frombuffer(self.memory, np.uint8, _SLOTS)
    self.bytes = np.frombuffer(self.memory, np.uint8)
    self.regions: dict[int, tuple[int, int]] = {}  # slot -> (offset, bytes), sent and not back
    self.free_slots = list(range(_SLOTS - 1, -1, -1))

  def close_descriptor(self) -> None:
    """Closes this end's descriptor once the other end has its own (the mapping keeps
    the memory)."""
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None

  def place(self, buffer: memoryview) -> tuple[int, int, int] | None:
    """Writes `buffer` (contiguous bytes) into a free region: `(slot, offset, bytes)`,
    or None if no region of that size is free (the buffer then goes over the socket)."""
    self._take_back()
    size = buffer.nbytes
    offset = self._first_fit(size)
    if offset is None or not self.free_slots:
      return None
    slot = self.free_slots.pop()
    # numpy's copy lets go of the interpreter (a memoryview's holds it: the process's
    # other threads waited ~6 ms at a time behind 18 MiB copies; numpy's, ~0.16).
    self.bytes[offset : offset + size] = np.frombuffer(buffer, np.uint8)
    self.held[slot] = 1
    self.regions[slot] = (offset, size)
    return slot, offset, size

  def lent(self) -> int:
    """Regions the receiver holds now (from any thread: reads, never takes back)."""
    return sum(1 for slot in list(self.regions) if self.held[slot])

  def _take_back(self) -> None:
    for slot in [s for s in self.regions if not self.held[s]]:
      del self.regions[slot]
      self.free_slots.append(slot)

  def _first_fit(self, size: int) -> int | None:
    """The lowest aligned offset with `size` free bytes from it, or None."""
    start = _SLOTS_BYTES
    for offset, length in sorted(self.regions.values()):
      if offset - start >= size:
        break
      start = max(start, -(-(offset + length) // ALIGNMENT) * ALIGNMENT)
    return start if start + size <= self.size else None


class ArenaView:
  """The receiving end's side of a connection's `Arena`: a message's buffer placed there
  is a region of this mapping (`region`), and the region goes back to the sender once
  no array of it is left here."""

  def __init__(self, fd: int, size: int):
    try:
      self.memory = mmap.mmap(fd, size)
    finally:
      os.close(fd)
    self.size = size
    self.held = np.frombuffer(self.memory, np.uint8, _SLOTS)
    self.regions_read = 0  # buffers that came in this arena

  def region(self, slot: int, offset: int, size: int) -> np.ndarray:
    """The bytes the sender placed at `offset`, until every array viewing them is gone:
    then slot `slot` is cleared. (The arrays a message unpickles to hold this array,
    through the buffer numpy reads them from, and its finalizer runs when the last goes.)"""
    if not (0 <= slot < _SLOTS and _SLOTS_BYTES <= offset and offset + size <= self.size):
      raise ValueError(f'a shared-memory region out of bounds: slot {slot}, {offset}+{size}')
    region = np.frombuffer(self.memory, np.uint8, size, offset)
    self.regions_read += 1
    weakref.finalize(region, self.held.__setitem__, slot, 0).atexit = False
    return region


def _arena_or_none() -> Arena | None:
  """A new arena, or None where the system has no `memfd` (its messages go whole over
  the socket)."""
  try:
    return Arena()
  except (AttributeError, OSError):  # (no os.memfd_create, or no memory for it)
    return None


def _send_descriptor(link: connection.Connection, fd: int) -> None:
  with socket.socket(fileno=os.dup(link.fileno())) as view:
    socket.send_fds(view, [b'a'], [fd])


def _receive_descriptor(link: connection.Connection) -> int:
  with socket.socket(fileno=os.dup(link.fileno())) as view:
    # Close-on-exec from the start: a process forked and exec'd meanwhile by another
    # thread (XLA running a compiler, say) would keep the arena's pages alive.
    data, fds, _, _ = socket.recv_fds(view, 1, 1, socket.MSG_CMSG_CLOEXEC)
  if data != b'a' or len(fds) != 1:
    for fd in fds:
      os.close(fd)
    raise EOFError('the connection ended before its shared memory came')
  return fds[0]


class LaneFailure(Exception):
  """A call that failed in a lane, as the driver reads it: the exception's type name
  and message, the exception itself where it unpickles (`cause`), and whether it came
  of a process's death (a value it needed was in a lane that died)."""

  def __init__(self, type_name: str, message: str, cause=None, death: bool = False):
    super().__init__(f'{type_name}: {message}')
    self.type_name, self.message, self.cause, self.death = type_name, message, cause, death

  def __reduce__(self):
    return LaneFailure, (self.type_name, self.message, self.cause, self.death)


def address_text(address) -> str:
  """A lane's `(host, port)` as `SourceLost` names it (and the driver looks it up)."""
  return f'{address[0]}:{address[1]}'


class SourceLost(Exception):
  """A value a call needed was to come from a lane whose process died (a death)."""

  death = True

  def __init__(self, source: str):
    super().__init__(f'the lane process at {source} that was to send a value died')
    self.source = source

  def __reduce__(self):
    return SourceLost, (self.source,)


def failure(error: BaseException) -> LaneFailure:
  """`error` (raised in a lane) as sent to the driver."""
  if isinstance(error, LaneFailure):
    return error
  try:
    cause = pickle.loads(pickle.dumps(error))
  except Exception:  # an exception that does not pickle: its text is enough
    cause = None
  death = bool(getattr(error, 'death', False))
  return LaneFailure(type(error).__name__, str(error), cause, death)


class Endpoint:
  """One connection of a process, with the lock its writers share.

  `background=True` (the driver's connection to a lane): `send` pickles the message and
  returns; a thread of the endpoint writes it. A write waits for the other end to read,
  and a lane whose core is busy computing reads a large message (a batch) in slices:
  written by the caller, the driver's dispatch waited ~1-2 ms per batch for a lane.
  Messages are written in the order sent. `arena`: the memory this end shares with the
  other for what it sends (`Arena`); `shared`: the other end's, for what it receives
  (set by `_greet` once the other end's hello says it has one)."""

  def __init__(self, link: connection.Connection, background: bool = False, arena=None):
    self.link, self.lock = link, threading.Lock()
    self.arena: Arena | None = arena
    self.shared: ArenaView | None = None
    _tune(link)
    self._outbox = None
    if background:
      self._outbox = queue.SimpleQueue()
      threading.Thread(target=self._write, daemon=True, name='jaxsgd-wire-writer').start()

  def send(self, message) -> None:
    if self._outbox is not None:  # pickled now (its objects may change), placed by the writer
      self._outbox.put(_pickled(message))
      return
    with self.lock:  # whole: the lane's threads share its connection to the driver
      for frame in frames(message, self.arena):
        self.link.send_bytes(frame)

  def _write(self) -> None:
    name_thread(WRITER_THREAD)
    while True:
      pickled = self._outbox.get()
      if pickled is None:
        return
      try:
        for frame in _framed(*pickled, self.arena):
          self.link.send_bytes(frame)
      except (OSError, ValueError):  # the lane is gone (its reader hears of it) or closed
        return

  def receive(self):
    return receive(self.link, self.shared)

  def close(self) -> None:
    """Ends the connection both ways, then closes it: a thread blocked reading it wakes
    with an end (`EOFError`) at once. Closing the descriptor alone does not wake it on
    Linux: it would read on until the other end closed, at any later time."""
    if self._outbox is not None:
      self._outbox.put(None)
    _hang_up(self.link)
    try:
      self.link.close()
    except OSError:
      pass


def _hang_up(link: connection.Connection) -> None:
  """`shutdown(SHUT_RDWR)` of `link`'s socket (nothing if it is closed already)."""
  try:
    with socket.fromfd(link.fileno(), socket.AF_INET, socket.SOCK_STREAM) as view:  # (a dup)
      view.shutdown(socket.SHUT_RDWR)
  except (OSError, ValueError):  # closed, or its other end gone: nothing to end
    pass


def _tune(link: connection.Connection) -> None:
  """Sends each write at once, and lets a large message be written whole before the
  other end reads. A message of several frames is several writes: with Nagle's
  algorithm the second waited for the first's acknowledgement, which the other end
  delays (~40 ms per message between two lanes). And a receiving lane whose core is
  busy computing reads when the scheduler lets it: with the default buffer (~200 KB) a
  batch of a few MB crossed in slices, each waiting for it."""
  with socket.fromfd(link.fileno(), socket.AF_INET, socket.SOCK_STREAM) as view:  # (a dup)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
      view.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)  # (the system caps it)
    try:
      view.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # a Unix socket: nothing to delay
      pass


SOCKET_BUFFER = 8 << 20  # bytes asked for each socket's send and receive buffers


def listen(host: str) -> tuple[connection.Listener, connection.Listener]:
  """A lane's two listeners: TCP on `host` (any port), for processes on other hosts, and
  a Unix socket (Linux's abstract namespace: no file, gone with the process) for those
  on this one: a write on a TCP socket over the loopback runs the receiving side's
  network stack in the sender's system call, most of what sending a task cost the
  driver. Their connections are authenticated by `accept_forever`, not by the listener."""
  remote = connection.Listener((host, 0), backlog=BACKLOG)
  name = f'\0jaxsgd-lane-{os.getpid()}-{secrets.token_hex(8)}'
  local = connection.Listener(name, family='AF_UNIX', backlog=BACKLOG)
  return remote, local


def accept_forever(listener: connection.Listener, authkey: bytes, handle) -> None:
  """Accepts `listener`'s connections until it closes: each one is authenticated, and its
  first message read, in a thread of its own, which then runs `handle(endpoint, hello)`.

  Not in the accepting thread: a peer that dies in the middle of the handshake (a lane
  killed while it connected) raised there and ended it, and every later connection to
  that lane then waited for a handshake that never came (a run hung). A connection that
  fails the handshake is closed and forgotten."""
  while True:
    try:
      link = listener.accept()
    except OSError as error:
      if error.errno in (None, errno.EBADF, errno.EINVAL):  # the listener was closed
        return
      time.sleep(0.05)  # (out of file descriptors, say: the next try may get one)
      continue
    greet = functools.partial(_greet, link, authkey, handle)
    threading.Thread(target=greet, daemon=True, name='jaxsgd-wire-greeter').start()


def _greet(link: connection.Connection, authkey: bytes, handle) -> None:
  try:
    connection.deliver_challenge(link, authkey)
    connection.answer_challenge(link, authkey)
    endpoint = Endpoint(link)
    hello = endpoint.receive()
    if isinstance(hello, tuple) and hello[:1] == (_SHARING,):  # (its arena's descriptor next)
      _, size, hello = hello
      endpoint.shared = _map_or_refuse(link, size, hello)
  except (OSError, EOFError, ValueError, connection.AuthenticationError):
    link.close()
    return
  handle(endpoint, hello)


def _map_or_refuse(link: connection.Connection, size: int, hello) -> 'ArenaView | None':
  """Maps the arena whose descriptor comes next on `link` and tells the sender whether
  it did (`_ARENA_TAKEN` or `_ARENA_REFUSED`): where this process may not map it (a limit
  on its address space, say), the connection carries every buffer over the socket
  instead of ending. A connection that ends here raises."""
  descriptor = _receive_descriptor(link)
  try:
    view = ArenaView(descriptor, size)
  except OSError as error:
    print(
      f'wire: shared memory from {hello!r} not mapped ({error}); its values come over the socket.',
      file=sys.stderr,
      flush=True,
    )
    link.send_bytes(_ARENA_REFUSED)
    return None
  link.send_bytes(_ARENA_TAKEN)
  return view


_SHARING = 'jaxsgd-arena'  # a hello that an arena's descriptor follows (`connect`)
_ARENA_TAKEN, _ARENA_REFUSED = b'mapped', b'refused'  # the receiver's answer to it


# Connections a lane's listener holds while it accepts one: the driver and every other lane
# may connect to a new lane at once (a replaced one). With the default of 1, a Unix socket
# refused the others at once, and a value sent that way was lost (a run hung on it).
BACKLOG = 128


def address(addresses: dict, here: str) -> tuple | str:
  """The address to reach a lane by (`LaneRuntime.serve`'s `addresses`) from host `here`:
  its Unix socket on its own host, else TCP."""
  return addresses['local'] if addresses['host'] == here else tuple(addresses['remote'])


def connect(where, authkey: bytes, hello, background: bool = False, share: bool = True) -> Endpoint:
  """A connection to the lane listening at `where` (`address`), introduced by `hello`
  (`background`: see `Endpoint`). With `share`, a connection within the host (a Unix
  socket) gets an `Arena` for what it sends, its descriptor passed after the hello, and
  keeps it if the receiver says it mapped it (else every buffer goes over the socket)."""
  link = connection.Client(where, authkey=authkey)
  arena = _arena_or_none() if share and isinstance(where, (str, bytes)) else None
  try:
    for frame in frames(hello if arena is None else (_SHARING, arena.size, hello)):
      link.send_bytes(frame)
    if arena is not None:
      _send_descriptor(link, arena.fd)
  finally:
    if arena is not None:
      arena.close_descriptor()
  if arena is not None and _answer(link) != _ARENA_TAKEN:
    arena = None  # (unmapped here once its last view goes)
  return Endpoint(link, background, arena)


def _answer(link: connection.Connection) -> bytes:
  """The receiver's answer to an arena (`_map_or_refuse`); a connection that ended
  first raises `ConnectionResetError`, as a send to it would."""
  try:
    return link.recv_bytes()
  except EOFError as error:
    raise ConnectionResetError('the lane ended the connection before it took its memory') from error


def ended(link: connection.Connection, within: float) -> bool:
  """Whether the other end of `link` closes within `within` seconds (or has): a peek at
  the next byte, which an ended connection does not have; nothing is read."""
  if not link.poll(within):
    return False
  peek = socket.socket(fileno=os.dup(link.fileno()))
  try:
    return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b''
  except OSError:  # reset: ended too
    return True
  finally:
    peek.close()


def exit_now(grace: float = 0.0, status: int = 0) -> None:
  """Ends this lane process, after `grace` seconds, with exit `status` (0: its run's
  driver is gone; else it failed)."""
  time.sleep(grace)
  os._exit(status)


# Seconds a lane whose driver connection ended waits before it exits: a pool that closes
# kills its lanes through Ray as well, and a lane that exited first made Ray print a
# worker's "unexpected" death at every run's end. A driver that died leaves none behind.
DRIVER_GONE_GRACE = 3.0
