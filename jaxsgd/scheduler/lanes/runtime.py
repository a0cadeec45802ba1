"""What runs inside a lane process: named tasks on values that stay in this process.

A `LaneRuntime` is the body of one lane's Ray actor. It keeps the lane's values (any
pytree, including things that cannot be pickled, such as the `VJP` that `jax.vjp`
returns) in a dict keyed by the driver's handles, runs `Task`s on them, and hands
values to other lanes through Ray's object store (`export` here, `adopt` there), so
the data goes lane to lane, never through the driver.

Moving a value whose structure cannot be pickled (a VJP: its leaves are arrays, its
treedef holds the linearized function) sends only its leaves plus how it was made:
the producing `Task`, the shapes and dtypes of its arguments and where in the output
the value sat. The receiving lane rebuilds the structure with `jax.eval_shape` of the
same task — the same trace of the same code, so the same treedef, traced once per task
and argument shapes — and puts the received leaves into it.

Emulated tasks (`executor='emulated'`): a call that carries a duration (`LanePool.start`'s
`seconds`) does not run its task. The lane takes the task's outputs' shapes and dtypes
from `jax.eval_shape` of its function on the arguments (traced once per task and
argument shapes; nothing compiles; a task that reads its arguments' values on the host
runs once for real instead), keeps zeros of them as the result, and waits until
exactly `seconds` have passed since the task's start (`wait_until`): the lane is busy
as long as the task is priced, and what later calls move is as large as the real
result. Its outputs are zeros, so an emulated run's losses and accuracies mean nothing;
its schedule is the process executor's.

A test hook injects a fault into a real run: `JAXSGD_TEST_LANE_FAULT=LANE:TASK:N` in
the driver's environment (passed to every lane) makes the N-th `TASK` of lane `LANE`
raise, and `LANE:TASK:N:kill` makes that lane's process SIGKILL itself there instead
(`TASK` `info`: the pool's first call to the lane, while it starts).
"""

import collections
import functools
import hashlib
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Hashable
from typing import Any

import numpy as np
import ray

from jaxsgd import allocator, compilation_cache
from jaxsgd.scheduler.executor import holds_ends
from jaxsgd.scheduler.lanes import wire
from jaxsgd.scheduler.lanes.device_path import DevicePath, Offer, uses_device_path
from jaxsgd.scheduler.lanes.placement import COPY_CORES_VARIABLE


FAULT_VAR = 'JAXSGD_TEST_LANE_FAULT'  # a test hook: see the module docstring
# Seconds an emulated task's wait spins at its end, after sleeping for the rest
# (`wait_until`): a sleep alone overruns by the scheduler's wake-up delay (about a tenth
# of a millisecond), a short spin at the end does not; 0.3 ms leaves a margin for a
# wake-up delayed by load. benchmarks/schedule_error.py reports the waits of its runs.
SPIN_SECONDS = 3e-4
# A free of a copy that no call took in (`free`).
DISCARD = 'discard'
# What a lane's threads are called for the OS (`wire.name_thread`; `/proc/PID/task/TID/comm`):
# role -> name. The calls thread runs the tasks; the others are its copy threads (`CopyCpu`).
THREAD_NAMES = {
  'calls': 'jaxsgd-calls',
  'exports': 'jaxsgd-exports',
  'driver reader': 'jaxsgd-driver',
  'lane reader': 'jaxsgd-lanes-in',
}


class CopyCpu:
  """The CPU seconds a lane's copy threads have used, and the cores they run on: the
  readers of its connections (taking in messages and device-path pulls) and its export
  thread (copying values out and sending them), read live from each thread's CPU clock.
  A task's `run` takes what they used during the task out of its process's CPU time, so
  that the task's figure is its own computing, which a cost profile prices (the virtual
  clock prices the copies apart, as links and take-ins). A thread waiting for a message
  uses none. `cores`: where they run (`LaneSpec.copy_cores`); None: the process's own."""

  def __init__(self, cores: tuple[int, ...] | None = None):
    self._lock = threading.Lock()
    # thread -> (its CPU clock, at start, its id in the OS)
    self._clocks: dict[int, tuple[int, float, int]] = {}
    self._ended = 0.0  # what the copy threads that have ended used
    self.cores = cores

  def counted(self, body, *args):
    """`body(*args)`, this thread's CPU counted as the copies' while it runs, on the copy
    threads' cores."""
    ident = threading.get_ident()
    with self._lock:
      self._clocks[ident] = (
        time.pthread_getcpuclockid(ident),
        time.thread_time(),
        threading.get_native_id(),
      )
      if self.cores is not None:
        os.sched_setaffinity(0, self.cores)  # (0: this thread, on Linux)
    try:
      return body(*args)
    finally:
      with self._lock:
        _, began, _ = self._clocks.pop(ident)
        self._ended += time.thread_time() - began

  def total(self) -> float:
    with self._lock:
      live = sum(time.clock_gettime(clock) - began for clock, began, _ in self._clocks.values())
      return self._ended + live

  def place(self, cores: tuple[int, ...]) -> None:
    """Moves the copy threads, those running and those to come, to `cores`: what they
    copy in and out then runs beside the lane's tasks instead of between them."""
    with self._lock:
      self.cores = cores
      for _, _, native in self._clocks.values():
        os.sched_setaffinity(native, cores)


class MakerFailed(RuntimeError):
  """A value cannot be exported from lane `lane`: the call `key` that was to make it
  raised. The driver, reading this inside another lane's failure, waits for that call's
  own failure, the cause to report (its reply may come later than this)."""

  def __init__(self, lane: str, key: int, value: Hashable):
    super().__init__(
      f'lane {lane}: value {value} cannot be exported: the task that was to make it failed.'
    )
    self.lane, self.key, self.value = lane, key, value

  def __reduce__(self):
    return MakerFailed, (self.lane, self.key, self.value)


class Ref:
  """An argument that stands for a value held by the lane (the driver's handle key)."""

  __slots__ = ('key',)

  def __init__(self, key: Hashable):
    self.key = key

  def __reduce__(self):
    return Ref, (self.key,)

  def __repr__(self):
    return f'Ref({self.key!r})'


def _exit_on_failure(body):
  """`body`, a lane thread's whole work, made to end the lane's process (its traceback
  printed) if it raises: the driver then hears of a death at once. A thread that died
  alone left the driver waiting for ever for what it was to send."""

  @functools.wraps(body)
  def guarded(*args, **kwargs):
    try:
      return body(*args, **kwargs)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      sys.stderr.flush()
      wire.exit_now(status=1)

  return guarded


def ray_whereabouts() -> dict:
  """This Ray worker's host address, node and GPUs (`LaneRuntime`'s `where`)."""
  return {
    'host': ray.util.get_node_ip_address(),
    'node_id': ray.get_runtime_context().get_node_id(),
    'gpus': list(ray.get_gpu_ids()),
  }


def check_cores(
  cores: tuple[int, ...], field: str = 'cores', allowed: set[int] | None = None
) -> tuple[int, ...]:
  """`cores` (the placement's `field`), refused if not of `allowed` (default: those this
  process may use; on another host than the driver's, the placement could not check
  them)."""
  allowed = os.sched_getaffinity(0) if allowed is None else allowed
  if not set(cores) <= allowed:
    raise ValueError(
      f'placement: {field} {sorted(set(cores) - allowed)} are not cores of this host '
      f'({", ".join(map(str, sorted(allowed)))}).'
    )
  return cores


def pin_process(cores: tuple[int, ...] | None) -> tuple[int, ...]:
  """Pins every thread of this process (and those it starts later) to `cores`; refuses
  cores this process may not use (`check_cores`)."""
  if cores is not None:
    check_cores(cores)
    pin_threads(cores)
  return tuple(sorted(os.sched_getaffinity(0)))


def pin_threads(cores: tuple[int, ...]) -> None:
  """Pins every thread of this process (and those it starts later) to `cores`, unchecked:
  a process pinned to fewer cores may be given back those it had."""
  for tid in os.listdir('/proc/self/task'):
    try:
      os.sched_setaffinity(int(tid), cores)
    except OSError:  # a thread that ended meanwhile
      pass


class LaneRuntime:
  """One lane: values by key, tasks run in the order the driver sent them."""

  def __init__(
    self,
    name: str,
    cores: tuple[int, ...] | None,
    variables: dict | None = None,
    authkey: bytes | None = None,
    moves: str = 'auto',
    where: dict | None = None,
  ):
    """`variables`: the lane's environment (`LaneSpec.environment`: JAX's platform, XLA's
    flags), set before JAX is imported here. (A library that read its variable before,
    as numpy's BLAS does its thread count, keeps its default: XLA's threads and the
    process's cores are what bound a lane.) `authkey`: the pool's key for the lane's
    socket (`serve`); None serves none. `moves`: `LaneSpec.moves`, the path its values
    take to and from lanes that have the device path on too (device_path.py). `where`:
    the lane's host, Ray node and GPUs (`host`, `node_id`, `gpus`), asked of Ray here if
    not given (a lane forked by `forked.LaneHost` is no Ray worker: its parent says)."""
    self.name = name
    self.where = where if where is not None else ray_whereabouts()
    allocator.keep_freed_memory()  # before any message's buffers
    if variables:
      _take_variables(variables)
    copies = os.environ.get(COPY_CORES_VARIABLE)  # (`LaneSpec.copy_cores`)
    copy_cores = check_cores(tuple(map(int, copies.split(','))), 'copies') if copies else None
    self.host_cores = os.sched_getaffinity(0)  # (what `place_copies` may choose from)
    self.cores = pin_process(cores)  # before JAX's backend (and its threads) starts
    import jax

    self.jax = jax
    self.device = jax.local_devices()[0]
    # A CPU lane keeps a value it takes in as the host arrays it came in: a jitted call
    # takes those in its own C++ dispatch (~3 µs an array, on CPU without a copy: the
    # frames they are views of are aligned as XLA needs, `wire.ALIGNMENT`), where
    # `jax.device_put` spent ~12 µs an array in Python (a 34-array message: 410 µs
    # against 90). Another device needs its copy there once.
    self.host_arrays = self.device.platform == 'cpu'
    self.values: dict[Hashable, Any] = {}
    self.origins: dict[Hashable, tuple] = {}  # key -> (task, abstract args, path)
    self.tasks: dict[int, tuple] = {}  # number -> (task, its function) (`_task`)
    self.emulated: dict[Hashable, Any] = {}  # (number, argument shapes) -> zeros (`_emulate`)
    self.structures: dict[Hashable, Any] = {}  # a moved part's origin -> its treedef (`adopt`)
    # `_rebuilt`: task number -> the structures of its results' parts, seen to pickle; and
    # the tasks whose results have held a part that does not
    self.plain: dict[int, tuple] = {}
    self.rebuilding: set[int] = set()
    self.stopped = threading.Event()
    self.fault = _fault(name)  # (task name, n, kill) of the test hook, or None
    # `export` runs in a thread of its own (`serve`) and waits here for the value
    # it exports, which a call still queued on the lane's ordered thread may make.
    self.stored = threading.Condition()
    self.failed_calls: set = set()  # keys of calls that raised (their values never come)
    # Copies sent here by other lanes, not taken in yet (`take_in`), by key; the copies
    # that failed (key -> failure); the sources found dead; keys freed before they came.
    self.arrived: dict[Hashable, Any] = {}
    self.import_failures: dict[Hashable, Exception] = {}
    self.dead_sources: set = set()
    self.discard: set = set()
    # Where this process took the place of a lost one of its lane (`LanePool.replace`):
    # the first key number of its own, and that process's address (`_void`).
    self.predecessor: tuple[int, str] | None = None
    # Exports of values not made or come yet, in the order asked (`_run_exports`).
    self.parked: list[tuple] = []
    # Replies of tasks the driver ran ahead of, held while two calls are queued behind them
    # (`_answer`), the numbers of those it asked for at once (`hasten`), and the lock
    # that keeps the replies in order between this lane's call and reader threads.
    self.held: list[tuple] = []
    self.hastened: set = set()
    self.last_ended = -1  # the number of the last call the ordered thread answered
    self.held_lock = threading.Lock()
    # (copy number, seconds from its value existing to its last frame written): the
    # export thread's time per copy (`export_times`), the last `_EXPORT_TIMES_KEPT`.
    self.export_spans: collections.deque = collections.deque(maxlen=_EXPORT_TIMES_KEPT)
    self.device_path: DevicePath | None = None
    # The arenas of the senders connected now, and the regions read from those gone
    # (`info`'s count; `_let_go`).
    self.shared_views: list[wire.ArenaView] = []
    self.shared_read_before = 0
    # what the copy threads' CPU was (`run` leaves it out), and their cores
    self.copies = CopyCpu(copy_cores)
    self.address = self.serve(authkey, moves) if authkey is not None else None

  def info(self) -> dict[str, Any]:
    """Where this lane runs, for the placement printed at start and error messages."""
    self._maybe_fail('info')
    return {
      'name': self.name,
      'host': self.where['host'],
      'hostname': socket.gethostname(),
      'pid': os.getpid(),
      'cores': self.cores,
      'node_id': self.where['node_id'],
      'gpus': list(self.where['gpus']),
      'device': str(self.device),
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'address': self.address,
      'pulled': self.device_path.pulled if self.device_path else 0,  # on the device path
      # large buffers that came in memory a sender shares with this lane (wire.Arena)
      'shared_in': self.shared_read_before
      + sum(view.regions_read for view in list(self.shared_views)),
      # regions of its arenas that the lanes it sends to hold now
      'shared_lent': sum(p.arena.lent() for p in list(self.peers.values()) if p.arena),
    }

  def run(self, call: bytes, imports: tuple = (), *buffers):
    """Runs a task call (`LanePool._task_call`: `(task, args, key, frees, seconds,
    describe)` pickled, its large arrays in `buffers`): `task(*args)`, `Ref`s replaced by
    values, its result kept under `key`, after taking in `imports` (`take_in`); then frees
    the keys `frees` names. With `seconds` (not None) the task is emulated (module
    docstring: `_emulate`). An argument that came in `buffers` is a view of the message's
    memory (`wire.receive`): jaxsgd's tasks are jitted and never write into one.

    Returns `(outline, entered, start, end, cpu, scalars)`: the result's outline — nested
    tuples as tuples, every other value as `(nbytes, description)`, its parts kept under
    `(key, path)`; None unless `describe`, which the driver asks for only until this lane
    has kept a result of the same task on arguments of the same shapes, whose outline is
    the same (`LanePool.early`): an outline reads every leaf, time between two calls that
    grew with the model — then when the call began here, and the task's start and end
    (`time.time()` in this lane; start after its imports were taken in, end with the
    result computed). Between a call's end and the next call's `entered` the lane waits
    for the driver to send that call, if it has not yet, and for Ray to hand it over;
    between `entered` and `start`, for its imports (`benchmarks/lane_overheads.py`).
    `cpu`: the CPU seconds this lane's process used from `start` to `end` (every thread of
    it), less what its copy threads used meanwhile (`CopyCpu`): the task's own computing,
    against which `end - start` holds what else ran on its cores, or a wait (an emulated
    task sleeps).
    `scalars`: `(path, value)` of each part that is one number (a loss), as a Python
    number, so that the driver reads it without a call (`LanePool.scalar`): a `fetch` runs
    behind every call queued on the lane, and the driver's loss checks waited ~0.1 s for
    one every 128 steps, hearing no task's end meanwhile (LPP-SGD, 16 emulated lanes).
    """
    entered = time.time()
    named, args, key, free, seconds, describe = pickle.loads(call, buffers=buffers)
    try:
      number = named if isinstance(named, int) else named[0]
      task, fn = self._task(named)
      self._maybe_fail(getattr(task, 'name', None))
      self.take_in(imports)
      values = self._resolve(args)
      cpu, copied = time.process_time(), self.copies.total()
      if seconds is None:
        start = time.time()
        # Finished means computed: the driver's clock and its errors need that, not dispatch.
        result = self.jax.block_until_ready(fn(*values))
        end = time.time()
      else:
        result, start, end = self._emulate(number, task, fn, values, seconds)
      cpu = max(0.0, time.process_time() - cpu - (self.copies.total() - copied))
      # How the result was made, for the parts a move must rebuild (`export`); ~30 µs a
      # call, so only where the result may hold such a part.
      rebuilt = self._rebuilt(number, result, checked=not describe)
      origin = (task, self.jax.tree.map(_abstract, values)) if rebuilt else None
      scalars = []
      with self.stored:  # (its exports are woken once the driver is told: `_run_calls`)
        outline = self._keep(result, key, (), origin, describe, scalars)
      return outline, entered, start, end, cpu, tuple(scalars)
    except BaseException:
      with self.stored:
        self.failed_calls.add(key)
        self._changed()
      raise
    finally:
      self.free(free)

  def _emulate(self, number: int, task, fn, values, seconds: float) -> tuple:
    """`(result, start, end)` of an emulated task: zeros shaped as `fn(*values)`'s outputs,
    and `time.time()` at its start and once exactly `seconds` have passed. The outputs'
    shapes come from `jax.eval_shape` (a trace, no compilation), once per task and
    argument shapes; their zeros are made once and kept (values are immutable, and an
    emulated task donates nothing), so a task costs the lane only its lookup within
    its `seconds` (the first of a kind also its trace: as a real first call compiles). A
    task that cannot be traced abstractly runs once instead, for its outputs' shapes."""
    began, start = time.perf_counter(), time.time()
    leaves, treedef = self.jax.tree.flatten(values)
    signature = (number, treedef, tuple(map(_abstract, leaves)))
    try:
      result = self.emulated.get(signature)
    except TypeError:  # an argument that does not hash: not kept
      signature, result = None, None
    if result is None:
      try:
        outline = self.jax.eval_shape(fn, *values)
      except _host_value_errors(self.jax):
        # A task that reads its arguments' values on the host (an output shaped by a
        # value, a device asked of an argument) has no abstract trace: it runs once,
        # for real, for its outputs' shapes (within its `seconds` if it fits there).
        outline = self.jax.block_until_ready(fn(*values))
      zeros = lambda s: self.jax.numpy.zeros(s.shape, s.dtype, device=self.device)  # noqa: E731
      result = self.jax.block_until_ready(self.jax.tree.map(zeros, outline))
      if signature is not None:
        self.emulated[signature] = result
    wait_until(began + seconds)
    return result, start, start + (time.perf_counter() - began)

  def _task(self, named) -> tuple:
    """`(task, its function)` of a call's task: `(number, task)` the first time a task
    reaches this lane (kept), its number afterwards; built here the first time it is
    needed, unless `prepare` built it before."""
    if isinstance(named, tuple):
      number, task = named
      self.tasks.setdefault(number, (task, None))  # (prepared: kept, built)
    else:
      number = named
    task, fn = self.tasks[number]
    if fn is None:
      fn = task.recipe.build()[task.name]  # (a recipe is built once per process)
      self.tasks[number] = (task, fn)
    return task, fn

  def prepare(self, call: bytes, *buffers) -> None:
    """Builds tasks to come (`LanePool.prepare`): `(number, task)` pairs, pickled. Built
    at its first call instead, a pipeline stage's task waited for the stage before it to
    run its own first call, so the stages built one after another. A build that fails
    here is tried again by the task's first call (which carries the task as ever), and
    that call fails with its error: the driver waits for calls, not for this."""
    for number, task in pickle.loads(call, buffers=buffers):
      try:
        self._task((number, task))
      except Exception:  # pylint: disable=broad-except
        self.tasks.pop(number, None)

  def put(self, value, key: Hashable, free: tuple = ()):
    """Keeps `value` (sent by the driver) on this lane's device under `key`."""
    self.free(free)
    value = self.jax.device_put(value, self.device)
    with self.stored:
      self.values[key] = value
      self._changed()
    return _outline(self.jax, value)

  def _keep(self, value, key, path, origin, describe: bool = True, scalars: list | None = None):
    """Keeps `value`'s parts (a tuple's items, nested) under `(key, path)`; `origin`:
    `(task, abstract args)` that made it, noted for each part. Returns its outline
    (`run`) if `describe`, else None. Appends `(path, its value as a Python number)` of
    each part that is one number to `scalars`."""
    if type(value) is tuple:
      kept = tuple(
        self._keep(v, key, path + (i,), origin, describe, scalars) for i, v in enumerate(value)
      )
      return kept if describe else None
    part = (key, path)
    self.values[part] = value
    if scalars is not None and getattr(value, 'shape', None) == () and _is_number(value):
      scalars.append((path, value.item()))  # a Python number: pickled in a tenth of the time
    if origin is not None:
      self.origins[part] = (*origin, path)
    return _outline(self.jax, value) if describe else None

  def _rebuilt(self, number: int, result, checked: bool = False) -> bool:
    """Whether a part of this result of task `number` may have a structure that does not
    pickle (a VJP's), so that moving it rebuilds it from the task (`export`). False only
    for structures seen to pickle: a task's last such structures are kept (a few µs to
    compare, where noting the arguments' shapes costs ~30), and a task whose results
    once held a part that does not is always noted (its results may change structure
    with its arguments' shapes; a VJP's structure is new at every call of an unjitted
    `jax.vjp`, so it is never kept). `checked`: this lane kept a result of this task on
    arguments of the same shapes before (the driver asked for no outline), whose
    structure was checked then — the same trace, the same structure: not read again
    (~30 µs for a 34-array gradient)."""
    if number in self.rebuilding:
      return True
    if checked and number in self.plain:
      return False
    structures = tuple(self.jax.tree.structure(part) for part in _parts(result))
    if self.plain.get(number) == structures:
      return False
    if all(_pickles(structure) for structure in structures):
      self.plain[number] = structures
      return False
    self.rebuilding.add(number)
    return True

  def fetch(self, key: Hashable, free: tuple = (), imports: tuple = ()):
    """The value as numpy arrays (for logging and final results)."""
    try:
      self.take_in(imports)
      return self.jax.device_get(self._held(key))
    finally:
      self.free(free)

  def export(self, key: Hashable, imports: tuple = (), target: dict | None = None):
    """The value under `key`, to be taken in by another lane (or kept by the driver):
    `(ready, payload)`, `ready` when the value existed here (`time.time()`), where its
    copy starts. Its leaves are numpy arrays, or an `Offer` on the device path, taken if
    the lane at `target` (its addresses) has that path on too.

    Runs in the lane's export thread (`serve`): it waits for the value to exist
    (`_stored`), not for every call queued before it. In the lane's ordered thread an
    export waited behind the tasks queued after the one that made its value: PD-ASGD's
    residuals waited ~120 ms behind the next forward on the forward worker's lane, and
    its backward could not overlap that forward. No frees ride with it: a call queued
    earlier may still need what they name."""
    self.take_in(imports)
    value = self._stored(key)
    ready = time.time()
    leaves, treedef = self.jax.tree.flatten(value)
    try:
      structure = ('treedef', pickle.dumps(treedef))
    except Exception:
      origin = self.origins.get(key)
      try:
        pickle.dumps(origin)
      except Exception:
        origin = None
      if origin is None:
        raise TypeError(
          f'lane {self.name}: value {key} cannot be moved: its structure '
          'does not pickle, and it was not made by a task whose arguments '
          'do (the receiving lane rebuilds it from that task).'
        ) from None
      structure = ('origin', origin)
    if self.device_path is not None and target is not None and target.get('transfer'):
      return ready, (structure, self.device_path.offer(leaves))
    return ready, (structure, self._host_leaves(leaves))

  def _host_leaves(self, leaves: list) -> list:
    """`leaves` as numpy arrays. On a CPU lane each is one already: `np.asarray` is a
    view of it (~1 µs an array), where `jax.device_get` first asks every leaf for an
    asynchronous copy to the host (~11 µs an array in all: a 34-array gradient's export
    spent ~0.35 ms there). Another device's leaves are copied to the host all at once."""
    on_host = leaves if self.host_arrays else self.jax.device_get(leaves)
    return [np.asarray(leaf) for leaf in on_host]

  def _stored(self, key: Hashable):
    """The value under `key` once a call has made it (or raises if that call failed, or
    if it was the lost predecessor's: `_void`)."""
    with self.stored:
      while not self._is_made(key):
        self.stored.wait(0.5)
      if key not in self.values:
        self._raise_if_void(key)
        raise MakerFailed(self.name, key[0], key)
      return self.values[key]

  def _is_made(self, key: Hashable) -> bool:
    """Whether the call that makes `key` has made it or failed, or will never run here
    (`_void`; holding `stored`)."""
    return key in self.values or key[0] in self.failed_calls or self._void(key)

  def _void(self, key: Hashable) -> bool:
    """Whether `key` names a value of the lost process this one replaced: made by a call
    sent there, or copied there. It never comes here; waited for, an export of one (a
    worker's handle from before the loss, moved on) waited for ever, and so did the lane
    taking the copy in."""
    return self.predecessor is not None and key[0] < self.predecessor[0]

  def _raise_if_void(self, key: Hashable) -> None:
    """Raises the lost predecessor's death (`wire.SourceLost`: the driver names the lane)
    if `key` was its value (`_void`)."""
    if key not in self.values and key not in self.arrived and self._void(key):
      raise wire.SourceLost(self.predecessor[1])

  def take_in(self, imports: tuple) -> None:
    """Adopts each `(key, source address)` of `imports`, a copy another lane sends here
    (`LanePool._move`), waiting for it if it has not come yet; raises if its copy
    failed, or `wire.SourceLost` if its source's process died first."""
    for key, source in imports:
      self.adopt(self._arrival(key, source), key, describe=False)

  def _arrival(self, key: Hashable, source):
    with self.stored:
      come = self._come(key, source)
    if not come and not holds_ends(self.calls.qsize()):
      self.send_held()  # (this lane waits, its queue short: the driver hears them now)
    with self.stored:
      while not self._come(key, source):
        self.stored.wait(0.5)
      if key in self.arrived:
        return self.arrived.pop(key)
      if key in self.import_failures:
        raise self.import_failures.pop(key)
      self._raise_if_void(key)
      raise wire.SourceLost(wire.address_text(source))

  def _come(self, key: Hashable, source) -> bool:
    """Whether the copy `key` from `source` has come, failed, or lost its source's
    process, or went to this lane's lost one (`_void`; holding `stored`)."""
    return (
      key in self.arrived
      or key in self.import_failures
      or source in self.dead_sources
      or self._void(key)
    )

  def adopt(self, payload: tuple, key: Hashable, free: tuple = (), describe: bool = True):
    """Takes a value exported by another lane (`export`'s payload) and keeps it under
    `key`; returns its outline if `describe` (the driver hears it of a landed copy), else
    None (a copy taken in by a call: the driver knows it)."""
    self.free(free)
    (kind, structure), leaves = payload
    jax = self.jax
    if kind == 'treedef':
      treedef = pickle.loads(structure)
    else:
      treedef = self._structure_made_by(*structure)
      self.origins[key] = structure
    if not self.host_arrays:
      leaves = jax.device_put(leaves, self.device)  # (one call: 34 arrays 645 -> 438 µs)
    value = jax.tree.unflatten(treedef, leaves)
    with self.stored:
      self.values[key] = value
      self._changed()
    return _outline(jax, value) if describe else None

  def _structure_made_by(self, task, abstract, path: tuple):
    """The treedef of the part at `path` of `task`'s result on arguments shaped as
    `abstract`: `jax.eval_shape` of the task, traced once per task, argument shapes and
    path and kept — the same trace of the same code gives the same structure, and a
    trace costs milliseconds (~4 ms for a VJP of eight dense layers), paid at every move
    of a VJP by the lane that takes it in, in front of the task that reads it."""
    jax = self.jax
    shapes, arguments = jax.tree.flatten(abstract)
    try:  # (a Python scalar by its type too: 1, 1.0 and True are equal, and trace apart)
      signature = (task, arguments, tuple((type(x), x) for x in shapes), path)
      treedef = self.structures.get(signature)
    except TypeError:  # an argument that does not hash: traced every time
      signature, treedef = None, None
    if treedef is None:
      outline = jax.eval_shape(task, *abstract)
      for i in path:
        outline = outline[i]
      treedef = jax.tree.structure(outline)
      if signature is not None:
        self.structures[signature] = treedef
    return treedef

  def free(self, keys: tuple = ()):
    """Drops the values under `keys`; `(DISCARD, key)`: a copy sent here that no call
    took in, dropped when it comes if it has not yet."""
    for key in keys:
      if key[0] == DISCARD:
        with self.stored:
          if self.arrived.pop(key[1], None) is None:
            self.discard.add(key[1])
        continue
      self.values.pop(key, None)
      self.origins.pop(key, None)

  def count(self, free: tuple = ()) -> int:
    self.free(free)
    return len(self.values)

  def export_times(self) -> dict:
    """`{copy number: seconds}` of the copies this lane sent since the last call: from
    the value existing here to the copy's last frame written to its socket, the export
    thread's time for it (`link_timing.measure_process_links`' `export`)."""
    spans = {}
    while self.export_spans:
      number, seconds = self.export_spans.popleft()
      spans[number] = seconds
    return spans

  def place_copies(self, cores: tuple[int, ...] | None) -> tuple[int, ...]:
    """Moves this lane's copy threads to `cores` (None: the lane's own), those running
    and those to come (`CopyCpu.place`); returns where they run now."""
    placed = self.cores if cores is None else check_cores(cores, 'copies', self.host_cores)
    self.copies.place(placed)
    return placed

  def copy_cpu(self) -> float:
    """The CPU seconds this lane's copy threads have used so far (`CopyCpu.total`)."""
    return self.copies.total()

  def watch(self):
    """Never returns while the lane lives: the driver learns of its death through it.

    Runs on the process's main thread, Ray's last call to the lane: while it waits, Ray's
    task loop there, which takes Python's lock every 10 ms to check for signals, does not
    run (`cluster._LANE_ACTOR`).
    """
    self.stopped.wait()

  # -- the wire (wire.py): calls from the driver, values to and from other lanes ---------

  def serve(self, authkey: bytes, moves: str = 'auto') -> tuple:
    """Opens this lane's socket (on its node's address) and its threads: one accepts
    connections and reads each (the driver's calls, other lanes' values), one runs the
    driver's calls in the order sent (`_ORDERED`), one exports values (`_EXPORTS`); and,
    if `moves` puts the lane on the device path, its transfer server. Returns the
    addresses."""
    self.host = self.where['host']
    remote, local = wire.listen(self.host)
    if uses_device_path(moves, self.device.platform):
      try:
        self.device_path = DevicePath(self.jax, self.device, self.host)
      except Exception as error:  # pylint: disable=broad-except
        if moves == 'device':  # asked for: the lane cannot run as placed
          raise
        print(  # auto: the host path works wherever the lane does
          f'lane {self.name}: no transfer server ({error}); its moves take the host path.',
          file=sys.stderr,
          flush=True,
        )
    self.authkey = authkey
    self.shares = moves != 'socket'  # (wire.Arena: with lanes of its host that share too)
    self.calls, self.exports = queue.SimpleQueue(), queue.SimpleQueue()
    self.driver: wire.Endpoint | None = None
    self.driver_connected = threading.Event()
    self.peers: dict[tuple, wire.Endpoint] = {}  # address -> connection, to lanes we send to
    exports = functools.partial(self.copies.counted, self._run_exports)
    for name, target in (('lane-_run_calls', self._run_calls), ('lane-_run_exports', exports)):
      threading.Thread(target=_exit_on_failure(target), daemon=True, name=name).start()
    connected = _exit_on_failure(self._connected)
    for listener in (remote, local):
      accept = functools.partial(wire.accept_forever, listener, authkey, connected)
      threading.Thread(target=accept, daemon=True, name='lane-accept').start()
    # Its TCP address names the lane (to other lanes, in `dead` notices).
    transfer = self.device_path.address if self.device_path else None
    return {
      'remote': remote.address,
      'local': local.address,
      'host': self.host,
      'transfer': transfer,
      'shared': self.shares,
    }

  def _connected(self, endpoint: wire.Endpoint, hello) -> None:
    """Reads a new connection (`wire.accept_forever`): the driver's calls, or the values
    of the lane whose address its hello names."""
    if endpoint.shared is not None:
      self.shared_views.append(endpoint.shared)
    if hello[0] == 'driver':  # (its calls bring the driver's arrays: a batch, a `put`)
      self.driver = endpoint
      self.driver_connected.set()
      self.copies.counted(self._read_driver, endpoint)
    else:  # ('lane', its TCP address)
      self.copies.counted(self._read_lane, endpoint, tuple(hello[1]))

  def _read_driver(self, endpoint: wire.Endpoint) -> None:
    """Hands each call to the thread that runs it; exits the process once the driver's
    connection ends (its run is over, or its driver died)."""
    wire.name_thread(THREAD_NAMES['driver reader'])
    while True:
      try:
        message = endpoint.receive()
      except (EOFError, OSError):
        wire.exit_now(wire.DRIVER_GONE_GRACE)
      op = message[0]
      if op == 'hasten':  # the driver now waits for that task's end
        self.hasten(message[1])
      elif op == 'predecessor':  # before any call: this process replaced a lost one
        with self.stored:
          self.predecessor = tuple(message[2])
          self._changed()
      elif op == 'dead':  # a lane that was to send values here, or to take them, died
        with self.stored:
          self.dead_sources.add(tuple(message[2]))
          self._changed()
        self._drop_peer(tuple(message[2]))
      elif op in _EXPORTS:
        self.exports.put(message)
      elif op in _BESIDE:  # answered now, not after the calls queued before it
        self._answer(_BESIDE, *message)
      else:
        self.calls.put(message)
      # Not held while the next message is awaited: its arrays (a batch) would stay alive,
      # and their memory lent (`wire.Arena`), until the driver's next call.
      del message

  def _read_lane(self, endpoint: wire.Endpoint, source: tuple) -> None:
    """Takes the values another lane sends: kept for the call that takes them in, or —
    a message that must land whole — taken in at once; the driver hears of each."""
    wire.name_thread(THREAD_NAMES['lane reader'])
    while True:
      try:
        message = endpoint.receive()
      except (EOFError, OSError):
        self._let_go(endpoint.shared)
        self._source_lost(source)
        return
      if not self._take_copy(endpoint, source, *message):
        return
      # Not held while the next message is awaited: a copy freed here meanwhile would stay
      # alive, and its memory lent (`wire.Arena`), until its source's next message.
      del message

  def _take_copy(self, endpoint, source: tuple, kind, key, move, landed, *rest) -> bool:
    """One message of another lane (`_read_lane`); False once its source is lost."""
    if kind == 'failed':
      self._copy_failed(key, move, landed, rest[0])
      return True
    ready, payload = rest
    if isinstance(payload[1], Offer):  # the device path: its leaves come now
      try:
        gone = functools.partial(self._gone, source, endpoint)
        payload = (payload[0], self.device_path.pull(payload[1], gone))
      except Exception as error:  # pylint: disable=broad-except
        if self._gone(source, endpoint, within=_SOURCE_END_S):  # its source died
          self._source_lost(source)  # as when a host-path copy's connection ends
          return False
        self._copy_failed(key, move, landed, wire.failure(error))
        return True
    if landed:
      try:
        outline = self.adopt(payload, key)
      except Exception as error:  # pylint: disable=broad-except
        self._reply('err', move, wire.failure(error))
        return True
      self._reply('ok', move, (outline, ready, time.time()))
      return True
    with self.stored:
      if key in self.discard:
        self.discard.discard(key)
      else:
        self.arrived[key] = payload
        self._changed()
    self._reply('arrived', move, (ready, time.time()))
    return True

  def _gone(self, source: tuple, endpoint: wire.Endpoint, within: float = 0.0) -> bool:
    """Whether the lane at `source` has died: the driver said so, or its connection here
    (`endpoint`) ends within `within` s — which `wire.ended` sees only once the messages
    before the end are read, hence the driver's word too."""
    with self.stored:
      if source in self.dead_sources:
        return True
    return wire.ended(endpoint.link, within=within)

  def _source_lost(self, source: tuple) -> None:
    """The lane at `source` died: a call waiting for a copy from it fails as a death."""
    with self.stored:
      self.dead_sources.add(source)
      self._changed()

  def _copy_failed(self, key: Hashable, move, landed: bool, error) -> None:
    """A copy that failed at its source or on its way: the call that takes it in raises
    (`_arrival`), and the driver hears of it."""
    if not landed:
      with self.stored:
        self.import_failures[key] = error
        self._changed()
    self._reply('err', move, error)

  def _run_calls(self) -> None:
    wire.name_thread(THREAD_NAMES['calls'])
    while True:
      op, number, args = self.calls.get()
      if self._answer(_ORDERED, op, number, args) and op in _RUNS:
        self._made()
      # Not held while the next call is awaited (its batch's memory lent: `_read_driver`).
      args = None

  def _answer(self, ops: dict, op: str, number, args: tuple) -> bool:
    """Runs `ops[op](*args)` and replies with its result or its failure; whether it ran.

    In the ordered thread, a task the driver ran ahead of (`run_ahead`) does not wake
    the driver while this lane has `HOLD_WHILE_QUEUED` calls or more queued behind it:
    its reply is held, and sent with the next reply the ordered thread sends
    (`_send_after_held`) — a task's that the driver waits for, a failure, a fetch's or a
    put's, or that of a task with fewer calls queued behind it, so that the driver hears
    of room on this lane before it has run its queue dry —, when the next call waits for
    a copy to come with one call or none behind it (`send_held`), or when the driver asks
    for it (`hasten`). The driver hears several ends per wake-up: woken by each end of a
    task that computed ~30 ms, its threads used ~0.6 ms of CPU per task
    (`benchmarks/driver_cpu.py`), against ~0.1 ms for ends a fraction of a millisecond
    apart."""
    send = self._send_after_held if ops is _ORDERED else lambda reply: self._reply(*reply)
    try:
      result = ops[op](self, *args)
    except BaseException as error:  # pylint: disable=broad-except
      send(('err', number, wire.failure(error)))
      return False
    if op == 'run_ahead' and holds_ends(self.calls.qsize()):
      with self.held_lock:
        self.last_ended = number
        if number not in self.hastened:
          self.held.append(('ok', number, result))
          return True
    send(('ok', number, result))
    return True

  def _send_after_held(self, reply: tuple) -> None:
    """Sends the held replies, then `reply` (the ordered thread's), in that order."""
    with self.held_lock:
      self._send_held()
      self.hastened.discard(reply[1])
      self.last_ended = reply[1]
      self._reply(*reply)

  def _send_held(self) -> None:
    """Sends the held replies (holding `held_lock`)."""
    held, self.held = self.held, []
    for reply in held:
      self._reply(*reply)

  def send_held(self) -> None:
    """Sends the held replies now, if any: the lane is about to wait for a copy to come,
    with fewer than `HOLD_WHILE_QUEUED` calls queued behind the one that waits (`_arrival`).
    A lane holds the ends of tasks run ahead so that the driver, woken less often, takes
    less of the cores the lanes compute on (`_answer`), until its queue runs short; one
    whose queue is short and that waits computes nothing, and the driver then costs the
    tasks little where it runs on that core. Released at the next reply instead, they
    reached the driver as a pipeline's stage went on from its backward to its update:
    the driver woke on that stage's core and its ~1-3 ms of work came between the two,
    on the path the next stage waited along (DDG K=2 on two cores). A lane with a long
    queue (a parameter server's, fed by many workers) keeps holding: the driver needs no
    room there."""
    with self.held_lock:
      if self.held:
        self._send_held()

  def hasten(self, number) -> None:
    """The driver waits for task `number`'s end (a `Ready` on its result): its reply goes
    at once — if it is held, with every reply held; else at its end."""
    with self.held_lock:
      if any(reply[1] == number for reply in self.held):
        self._send_held()
      elif number > self.last_ended:  # (else its reply has gone)
        self.hastened.add(number)

  def _made(self) -> None:
    """Wakes the exports of a task's result, after its end's reply has gone (or been
    held, `_answer`): woken as
    the result was kept, the export thread took the interpreter from the call thread
    between the task's end and its reply, and the driver heard of an end whose result
    was copied 0.5-1.0 ms after it, of one whose was not 0.2 ms (quiet lanes, a 34-array
    result); the reply first delays the copy by the reply's write alone (~0.06 ms)."""
    with self.stored:
      self._changed()

  def _run_exports(self) -> None:
    """Serves the driver's exports in the order asked, except that one whose value is not
    made (or come) yet is parked until it is (`_changed` wakes this thread then), so it
    holds up none behind it. Served strictly in order, one waiting for its value held up
    every export behind it: on PD-ASGD's forward worker lane the residuals of an earlier
    batch, long made, waited for the export of the next batch's, asked for at its
    backward's dispatch, until that batch's forward had run (36 ms of an idle backward
    worker, its layers' updates late with it, in an emulated 1:7 run)."""
    wire.name_thread(THREAD_NAMES['exports'])
    while True:
      message = self.exports.get()
      ready, waiting = [], []
      with self.stored:
        if message is not _WAKE:
          self.parked.append(message)
        for parked in self.parked:  # ((op, number, (key, imports, ...)), in the order asked)
          (ready if self._exportable(*parked[2][:2]) else waiting).append(parked)
        self.parked = waiting
      for parked in ready:
        self._export_one(*parked)

  def _exportable(self, key: Hashable, imports: tuple) -> bool:
    """Whether `export(key, imports)` would not wait: its imports have come (or failed)
    and its value is made (or failed), or is one of them (`_arrival`, `_stored`; holding
    `stored`)."""
    come = all(self._come(at, source) for at, source in imports)
    return come and (self._is_made(key) or any(k == key for k, _ in imports))

  def _changed(self) -> None:
    """Wakes whoever waits on `stored` (held): a value was kept, a copy came or failed, a
    call failed, a source died; and the export thread if an export waits for one."""
    self.stored.notify_all()
    if self.parked:
      self.exports.put(_WAKE)

  def _export_one(self, op: str, number, args: tuple) -> None:
    if op == 'keep':  # to the driver
      try:
        result = self.export(*args)[1]
      except BaseException as error:  # pylint: disable=broad-except
        self._reply('err', number, wire.failure(error))
      else:
        self._reply('ok', number, result)
      return
    key, imports, target, target_key, landed = args
    try:
      ready, payload = self.export(key, imports, target)
      message = ('value', target_key, number, landed, ready, payload)
    except BaseException as error:  # pylint: disable=broad-except
      message = ('failed', target_key, number, landed, wire.failure(error))
    try:
      self._send_to_lane(target, message)
    except (OSError, EOFError) as error:  # the driver learns that this copy failed
      self._reply('err', number, wire.failure(error))
      return
    if message[0] == 'value':
      self.export_spans.append((number, time.time() - ready))

  def _let_go(self, view: wire.ArenaView | None) -> None:
    """Forgets the arena of a sender whose connection ended, keeping its count: its
    mapping then lives only as long as arrays of it do (a lane replaced in a run would
    otherwise keep its predecessor's pages here for good)."""
    if view is not None and view in self.shared_views:
      self.shared_views.remove(view)
      self.shared_read_before += view.regions_read

  def _drop_peer(self, address: tuple) -> None:
    """Closes the connection to a lane that died, and with it this lane's arena for it:
    nothing is sent there again, so it was otherwise kept for good."""
    peer = self.peers.pop(address, None)
    if peer is not None:
      peer.close()

  def _send_to_lane(self, addresses: dict, message) -> None:
    """Sends `message` to the lane at `addresses`, connecting the first time (tried a few
    times: a lane just started may be accepting others); raises if it cannot."""
    name = tuple(addresses['remote'])
    for attempt in range(_CONNECT_TRIES):
      try:
        peer = self.peers.get(name)
        if peer is None:
          where = wire.address(addresses, self.host)
          hello = ('lane', self.address['remote'])
          share = self.shares and addresses.get('shared', False)
          peer = wire.connect(where, self.authkey, hello, share=share)
          self.peers[name] = peer
        peer.send(message)
        return
      except (OSError, EOFError):
        self.peers.pop(name, None)
        if attempt == _CONNECT_TRIES - 1:
          raise
        time.sleep(0.05 * 2**attempt)

  def _reply(self, kind: str, number, value) -> None:
    """Sends `(kind, number, value)` to the driver, once it has connected: connections
    are read each in a thread of its own, so a lane's value can come in before the
    driver's hello is read (a replaced lane, sent a copy as soon as it was up; its reply
    was lost with the thread, and the run waited for that copy for ever)."""
    if self.driver is None and not self.driver_connected.wait(_DRIVER_CONNECT_S):
      print(
        f'lane {self.name}: no driver connected within {_DRIVER_CONNECT_S:.0f} s; exiting.',
        file=sys.stderr,
        flush=True,
      )
      wire.exit_now(status=1)
    try:
      self.driver.send((kind, number, value))
    except (OSError, EOFError):
      wire.exit_now()
    except Exception as error:  # pylint: disable=broad-except
      # The reply does not pickle (nothing was written): the call fails, not the lane.
      self.driver.send(('err', number, wire.failure(error)))

  def _maybe_fail(self, task: str | None) -> None:
    """The test hook (`FAULT_VAR`): the N-th run of the named task (or `info`: the
    pool's first call, at start) raises, or kills us."""
    if self.fault is None or task != self.fault[0]:
      return
    self.fault[1] -= 1
    if self.fault[1] == 0:
      if self.fault[2]:  # (a word first, as a crash leaves one on standard error)
        print(f'injected fault ({FAULT_VAR}): killed in task {task!r}', file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      raise RuntimeError(f'injected fault ({FAULT_VAR}) in task {task!r}')

  def _resolve(self, args):
    def value(leaf):
      return self._held(leaf.key) if isinstance(leaf, Ref) else leaf

    return self.jax.tree.map(value, args, is_leaf=lambda x: isinstance(x, Ref))

  def _held(self, key: Hashable):
    """The value under `key` here; raises the lost predecessor's death if it was its
    (`_void`), else a `KeyError` naming it."""
    try:
      return self.values[key]
    except KeyError:
      with self.stored:
        self._raise_if_void(key)
      raise KeyError(
        f'lane {self.name}: no value {key} here (freed, or held by another lane).'
      ) from None


def _is_number(value) -> bool:
  """Whether `value`'s dtype is a boolean, integer or floating type (not a PRNG key's)."""
  return getattr(getattr(value, 'dtype', None), 'kind', None) in ('b', 'i', 'u', 'f')


# The driver's calls a lane runs in its ordered thread, one at a time in the order sent,
# and those its export thread runs (`LaneRuntime.serve`).
_ORDERED = {
  'run': LaneRuntime.run,
  'run_ahead': LaneRuntime.run,  # a task whose reply may be held (`_answer`)
  'prepare': LaneRuntime.prepare,
  'put': LaneRuntime.put,
  'fetch': LaneRuntime.fetch,
  'count': LaneRuntime.count,
  'export_times': LaneRuntime.export_times,
  'info': LaneRuntime.info,
  'adopt': LaneRuntime.adopt,
}
_RUNS = ('run', 'run_ahead')
_EXPORTS = ('export', 'keep')
# The driver's calls a lane answers at once, in the reader of its connection, beside the
# calls queued on its ordered thread: they read or move its copy threads only, so that a
# run can measure and place them while its lanes compute (`LanePool.copy_cpu`).
_BESIDE = {'place_copies': LaneRuntime.place_copies, 'copy_cpu': LaneRuntime.copy_cpu}
_WAKE = ('wake',)  # `_changed`: a parked export may be served now
_DRIVER_CONNECT_S = 60.0  # the driver connects as soon as the lane is up (`LanePool._link`)
_EXPORT_TIMES_KEPT = 1024  # copies whose export time a lane keeps until asked
_CONNECT_TRIES = 5  # a send to another lane: 50 ms to 0.8 s apart, 1.5 s in all
# s a lane waits, after a failed pull, for the source's connection to end: a source that
# died ends both at once; a live one's pull failed on its own (its error is the copy's)
_SOURCE_END_S = 2.0


def _host_value_errors(jax) -> tuple:
  """What `jax.eval_shape` raises for a function that needs its arguments' values on the
  host (JAX is imported in a lane only once it is pinned: `LaneRuntime`)."""
  errors = jax.errors
  return (
    errors.ConcretizationTypeError,
    errors.TracerArrayConversionError,
    errors.TracerBoolConversionError,
    errors.TracerIntegerConversionError,
  )


def wait_until(deadline: float, spin: float = SPIN_SECONDS) -> None:
  """Returns once `time.perf_counter()` has reached `deadline`: sleeps until `spin`
  seconds before it, then spins (a sleep alone overran by ~130 µs: `SPIN_SECONDS`)."""
  left = deadline - time.perf_counter()
  if left > spin:
    time.sleep(left - spin)
  while time.perf_counter() < deadline:
    pass


def _take_variables(variables: dict[str, str]) -> None:
  """Sets `variables` in this process's environment before JAX's backend starts. JAX
  was imported with this module's package and read its `JAX_*` flags then, so those
  are also set in its config; XLA reads `XLA_FLAGS` when the backend starts. Refuses a
  process whose backend has started (Ray gave the lane a worker that ran JAX before)."""
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    raise RuntimeError(
      "lane process: JAX's backend started before the lane set its variables "
      f'({", ".join(sorted(variables))}); a lane needs a fresh Ray worker process.'
    )
  os.environ.update(variables)
  compilation_cache.set_jax_flags(variables)


def _fault(lane: str) -> list | None:
  """`[task, n, kill]` if the test hook names this lane (`LANE:TASK:N[:kill]`)."""
  parts = os.environ.get(FAULT_VAR, '').split(':')
  if len(parts) < 3 or parts[0] != lane:
    return None
  return [parts[1], int(parts[2]), parts[3:] == ['kill']]


def _abstract(leaf):
  """`leaf`'s abstract value: a jax.Array's own (read in ~0.1 µs; it pickles, hashes and
  traces as a `jax.ShapeDtypeStruct`, which costs ~2 µs a leaf to make: 70 µs of the time
  between a VJP's call and the next for the 35 arguments of an MLP's forward)."""
  if type(leaf) is np.ndarray:  # a CPU lane's copy, kept as it came (`adopt`): made once
    shape_dtype = (leaf.shape, leaf.dtype)
    known = _HOST_ABSTRACT.get(shape_dtype)
    if known is None:
      import jax

      known = _HOST_ABSTRACT.setdefault(shape_dtype, jax.ShapeDtypeStruct(*shape_dtype))
    return known
  aval = getattr(leaf, 'aval', None)
  if aval is not None:
    return aval
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    import jax

    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=getattr(leaf, 'weak_type', False))
  return leaf


_HOST_ABSTRACT: dict[tuple, Any] = {}  # (shape, dtype) -> its ShapeDtypeStruct (`_abstract`)


def _parts(value) -> list:
  """The parts a task's result is kept as (`LaneRuntime._keep`): a tuple's items, nested."""
  if type(value) is tuple:
    return [part for item in value for part in _parts(item)]
  return [value]


def _pickles(treedef) -> bool:
  try:
    pickle.dumps(treedef)
    return True
  except Exception:
    return False


def _spec(leaf) -> tuple:
  """`(shape, dtype name, nbytes)` of a leaf, read from a jax.Array's aval where it has
  one: an array's own `.shape`, `.dtype` and `.nbytes` cost ~1–3 µs each, `str` of a
  dtype ~4 µs, and a call's outline reads every leaf of its result (a VJP's outline
  took ~115 µs)."""
  aval = getattr(leaf, 'aval', None)
  if aval is not None and isinstance(aval.dtype, np.dtype):  # (not a PRNG key's dtype)
    dtype = aval.dtype
    name = _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype))
    return aval.shape, name, aval.size * dtype.itemsize
  dtype = str(getattr(leaf, 'dtype', type(leaf).__name__))
  return getattr(leaf, 'shape', None), dtype, int(getattr(leaf, 'nbytes', 0))


_DTYPE_NAMES: dict[np.dtype, str] = {}  # `_spec`


def _outline(jax, value) -> tuple[int, str]:
  """`(nbytes, description)`: `float32[3, 4]` for an array; for a pytree its type, leaf
  count and a digest of its leaves' shapes and dtypes (equal shapes, equal digest, in
  every process)."""
  leaves = jax.tree.leaves(value)
  specs = [_spec(leaf) for leaf in leaves]
  nbytes = sum(spec[2] for spec in specs)
  if len(leaves) == 1 and hasattr(leaves[0], 'shape') and value is leaves[0]:
    return nbytes, f'{specs[0][1]}{list(specs[0][0])}'
  shapes = repr([(shape, dtype) for shape, dtype, _ in specs])
  digest = hashlib.blake2s(shapes.encode(), digest_size=4).hexdigest()
  return nbytes, f'{type(value).__name__}({len(leaves)} leaves #{digest})'
