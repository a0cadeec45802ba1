"""The driver's side of the lanes: one OS process per lane, values held there by handle.

    with LanePool(LanePlacement.spread(['stage0', 'stage1'])) as pool:
      params = pool.start('stage0', Task(recipe, 'init'), (seed,))
      pool.wait_any([params])                   # -> params, finished
      y = pool.start('stage0', Task(recipe, 'forward'), (params.result(), x))
      pool.wait_any([y])
      out = pool.start('stage1', Task(recipe, 'loss'), (y.result(),))   # y moves lane->lane
      pool.wait_any([out]); print(pool.fetch(out.result()))

Each lane is a Ray actor (its own process, its own JAX runtime, pinned to its cores:
see `placement.py`), created on the host its `LaneSpec` names; Ray starts, places and
watches it, and the run's calls go over the lane's own socket (wire.py). Tasks arrive
by name (`tasks.Task`: a recipe and a name, built inside the lane), never as pickled
closures. A task's result stays in the lane; the driver gets a `Handle` (a tuple of
handles when the task returns a tuple), freed in the lane once the driver drops it. A
handle passed to a task on another lane is first moved there, lane to lane (`move`):
the source lane sends it at once, and the first call on the target lane that needs it
takes it in. A lane runs the driver's calls in the order sent, so a task started after
a move (or after a task that made its argument) sees it.

Faults: `wait_any` raises `LaneError` naming the lane and its host when a task raises
in a lane, a copy fails, or a lane's process dies (it hears of every lane, not only
those it waits on). `remove(lane)` drops a lost lane so that the others carry on. `close()` ends every
lane process; it runs on leaving the `with` block, on Ctrl-C and on SIGTERM; a pool that
started its own Ray cluster shuts it down too (every process of it, at once).

Signals: while a pool is open, SIGTERM interrupts the driver as Ctrl-C does
(`KeyboardInterrupt`, the one exception Ray passes through its waits unchanged; a
`SystemExit` raised inside a Ray wait comes out as exit status 1) and is remembered
(`sigterm_received()`), so that the caller can exit as a SIGTERM should; the handlers
installed before the pool (not the `sys.exit(15)` of `ray.init`) are restored when the
last pool closes. A signal handler's exception can be lost: Python runs the handler
wherever the main thread is, and one raised inside a garbage-collector callback (JAX
has one) is printed and dropped. So every wait of the pool waits in slices of
`_STOP_CHECK` seconds and raises `KeyboardInterrupt` again between them while a
signal is on record (`_StopSignals.check`): the run stops within a slice, whatever
swallowed the first. While `close()` runs, further Ctrl-Cs and SIGTERMs are only
remembered, so that the clean-up is not cut short.
"""

import contextlib
import dataclasses
import functools
import itertools
import os
import pickle
import queue
import signal
import textwrap
import threading
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from ray import cloudpickle

from jaxsgd.scheduler.lanes import cluster, wire
from jaxsgd.scheduler.lanes.placement import LanePlacement, LaneSpec
from jaxsgd.scheduler.lanes.runtime import DISCARD, Ref
from jaxsgd.scheduler.tasks import Task

_STOP_CHECK = 0.25  # seconds: how often a wait looks for a signal whose exception was lost


class LaneError(RuntimeError):
  """A lane's task raised, or its process died; names the lane and its host.

  `lost_input`: the lane whose lost process held a value the failed task took in (that
  process since replaced), or None. The task's own lane is then sound: `reset` keeps its
  process, where `replace` would start a new one."""

  def __init__(self, lane: str, host: str, message: str, lost_input: str | None = None):
    super().__init__(f'lane {lane!r} on host {host}: {message}')
    self.lane, self.host, self.lost_input = lane, host, lost_input


class Handle:
  """The driver's reference to a value that stays in one lane's process.

  Attributes:
    lane: the lane holding the value.
    key: its key in that lane.
    nbytes: bytes of its arrays (what a move would copy).
    description: `float32[128, 10]`, or the type and leaf count of a pytree.
  """

  __slots__ = ('lane', 'key', 'nbytes', 'description', '_drop', '__weakref__')

  def __init__(self, pool: 'LanePool', lane: str, key: Hashable, nbytes: int, description: str):
    self.lane, self.key, self.nbytes, self.description = lane, key, nbytes, description
    self._drop = pool._drop

  def __del__(self):
    # Frees the value in its lane once the driver drops the last reference (`_drop`
    # queues the key for the lane's next call). Not `weakref.finalize`: its set-up and
    # call cost ~8 µs of the driver's Python a handle, several handles a task.
    self._drop(self.lane, self.key)

  def __reduce__(self):
    raise TypeError(
      f'{self!r}: a handle is not sent; pass it to LanePool.start, which '
      'moves its value to the lane that needs it.'
    )

  def __repr__(self):
    return f'Handle({self.lane}:{self.key}, {self.description})'


@dataclasses.dataclass(eq=False)
class Pending:
  """A task started on a lane; `result()` is its handle(s) once `wait_any` returned it.

  Once done, `started` and `ended` are the task's start and end in the lane
  (`time.time()` there; the result computed, not only dispatched), `entered` when its
  call began there (before taking in its imports: `LaneRuntime.run`), and `sent` when
  the driver sent the call (`time.time()` here, just before): comparable with the
  lane's stamps on one host (clocks of two hosts may differ); `cpu` the CPU seconds the
  lane's process used from `started` to `ended`, less what its copy threads used
  meanwhile (`runtime.CopyCpu`). A move (`move(landed=True)`) has no call
  of its own: they stay None.
  """

  lane: str
  task: Any
  ref: Any  # the number its reply comes with (wire.py)
  key: int
  args: tuple  # keeps the argument handles alive until the task finished
  signature: Hashable = None  # the task and its arguments' shapes: keys `early` results
  source: str | None = None  # a move's (`move(..., landed=True)`): the lane it copies from
  copies: tuple = ()  # and its copies (refs), the last one `ref`
  done: bool = False
  sent: float | None = None
  entered: float | None = None
  started: float | None = None
  ended: float | None = None
  cpu: float | None = None
  held: bool = False  # started `ahead`: its lane may hold its reply (`LanePool.start`)
  imports: tuple = ()  # `(key, source's address)` of the moved values its call takes in
  _result: Any = None

  def finish(self) -> None:
    self.done, self.args = True, ()

  def result(self):
    if not self.done:
      raise RuntimeError(
        f'{self.task!r} on lane {self.lane!r}: not finished; wait_any returns it when it is.'
      )
    return self._result


class LanePool:
  """Lane processes for `placement`, on a Ray cluster (started here, or at `address`).

  Args:
    placement: the lanes and where they run; printed at start (`verbose`).
    address: a running Ray cluster's address (`host:port`, or 'auto'); None starts a
      cluster on this machine for the pool's lifetime.
    env: extra environment variables for every lane process.
    verbose: print the placement (with each lane's host, pid and cores) at start.
  """

  def __init__(
    self,
    placement: LanePlacement,
    address: str | None = None,
    env: dict[str, str] | None = None,
    verbose: bool = True,
  ):
    self.placement = placement
    self._keys = itertools.count()
    self._freed: dict[str, list] = {name: [] for name in placement.names}
    self._lock = threading.Lock()
    # copies on their way: move number -> (lane, source handle, its key's order)
    self._moves: dict[int, tuple[str, Handle, int]] = {}
    self._failed_moves: dict[int, Exception] = {}  # copies that failed, not yet raised
    # exports whose span was asked for (`move(exports=...)`) -> it, once arrived
    self._exported: dict[int, tuple[float, float] | None] = {}
    self._outlines: dict[Hashable, Any] = {}  # Pending.signature -> the result's outline
    # (lane, signature) of results a lane described (`_task_call`'s `describe`): it has
    # kept one of that signature, so it need not describe (or check) another.
    self._described: set[tuple[str, Hashable]] = set()
    self._unfinished: dict[int, Pending] = {}  # tasks started, not yet returned by wait_any
    # calls and copies unanswered when their lane was `reset` -> the task's (None: a copy)
    self._forgotten: dict[int, Pending | None] = {}
    self._preparing: dict[int, str] = {}  # `prepare` messages unanswered -> their lane
    # copies not yet taken in: (lane, key) -> the address of the lane sending it (`_move`)
    self._imports: dict[tuple[str, Hashable], tuple] = {}
    self._task_numbers: dict[Task, int] = {}  # `_task_number`
    self._host_array = _HostCopies()  # driver arrays sent as arguments, as numpy
    self._tasks_sent: dict[str, set[int]] = {name: set() for name in placement.names}
    self._closed = False
    self._replaced: dict[str, int] = {}  # lane -> the first key of its newest process
    self._lost_sources: dict[str, str] = {}  # `host:port` of a replaced process -> its lane
    self.info: dict[str, dict] = {}  # each lane's `LaneRuntime.info`, once all have answered
    self.started_early: tuple[str, ...] = ()  # lanes whose process `connect_soon` started
    # The wire (wire.py): a connection per lane, whose reader threads put what they read
    # in `_events`; the replies read so far (call number -> (order read, kind, value)),
    # and the lanes whose process has ended (name -> how it was learnt).
    self._authkey = os.urandom(16)
    self._links: dict[str, wire.Endpoint] = {}
    self._readers: list[threading.Thread] = []  # every link's, ended by `close`
    self._events: queue.SimpleQueue = queue.SimpleQueue()
    self._replies: dict[int, tuple[int, str, Any]] = {}
    self._read = itertools.count()
    self._dead: dict[str, str] = {}
    self._keeps: dict[int, tuple] = {}  # `keep` references -> (lane, its link then)
    # Handle keys of results that are one number -> the value, sent with the task's reply
    # (`scalar`); dropped with the handle.
    self._scalars: dict[Hashable, float | int | bool] = {}
    # Copies (`_move`) of a handle of no dimensions made by a task that has not replied
    # yet: its call number -> (the part's path, a weak reference to each copy's handle),
    # given the part's number with the reply if it is one; each copy registered there ->
    # the key of the task's part it copies (a copy of it copies that part too).
    self._scalar_copies: dict[int, list[tuple[tuple, weakref.ref]]] = {}
    self._scalar_source: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    if verbose:  # what the next seconds are spent on
      where = (
        'a Ray cluster on this machine' if address is None else f'the Ray cluster at {address}'
      )
      print(f'lanes: starting {len(placement.names)} lane processes on {where}...', flush=True)
    before = _StopSignals.current()  # `ray.init` installs a SIGTERM handler of its own
    self._owns_connection = cluster.connect(address)
    self._signals = _StopSignals.install(before)
    try:
      cluster.check_gpus(placement.lanes)
      self._env = env or {}
      self._actors = {}  # filled as each starts: `close` ends those started so far
      self._start_lanes(placement.lanes)
      asked = {name: actor.info.remote() for name, actor in self._actors.items()}
      self._watch = {name: cluster.watch(actor) for name, actor in self._actors.items()}
      self.info = self._gather_info(asked)
      for name in placement.names:
        self._link(name)
    except BaseException:
      self.close()
      raise
    if verbose:
      print(self.describe(), flush=True)

  # -- the API an executor uses ------------------------------------------------------

  def start(
    self,
    lane: str,
    task,
    args: Sequence = (),
    *,
    seconds: float | None = None,
    ahead: bool = False,
  ) -> Pending:
    """Starts `task(*args)` on `lane`; handles in `args` (any pytree) are moved there.

    `task` is a `tasks.Task` (a recipe and a name): the lane builds the function
    itself. A plain function is refused, so that no closure is ever pickled.

    `seconds` (emulated tasks): the lane does not compute `task` but takes exactly that
    long and returns zeros of the shapes and dtypes `task(*args)` would return
    (`LaneRuntime.run`), so that what later calls move is as large as the real thing.

    `ahead`: the caller goes on with `early(pending)` if it is known, and hears the end
    later: the lane may then hold the task's reply while it has two calls queued behind
    it, sending it with its next reply (`LaneRuntime._answer`; `Pending.held`). `hasten`
    asks for it at once.
    """
    if not isinstance(task, Task):
      raise TypeError(
        f'LanePool.start: a tasks.Task (recipe and name) expected, got '
        f'{task!r}; lanes build their functions from recipes.'
      )
    link = self._link_of(lane)
    args = tuple(args)
    # Flattened once, for what is sent and for the signature: a `Handle` is a leaf (no
    # pytree node), and every Python step here is the driver's, per task.
    leaves, treedef = jax.tree.flatten(args)
    here = []  # the arguments' handles on this lane (moved here for this call, or not)
    sent = treedef.unflatten([self._argument(leaf, lane, here) for leaf in leaves])
    key = next(self._keys)
    imports = self._take_imports(lane, here)
    signature = _signature(task, treedef, leaves)
    describe = (lane, signature) not in self._described
    call, buffers = self._task_call(lane, task, sent, key, seconds, describe)
    held = ahead and signature in self._outlines  # (`early` knows its handles)
    at = time.time()
    link.send(('run_ahead' if held else 'run', key, (call, imports, *buffers)))
    here.clear()  # kept alive until sent, so that a copy's free follows this call
    pending = Pending(lane, task, key, key, args, signature, sent=at, held=held, imports=imports)
    self._unfinished[key] = pending
    return pending

  def hasten(self, pending: Pending) -> None:
    """Asks `pending`'s lane for its end at once, not held (the caller now waits for
    it); nothing if it was not started `ahead`, or is done."""
    if pending.held and not pending.done:
      pending.held = False
      self._link_of(pending.lane).send(('hasten', pending.key))

  def prepare(self, lane: str, tasks: Sequence[Task]) -> None:
    """Has `lane` build `tasks` now, before any call of them reaches it (in the order of
    its calls: behind what was sent to it before). A lane otherwise builds a task at its
    first call — most of a second for a model's stage in a new process — and a pipeline
    stage's first call waits for the stage before it to finish its own, so the stages
    built one after another; prepared, every lane builds at once. Nothing is waited
    for, and a task's first call still carries it: a build that failed here is tried
    again there, and the call fails with its error."""
    link = self._link_of(lane)
    known = self._tasks_sent[lane]
    numbers = {self._task_number(task): task for task in tasks}
    new = tuple((number, task) for number, task in numbers.items() if number not in known)
    if not new:
      return
    call, buffers = _dumps(new)
    key = next(self._keys)
    self._preparing[key] = lane  # its reply (nothing) is dropped when it comes
    link.send(('prepare', key, (call, *buffers)))

  def early(self, pending: Pending):
    """The handle(s) of `pending` before it finishes, or None if they cannot be known yet.

    Known once the same task has finished on arguments of the same shapes (a task's
    outline depends only on those). A task started on a lane after this one may use
    them — on this lane or, moved, on another — since calls to a lane run in the
    order sent: the driver can run ahead of the lanes, as the in-process real clock
    runs ahead of its devices. `wait_any` still returns `pending` when it finishes
    (with its times), and raises if it failed.
    """
    if pending.done or pending._result is not None:
      return pending._result
    outline = self._outlines.get(pending.signature)
    if outline is None:
      return None
    pending._result = self._handles(pending.lane, (pending.key, ()), outline)
    return pending._result

  def wait_any(self, pending: Sequence[Pending], timeout: float | None = None) -> Pending | None:
    """The first of `pending` to finish (None after `timeout` seconds).

    Raises `LaneError` if that task raised, if a copy failed, or if any lane's process
    has died.
    """
    if not pending:
      raise ValueError('wait_any: nothing pending.')
    deadline = None if timeout is None else time.monotonic() + timeout
    by_number = {}  # what a reply's number finishes: a task, or a move (its last copy)
    for p in pending:
      by_number[p.key if p.source is None else p.copies[-1]] = p
    while True:
      self._check_lanes()
      finished = self._first_finished(by_number)
      if finished is not None:
        break
      if not self._hear(deadline):
        return None
    if finished.source is not None:  # a move: landed, or failed (naming what failed)
      for copy in finished.copies:
        self._check_move(copy)
      finished.started = finished.ended = time.time()
      finished.finish()
      return finished
    _, kind, value = self._replies[finished.key]
    if kind == 'err':
      self._check_moves_into(finished.lane)  # a copy it took in failed: that is the cause
      error = self._error(finished.lane, value, finished.task, key=finished.key)
      if error.lane == finished.lane:
        self._unfinished.pop(finished.key, None)
        del self._replies[finished.key]
        self._scalar_copies.pop(finished.key, None)  # (no number will come)
      # Else the cause is another lane's (its death, or its earlier failure): this task's
      # failure stays to be read once the caller has dealt with that lane. Taken with the
      # first error, it was never read, and a run that tolerated the other lane's loss
      # waited for this task for ever.
      raise error from value
    self._unfinished.pop(finished.key, None)
    del self._replies[finished.key]
    outline, finished.entered, finished.started, finished.ended, finished.cpu, scalars = value
    self._scalars_came(finished.key, scalars)
    if outline is None:  # not asked for (`_task_call`): this lane described one before
      outline = self._outlines[finished.signature]
    else:
      self._described.add((finished.lane, finished.signature))
      known = self._outlines.setdefault(finished.signature, outline)
      if known != outline:  # `early` handed out handles of another shape: never expected
        raise LaneError(
          finished.lane,
          self._host(finished.lane),
          f'{finished.task!r} returned {outline}, not {known} as before on '
          'arguments of the same shapes.',
        )
    if finished._result is None:  # else `early` made them: one handle per value, ever
      finished._result = self._handles(finished.lane, (finished.key, ()), outline)
    finished.finish()
    return finished

  def _first_finished(self, by_number: dict) -> Pending | None:
    """Of `by_number`'s, the one whose reply was read first (None if none has one): a
    move once every copy of it has landed. Looks through the replies not taken yet or
    through `by_number`, whichever is shorter."""
    first, finished = None, None
    if len(self._replies) <= len(by_number):
      read = ((number, reply[0]) for number, reply in self._replies.items())
    else:
      read = ((n, self._replies[n][0]) for n in by_number if n in self._replies)
    for number, order in read:
      pending = by_number.get(number)
      if pending is None or (first is not None and order >= first):
        continue
      if pending.source is not None:
        orders = [self._replies.get(copy, (None,))[0] for copy in pending.copies]
        if None in orders:
          continue
        order = max(orders)
      if first is None or order < first:
        first, finished = order, pending
    return finished

  def wait_all(self, pending: Sequence[Pending]) -> None:
    """Waits until every one of `pending` has finished (raising as `wait_any` does)."""
    while not all(p.done for p in pending):
      self.wait_any([p for p in pending if not p.done])

  def settle(self) -> None:
    """Waits for the copies still on their way (`move`) and checks each, as `wait_any`
    does (raising `LaneError` if one failed), so that a run ends with every message it
    sent either taken in or known lost."""
    while True:
      self._check_lanes()
      if not self._moves:
        return
      self._hear(None)

  def run(self, lane: str, task, args: Sequence = ()):
    """`start` and wait for it: the task's handle(s)."""
    pending = self.start(lane, task, args)
    self.wait_any([pending])
    return pending.result()

  def put(self, lane: str, value) -> Handle:
    """Sends `value` (a pytree of arrays) from the driver to `lane`; returns its handle."""
    key = (next(self._keys), ())
    value = jax.tree.map(self._host_array, value)
    nbytes, description = self._call(lane, 'put', (value, key, self._take_freed(lane)))
    return Handle(self, lane, key, nbytes, description)

  def fetch(self, handle: Handle):
    """The handle's value, as numpy arrays, in the driver (a logging point)."""
    lane = handle.lane
    imports = self._take_imports(lane, [handle])
    return self._call(lane, 'fetch', (handle.key, self._take_freed(lane), imports))

  def scalar(self, handle: Handle) -> float | int | bool | None:
    """The handle's value, as a Python number (float64 where the lane's was float32), if
    it is one number whose task `wait_any` has returned (its lane sent it with the reply:
    `LaneRuntime.run`) or a copy of one (`move`: a worker's loss sent to its server),
    else None: read without a call, which would wait behind every call queued on the
    lane, and whose round trip the driver waits for."""
    return self._scalars.get(handle.key)

  def keep(self, handle: Handle) -> int:
    """A reference to an export of `handle`'s value to the driver, made at once in the
    lane's export thread: `kept` reads it, even after the lane's process is lost (the
    driver holds it once it came)."""
    lane, number, link = self._ask_export(handle)
    self._keeps[number] = (lane, link)
    return number

  def kept_ready(self, reference: int) -> bool:
    """Whether `kept(reference)` returns without waiting."""
    self._hear_all()
    lane, link = self._keeps[reference]
    return reference in self._replies or self._links.get(lane) is not link or lane in self._dead

  def kept(self, reference: int):
    """The value of a `keep` reference (numpy leaves in its structure); None if the lane's
    process was lost before it exported the value."""
    lane, link = self._keeps.pop(reference)
    try:
      (kind, structure), leaves = self._reply_of(lane, reference, link)
    except LaneError:
      if lane in self._dead or self._links.get(lane) is not link:
        return None  # (its process was lost, or replaced)
      raise
    if kind != 'treedef':
      raise ValueError(f'LanePool.kept: a value rebuilt from its task ({kind}), not kept.')
    return jax.tree.unflatten(pickle.loads(structure), leaves)

  def save(self, handles: Sequence[Handle]) -> list[tuple]:
    """Each handle's value as `(structure, [numpy leaves])`, the form a lane exports and
    `restore` takes back (a checkpoint: `scheduler.snapshot`). The exports run at once,
    one per handle, each in its lane's export thread; a copy not yet taken in by its
    lane is taken in first."""
    asked = [self._ask_export(handle) for handle in handles]
    return [self._reply_of(*question) for question in asked]

  def _ask_export(self, handle: Handle) -> tuple:
    """Asks `handle`'s lane to export its value to the driver (in its export thread);
    `(lane, the call's number, the link asked on)` for `_reply_of`."""
    number = next(self._keys)
    imports = self._take_imports(handle.lane, [handle])
    link = self._link_of(handle.lane)
    link.send(('keep', number, (handle.key, imports)))
    return handle.lane, number, link

  def restore(self, lane: str, payload: tuple) -> Handle:
    """A handle to `payload` (`save`'s form) kept on `lane` again (a resumed run)."""
    key = (next(self._keys), ())
    nbytes, description = self._call(lane, 'adopt', (payload, key, self._take_freed(lane)))
    return Handle(self, lane, key, nbytes, description)

  def move(self, value, lane: str, *, landed: bool = False, exports: list | None = None):
    """`value` with every handle in it replaced by a handle to a copy on `lane`.

    The copy goes lane to lane (wire.py), not through the driver. Returns at once: the
    source sends the value once it exists, and the first call on `lane` that needs the
    copy takes it in, so a task started there afterwards sees it; a failed copy raises
    `LaneError` from `wait_any`.

    `exports` (a list): the number of each copy is appended to it, and once the driver
    has heard that they all arrived, `exported(numbers)` says when the copy ran.

    `landed=True` (a value from a lane that may be lost) returns `(copy, Pending)`
    instead; `wait_any` returns the `Pending` once every copy is on `lane` (its
    `result()` is the copy), or raises `LaneError` naming the source lane if that
    lane's process died first. Delivered only then, a message is never half there.
    """
    refs = [] if landed else None
    moved = jax.tree.map(
      lambda leaf: self._move(leaf, lane, refs, exports) if isinstance(leaf, Handle) else leaf,
      value,
      is_leaf=lambda x: isinstance(x, Handle),
    )
    if not landed:
      return moved
    if not refs:
      raise ValueError(f'LanePool.move(landed=True): nothing to move to {lane!r} in {value!r}.')
    sources = {self._moves[ref][1].lane for ref in refs}
    # Done once every copy has landed (`_finished_at`; each may have failed: `wait_any`
    # checks them all).
    pending = Pending(lane, f'move from {", ".join(sorted(sources))}', refs[-1], -1, ())
    pending.source, pending.copies, pending._result = min(sources), tuple(refs), moved
    return moved, pending

  def remove(self, lane: str) -> None:
    """Ends `lane`'s process (if still alive) and stops watching it.

    After a `LaneError` for a dead lane, an executor that tolerates the loss (an
    asynchronous worker) removes the lane and carries on with the others: they are told
    that nothing more comes from it (a call waiting for a copy from it fails).
    """
    actor = self._actor(lane)
    cluster.kill(actor)
    address = tuple(self.info[lane]['address']['remote'])
    self._links.pop(lane).close()
    del self._actors[lane], self._watch[lane]
    self._dead.pop(lane, None)
    self._tell_dead(address)
    with self._lock:
      self._freed.pop(lane, None)
    self._tasks_sent.pop(lane, None)
    # A process in its place has checked no result's structure (`LaneRuntime._rebuilt`).
    self._described = {done for done in self._described if done[0] != lane}
    self._unfinished = {k: p for k, p in self._unfinished.items() if p.lane != lane}
    self._scalar_copies = {n: c for n, c in self._scalar_copies.items() if n in self._unfinished}
    self._forgotten = {  # (their replies come on its link, which is no longer read)
      k: p for k, p in self._forgotten.items() if p is None or p.lane != lane
    }
    self._preparing = {k: at for k, at in self._preparing.items() if at != lane}
    self._imports = {at: source for at, source in self._imports.items() if at[0] != lane}
    self._moves = {
      number: move for number, move in self._moves.items() if lane not in (move[0], move[1].lane)
    }
    self._failed_moves = {
      number: failed
      for number, failed in self._failed_moves.items()
      if lane not in (failed[0], failed[1].lane)
    }
    self._exported = {  # dropped copies are never seen done
      number: span for number, span in self._exported.items() if span or number in self._moves
    }

  def replace(self, lane: str) -> None:
    """Ends `lane`'s process (if still alive) and starts a new one in its place, on the
    same placement (host, cores, GPU), holding nothing yet; returns once it is up. Every
    handle to a value of the old process is void: a task given one fails, as one taking
    in a value of a lost process does (`LaneError.lost_input`), and so does a copy of
    one (the new process is told which keys were the old one's)."""
    old = wire.address_text(self.info[lane]['address']['remote'])
    self.remove(lane)
    first = self._replaced[lane] = next(self._keys)  # its values made before are void
    # The new process names its void values' source so (`LaneRuntime._void`): unlike the
    # old address, it stays known if the new process is given the old port.
    void = f'{old} (before key {first})'
    self._lost_sources[old] = self._lost_sources[void] = lane
    actor = cluster.lane_actor(self.placement[lane], self._env, self._authkey)
    asked = actor.info.remote()  # (before `watch`: `cluster._LANE_ACTOR`)
    self._actors[lane], self._watch[lane] = actor, cluster.watch(actor)
    with self._lock:
      self._freed[lane] = []
    self._tasks_sent[lane] = set()
    self.info[lane] = self._get(lane, asked, host=self.placement[lane].host or 'driver')
    new = wire.address_text(self.info[lane]['address']['remote'])
    self._lost_sources.pop(new, None)  # (a port may be taken again)
    self._link(lane)
    self._links[lane].send(('predecessor', None, (first, void)))  # (before any call)

  def reset(self, lane: str) -> None:
    """Forgets the calls `lane` has not answered, keeping its process and every value it
    holds: after a task of it failed because a value it took in was in another lane's
    lost process (`LaneError.lost_input`), a caller that starts the lane's work again
    needs no new process. Replaced instead, the lane's process was ended and a new one
    started, compiling its tasks again: a lost LPP-SGD replica cost three lane starts,
    its own and its two workers'.

    Its queued calls still run there, in order, before any sent after this; those that
    took in a value of the lost process fail. Their replies are dropped when they come,
    and the result of one that succeeded is freed there (no handle to it is left, unless
    `early` handed one out). Until they have run, `idle` and `unfinished` do not count
    them; and a copy of a forgotten call's result that fails on another lane is reported
    as that copy's failure (its maker forgotten), as after `remove`."""
    self._open(self._links, lane)
    # Copies to or from it, as `remove` drops them: a caller starting the lane's work
    # again waits for none of them (`settle` would wait for ever for a landed one).
    copies = [k for k, move in self._moves.items() if lane in (move[0], move[1].lane)]
    for number in copies:
      del self._moves[number]
      self._exported.pop(number, None)
      self._forget(number, None)
    self._failed_moves = {
      number: failed
      for number, failed in self._failed_moves.items()
      if lane not in (failed[0], failed[1].lane)
    }
    for number in [k for k, pending in self._unfinished.items() if pending.lane == lane]:
      self._forget(number, self._unfinished.pop(number))

  def _forget(self, number: int, pending: Pending | None) -> None:
    """Drops call or copy `number`'s reply (read, or when it comes: `_heard`), freeing
    the result a forgotten task made (`reset`)."""
    self._scalar_copies.pop(number, None)  # (no number will come)
    reply = self._replies.pop(number, None)
    if reply is None:
      self._forgotten[number] = pending
    elif pending is not None:
      self._free_result(pending, *reply[1:])

  def _free_result(self, pending: Pending, kind: str, value) -> None:
    """Frees in its lane what forgotten task `pending` made, if it succeeded: handles to
    it, made and dropped here, queue their keys' frees (`_drop`)."""
    if kind != 'ok' or pending._result is not None:  # (`early`'s handles free it)
      return
    outline = value[0] if value[0] is not None else self._outlines.get(pending.signature)
    if outline is not None:
      self._handles(pending.lane, (pending.key, ()), outline)

  def exported(self, refs) -> tuple[float, float] | None:
    """`(start, end)` (`time.time()`) of the copies whose numbers `move` appended to its
    `exports` list, once the driver has heard that every one arrived (None until then):
    from when the first value existed on its source lane, where its export began, to
    when the last arrived on the receiving lane (the clocks of one host). The copy's
    taking-in there is not in it: the first call that needs the copy takes it in
    (`_move`), as part of that call."""
    if not all(self._exported.get(ref) for ref in refs):
      return None
    spans = [self._exported.pop(ref) for ref in refs]
    return min(start for start, _ in spans), max(end for _, end in spans)

  def forget_exports(self, refs) -> None:
    """Stops timing the copies of `refs` (`move(exports=...)`) and drops what is known of
    them: a copy that will never be asked for (its run ended without it)."""
    for ref in refs:
      self._exported.pop(ref, None)

  def _move(
    self, handle: Handle, lane: str, landed: list | None = None, exports: list | None = None
  ) -> Handle:
    """A copy of `handle` on `lane`. The source lane's export thread sends the value to
    `lane` at once (`LaneRuntime.serve`); `lane` keeps it until the first call there
    that needs it takes it in (a task using it, a fetch, a move on). Taken in by a call
    of its own as soon as it was sent, a copy made `lane` wait, in its order of calls,
    for the source to export it, with the tasks queued behind it: DDG's first stage
    idled waiting for the gradient of a batch while the activation the next stage
    waited for stood behind that wait. `landed` (a list): taken in at once on arrival
    (the driver hears of it: `move(landed=True)`), its number appended."""
    if handle.lane == lane:
      return handle
    source = self._link_of(handle.lane)
    imports = self._take_imports(handle.lane, [handle])  # a copy moved on
    key = (next(self._keys), ())
    number = key[0]
    target = self.info[lane]['address']
    source.send(('export', number, (handle.key, imports, target, key, landed is not None)))
    self._moves[number] = (lane, handle, number, landed is not None)
    if landed is None:
      self._imports[lane, key] = tuple(self.info[handle.lane]['address']['remote'])
      if exports is not None:
        exports.append(number)
        self._exported[number] = None  # timed once it arrives (`_heard`)
    else:
      landed.append(number)
    copy = Handle(self, lane, key, handle.nbytes, handle.description)
    if handle.description.endswith('[]'):  # one number, maybe: the copy's is the same
      self._copy_scalar(handle, copy)
    return copy

  def _copy_scalar(self, source: Handle, copy: Handle) -> None:
    """`copy` (of `source`, one array of no dimensions) has `source`'s number for
    `scalar`: at once if known, else when the task that made the first source replies
    (`_scalars_came`)."""
    number = self._scalars.get(source.key)
    if number is not None:
      self._scalars[copy.key] = number
      return
    first = self._scalar_source.get(source, source.key)
    if first[0] not in self._unfinished:  # replied (not a number), or no reply to come
      return
    self._scalar_source[copy] = first
    self._scalar_copies.setdefault(first[0], []).append((first[1], weakref.ref(copy)))

  def _scalars_came(self, number: int, scalars: tuple) -> None:
    """Call `number`'s reply said which parts of its result are one number
    (`scalars`: `(path, the number)`s): theirs and their live copies' (`_copy_scalar`)."""
    for path, value in scalars:
      self._scalars[(number, path)] = value
    copies = self._scalar_copies.pop(number, None)
    if copies:
      by_path = dict(scalars)
      for path, ref in copies:
        copy = ref()
        if copy is not None and path in by_path:
          self._scalars[copy.key] = by_path[path]

  def _take_imports(self, lane: str, handles: list) -> tuple:
    """`(key, address of the lane sending it)` of those of `handles` (on `lane`) not
    taken in yet: the call carrying them takes them in first, waiting for them there."""
    imports = []
    for handle in handles:
      source = self._imports.pop((lane, handle.key), None)
      if source is not None:
        imports.append((handle.key, source))
    return tuple(imports)

  def close(self) -> None:
    """Ends every lane process (and the cluster, if this pool started it). Idempotent."""
    if self._closed:
      return
    self._closed = True
    with _StopSignals.deferred():
      for link in getattr(self, '_links', {}).values():
        link.close()  # (a lane whose driver connection ends exits)
      for actor in getattr(self, '_actors', {}).values():
        cluster.kill(actor)
      # Each reader has its end: none outlives the pool to run (and collect garbage
      # holding Ray's references) while Ray shuts down, which ends the process.
      deadline = time.monotonic() + _READERS_END
      for reader in getattr(self, '_readers', ()):
        reader.join(max(0.0, deadline - time.monotonic()))
      if self._owns_connection:
        cluster.shutdown()
    _StopSignals.restore(self._signals)

  # -- inspection ---------------------------------------------------------------------

  def describe(self) -> str:
    rows = []
    for name in self.placement.names:
      info = self.info[name]
      spec = self.placement[name]
      cores = ','.join(map(str, info['cores']))
      gpus = ','.join(map(str, info['gpus'])) or '-'
      rows.append(
        f'  {name}: host={info["host"]} ({info["hostname"]}) pid={info["pid"]} '
        f'cores={cores}{"" if spec.cores else " (not pinned)"}{spec.describe_copies()} gpu={gpus} '
        f'jax={info["device"]}{" moves=device" if info["address"].get("transfer") else ""}'
      )
    # Each lane's process numbers its own devices from 0 (`jax=cpu:0` in every row is
    # each process's first device, not one device shared); `cores`/`gpu` say which.
    header = 'lanes (one process each; jax: the device as that process numbers it):'
    return header + '\n' + '\n'.join(rows)

  @staticmethod
  def nbytes(value) -> int:
    """Bytes of the lane-resident values in `value` (what moving it copies)."""
    return sum(
      leaf.nbytes
      for leaf in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, Handle))
      if isinstance(leaf, Handle)
    )

  def has_process(self, lane: str) -> bool:
    """Whether `lane` has a process in this pool: False once `remove`d (and after a
    `replace` that removed it and then failed to start another)."""
    return lane in self._actors

  def dead_lanes(self) -> set[str]:
    """The lanes whose process the pool has found ended (as heard so far)."""
    self._hear_all()
    return set(self._dead)

  def lane_at(self, address: tuple) -> str:
    """The name of the lane whose process serves at `address` (its remote address, as
    `Pending.imports` has it); `?` if none does now (a replaced lane's old process)."""
    for name, info in self.info.items():
      if tuple(info['address']['remote']) == tuple(address):
        return name
    return '?'

  def pids(self) -> dict[str, int]:
    return {name: info['pid'] for name, info in self.info.items()}

  def idle(self, lane: str) -> bool:
    """Whether every task and copy sent to `lane` has finished (as heard so far, without
    waiting): a call sent to it now (a `fetch`) then runs at once, not after the tasks
    queued there."""
    self._hear_all()
    if any(p.lane == lane and k not in self._replies for k, p in self._unfinished.items()):
      return False
    return not any(move[0] == lane for move in self._moves.values())

  def unfinished(self, lane: str) -> int:
    """How many tasks started on `lane` `wait_any` has not returned yet."""
    return sum(p.lane == lane for p in self._unfinished.values())

  def held(self, lane: str) -> int:
    """How many values `lane` holds (after applying the frees the driver has queued)."""
    return self._call(lane, 'count', (self._take_freed(lane),))

  def lane_info(self, lane: str) -> dict:
    """`lane`'s `LaneRuntime.info()` as it is now (`pool.info[lane]` is as it was at
    start), asked over its socket: Ray's calls to a lane end at its `watch`."""
    return self._call(lane, 'info', ())

  def place_copies(self, lane: str, cores: Sequence[int] | None) -> tuple[int, ...]:
    """Moves `lane`'s copy threads (the readers of its connections, its export thread)
    to `cores`, its tasks staying on its own; None: back to its own cores. Returns the
    cores they run on now. For a placement chosen from a run's measured load
    (`placement.copies_toward_idle`); `LaneSpec.copy_cores` places them at start. The
    lane answers at once, beside the calls queued on it."""
    return tuple(self._call(lane, 'place_copies', (None if cores is None else tuple(cores),)))

  @functools.cached_property
  def driver_host(self) -> str:
    """The driver's host, as the cluster names it (a lane's `info[lane]['host']`)."""
    return cluster.node_address()

  def on_driver_host(self, lane: str) -> bool:
    """Whether `lane`'s process runs on the driver's host (whose cores they share)."""
    return self.info[lane]['host'] == self.driver_host

  def copy_cpu(self, lane: str) -> float:
    """The CPU seconds `lane`'s copy threads have used since it started (a task's own
    `cpu` leaves them out), answered at once, beside the calls queued on it."""
    return self._call(lane, 'copy_cpu', ())

  def export_times(self, lane: str, numbers: Sequence[int] = (), timeout: float = 5.0) -> dict:
    """`{copy number: seconds}` of the copies `lane` has sent since last asked (numbers
    as `move(exports=...)` appends them): each from its value existing on `lane` to its
    last frame written, the time `lane`'s export thread gave it. Asks again until every
    one of `numbers` is there (a lane notes a copy's time once its write has returned,
    which the copy's arrival elsewhere can precede); `TimeoutError` after `timeout` s."""
    times = self._call(lane, 'export_times', ())
    deadline = time.monotonic() + timeout
    while any(number not in times for number in numbers):
      if time.monotonic() > deadline:
        missing = [number for number in numbers if number not in times]
        raise TimeoutError(f'lane {lane!r}: no export time for copies {missing} in {timeout} s')
      time.sleep(0.001)
      times.update(self._call(lane, 'export_times', ()))
    return times

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- internals ----------------------------------------------------------------------

  def _actor(self, lane: str):
    return self._open(self._actors, lane)

  def _open(self, by_lane: dict, lane: str):
    """`by_lane[lane]` of an open pool (one line naming the lanes if there is none)."""
    if self._closed:
      raise RuntimeError('LanePool: closed.')
    try:
      return by_lane[lane]
    except KeyError:
      raise KeyError(f'no lane {lane!r}; lanes: {list(by_lane)}.') from None

  def _task_call(
    self,
    lane: str,
    task: Task,
    args: tuple,
    key: Hashable,
    seconds: float | None = None,
    describe: bool = True,
  ) -> tuple[bytes, list]:
    """`LaneRuntime.run`'s call, pickled here: `(task, args, key, frees, seconds,
    describe)`, where the task is its number on `lane` once the lane has it (`(number,
    task)` the first time), `seconds` the emulated task's duration (None: compute it),
    `describe` whether the reply should carry the result's outline (not once the lane
    has described a result of the same signature: the driver knows it, and the lane has
    checked its structure), and the large arrays among `args` (a batch), which go beside
    it (`_dumps`).

    cloudpickle's pickler runs in Python: a task call (the `Task` with its recipe, `Ref`s
    in the arguments) cost the driver ~290 µs of CPU to send as Ray sent it (cloudpickle),
    against ~50 µs for the same call as bytes from `pickle` (C) with the task as a
    number. The driver sends every call of every lane, so that was most of its CPU,
    which on a machine with a core per lane it takes from the lanes."""
    number = self._task_number(task)
    known = self._tasks_sent[lane]
    call, buffers = _dumps(
      (
        number if number in known else (number, task),
        args,
        key,
        self._take_freed(lane),
        seconds,
        describe,
      )
    )
    known.add(number)  # once pickled: a call that could not be is never sent
    return call, buffers

  def _task_number(self, task: Task) -> int:
    """`task`'s number in every lane of this pool (equal tasks, one number)."""
    return self._task_numbers.setdefault(task, len(self._task_numbers))

  def _argument(self, leaf, lane: str, here: list):
    if not isinstance(leaf, Handle):
      return self._host_array(leaf)
    if leaf.lane != lane:
      leaf = self._move(leaf, lane)
    here.append(leaf)
    return Ref(leaf.key)

  def _check_move(self, number: int) -> None:
    """Raises `LaneError` if the landed copy `number` failed, naming what made it fail: a
    dead lane at either end, or a task that raised first (`_error`, which waits for the
    call that was to make the value when the export names it); else the receiving lane."""
    lane, source, order, _ = self._moves.pop(number)
    _, kind, value = self._replies.pop(number)
    if kind == 'err':
      raise self._move_error(lane, source, order, value) from value

  def _move_error(self, lane: str, source: Handle, order: int, error) -> LaneError:
    lost = self._lost_sources.get(cluster.lost_source(error))
    if lost is not None:  # the value was in a process of `lost` since replaced
      return self._lost_input(lane, error, f'moving {source!r} to it', None, lost)
    dead = self._dead_end(lane, source.lane) if cluster.is_death(error) else None
    if dead is not None:  # the copy failed because one end's process is gone
      return self._dead_error(dead)
    return self._error(lane, error, f'moving {source!r} to it', key=order)

  def _check_moves_into(self, lane: str, within: float = 1.0) -> None:
    """Raises if a copy to `lane` failed, waiting up to `within` seconds for those still
    on their way, so that a task that failed because a copy it took in had failed is
    reported as that copy's failure: the driver may hear of the task's failure before
    that of the export, though the export failed first."""
    deadline = time.monotonic() + within
    while True:
      self._hear_all()
      for number, (target, source, order, error) in list(self._failed_moves.items()):
        if target == lane:
          del self._failed_moves[number]
          raise self._move_error(target, source, order, error) from error
      if not any(move[0] == lane and not move[3] for move in self._moves.values()):
        return
      if not self._hear(deadline):
        return

  def _dead_end(self, *lanes: str, within: float = 2.0) -> str | None:
    """The first of `lanes` whose process is found dead within `within` seconds (a
    death may be heard of after the failed call it caused), or None."""
    deadline = time.monotonic() + within
    while True:
      self._hear_all()
      self._look_at_watches()
      dead = [lane for lane in lanes if lane in self._dead]
      if dead:
        return dead[0]
      if not self._hear(deadline):
        return None

  # -- the wire: events the lanes' connections bring (wire.py) ---------------------------

  def _link(self, lane: str) -> None:
    """Connects to `lane`'s socket; a reader thread puts what comes in `_events`."""
    addresses = self.info[lane]['address']
    where = wire.address(addresses, cluster.node_address())
    share = addresses.get('shared', False)  # (its batches written once, read in place)
    link = wire.connect(where, self._authkey, ('driver',), background=True, share=share)
    self._links[lane] = link

    def read():
      wire.name_thread(wire.REPLIES_THREAD)
      while True:
        try:
          message = link.receive()
        except Exception:  # pylint: disable=broad-except
          # The lane ended it (EOFError, OSError), or the pool closed it under this read.
          self._events.put((lane, link, 'closed', None, None))
          return
        self._events.put((lane, link, *message))

    reader = threading.Thread(target=read, daemon=True, name=f'jaxsgd-lane-{lane}')
    reader.start()
    self._readers = [*(r for r in self._readers if r.is_alive()), reader]

  def _link_of(self, lane: str) -> wire.Endpoint:
    return self._open(self._links, lane)

  def _hear(self, deadline: float | None) -> bool:
    """Takes in what the lanes sent (waiting for something until `deadline`, in slices
    that look for a stop signal and at Ray's watch of each lane); False if nothing came."""
    while True:
      _StopSignals.check()
      left = _STOP_CHECK if deadline is None else min(_STOP_CHECK, deadline - time.monotonic())
      try:
        event = self._events.get(timeout=max(0.0, left))
      except queue.Empty:
        self._look_at_watches()
        if deadline is not None and time.monotonic() >= deadline:
          return False
        if self._dead:
          return True
        continue
      self._heard(event)
      self._hear_all()
      return True

  def _hear_all(self) -> None:
    """Takes in what the lanes have sent so far, without waiting."""
    while True:
      try:
        event = self._events.get_nowait()
      except queue.Empty:
        return
      self._heard(event)

  def _heard(self, event) -> None:
    lane, link, kind, number, value = event
    if self._links.get(lane) is not link:
      return  # from a lane's process that was removed
    if kind == 'closed':
      self._lane_died(lane)
    elif self._preparing.pop(number, None) is not None:  # (a `prepare`: nothing to read)
      pass
    elif number in self._forgotten:  # of a call or copy of a lane `reset` since
      pending = self._forgotten.pop(number)
      if pending is not None:
        self._free_result(pending, kind, value)
    elif kind == 'arrived':  # a copy to be taken in by a call (`_move`)
      self._moves.pop(number, None)
      if number in self._exported:
        self._exported[number] = value
    elif kind == 'err' and number in self._moves and not self._moves[number][3]:
      target, source, order, _ = self._moves.pop(number)  # such a copy failed
      self._failed_moves[number] = (target, source, order, value)
      self._exported.pop(number, None)
    else:  # a call's reply, or a landed copy's
      self._replies[number] = (next(self._read), kind, value)

  def _lane_died(self, lane: str) -> None:
    """Notes that `lane`'s process ended, and tells the others: a call of theirs waiting
    for a copy from it fails as a death."""
    if lane in self._dead:
      return
    self._dead[lane] = 'died'
    info = self.info.get(lane)
    if info is not None:  # (none while the pool starts: no lane has been linked yet)
      self._tell_dead(tuple(info['address']['remote']))

  def _tell_dead(self, address: tuple) -> None:
    for other in self._links.values():
      try:
        other.send(('dead', None, address))
      except OSError:
        pass

  def _look_at_watches(self) -> None:
    """Ray's watch of each lane (`cluster.watch`): it also sees a host that vanished
    without closing its connections."""
    watched = {ref: lane for lane, ref in self._watch.items() if lane not in self._dead}
    for ref in cluster.finished(list(watched)) if watched else ():
      self._lane_died(watched[ref])

  def _check_lanes(self) -> None:
    """Raises `LaneError` if a lane's process has died or a copy has failed (heard so
    far, without waiting)."""
    self._hear_all()
    for lane in self._dead:
      if lane in self._links:
        self._raise_dead(lane)
    if self._failed_moves:
      number = next(iter(self._failed_moves))
      target, source, order, error = self._failed_moves.pop(number)
      raise self._move_error(target, source, order, error) from error

  def _call(self, lane: str, op: str, args: tuple):
    """Runs `op(*args)` in `lane`'s ordered thread and returns its result."""
    number = next(self._keys)
    link = self._link_of(lane)
    link.send((op, number, args))
    return self._reply_of(lane, number, link)

  def _reply_of(self, lane: str, number: int, link: wire.Endpoint):
    """The reply to call `number`, sent to `lane` on `link`, waiting for it (raises
    `LaneError` if the call failed, or if the lane's process died or was replaced first)."""
    while True:
      self._hear_all()
      reply = self._replies.pop(number, None)
      if reply is not None:
        _, kind, value = reply
        if kind == 'err':
          raise self._error(lane, value, None) from value
        return value
      if lane in self._dead or self._links.get(lane) is not link:
        raise self._dead_error(lane)
      self._hear(None)

  def _handles(self, lane: str, key, outline):
    if isinstance(outline, tuple) and outline and isinstance(outline[0], tuple):
      return tuple(
        self._handles(lane, (key[0], key[1] + (i,)), part) for i, part in enumerate(outline)
      )
    if isinstance(outline, tuple) and not outline:
      return ()
    nbytes, description = outline
    return Handle(self, lane, key, nbytes, description)

  def _drop(self, lane: str, key) -> None:
    self._scalars.pop(key, None)
    never_taken_in = self._imports.pop((lane, key), None) is not None
    with self._lock:
      if lane in self._freed:
        self._freed[lane].append((DISCARD, key) if never_taken_in else key)

  def _take_freed(self, lane: str) -> tuple:
    with self._lock:
      freed, self._freed[lane] = tuple(self._freed[lane]), []
    return freed

  def _start_lanes(self, specs: Sequence[LaneSpec]) -> None:
    """An actor per lane (`_actors`): the processes `cluster.connect_soon` started for
    these very lanes (they serve with its key, which the pool then takes), the others
    started now. Early ones this pool does not take are ended."""
    authkey, early = cluster.take_early_lanes()
    taken = () if self._env else tuple(spec for spec in specs if spec in early)
    if taken:
      self._authkey = authkey
    self.started_early = tuple(spec.name for spec in taken)
    try:
      for spec in specs:
        self._actors[spec.name] = (
          early.pop(spec) if spec in taken else cluster.lane_actor(spec, self._env, self._authkey)
        )
    finally:  # those not taken, and on a failure those not reached yet
      for actor in early.values():
        cluster.kill(actor)

  def _gather_info(self, refs: dict) -> dict[str, dict]:
    """Each lane's `info()`, asked for before its `watch` (`cluster._LANE_ACTOR`)."""
    return {
      name: self._get(name, ref, host=self.placement[name].host or 'driver')
      for name, ref in refs.items()
    }

  def _get(self, lane: str, ref, host: str | None = None):
    watched = self._watch[lane]
    done, _ = _ray_wait([ref, watched], None)
    if done[0] == watched:
      self._raise_dead(lane)
    try:
      return cluster.get(ref)
    except Exception as error:
      raise self._error(lane, error, None, host) from error

  def _host(self, lane: str) -> str:
    info = self.info.get(lane)
    return info['host'] if info else (self.placement[lane].host or 'driver')

  def _raise_dead(self, lane: str):
    raise self._dead_error(lane)

  def _dead_error(self, lane: str) -> LaneError:
    """The `LaneError` of `lane`'s process having ended, with what it last wrote to its
    standard error where no log monitor showed that (`cluster.lane_output`)."""
    said = f'{self._pid_said(lane)}: its process died (killed, or crashed).'
    pid = self._pid(lane)
    output = cluster.lane_output(pid) if pid is not None else None
    if output:
      said += ' Its last output (standard error):\n' + textwrap.indent(output, '  ')
    return LaneError(lane, self._host(lane), said)

  def _pid(self, lane: str) -> int | None:
    """The pid of `lane`'s process, None before the pool has heard it."""
    return self.info.get(lane, {}).get('pid')

  def _pid_said(self, lane: str) -> str:
    """'pid N' of `lane`'s process, or where the pool has not heard it yet, 'at start'."""
    pid = self._pid(lane)
    return 'at start' if pid is None else f'pid {pid}'

  def _error(self, lane, error, task, host=None, key=None) -> LaneError:
    """The `LaneError` to raise for `error` (a failed call on `lane`): the failure of an
    earlier task on another lane if one has failed (started before, on a lane still
    here), which a later call fails of (a value it never made: a copy of it, an update
    using it); else this one's. (A failed task on the same lane is read first by itself:
    a lane runs its calls in order, and the driver reads ends in the order sent.)

    A failure that names the call it comes of (`cluster.failed_maker`: a value that
    call was to make could not be exported) waits for that call's own reply (up to
    `_MAKER_REPLY` s, or until its lane dies): its lane marks it failed before Ray has
    its error, so a lane that took in the value may be heard of first."""
    for _ in range(len(self._unfinished) + 1):  # each round finds an earlier cause, or ends
      root = self._root_cause(lane, error, task, key)
      maker = self._unfinished_maker(root[1])
      if maker is None:
        break
      deadline = time.monotonic() + _MAKER_REPLY
      while maker.key not in self._replies and maker.lane not in self._dead:
        if not self._hear(deadline):
          break
    other_lane, cause, other_task, other_key, other_ref = root
    if other_ref is not None:
      self._unfinished.pop(other_ref, None)  # accounted for by this error: not blamed again
      self._scalar_copies.pop(other_ref, None)
      # (the others stay, each reported when read: taken here, a worker's failed forward
      # was never read, and its backward's failure was blamed on a KeyError)
      return self._describe(other_lane, cause, other_task, None, other_key)
    return self._describe(lane, error, task, host, key)

  def _root_cause(self, lane, error, task, key) -> tuple:
    """`(lane, error, task, key, ref)` of the earliest task on another lane that has
    failed by now, if started before `key`; else this failure's (`ref` None)."""
    self._hear_all()
    for other in sorted(self._unfinished.values(), key=lambda p: p.key):
      if key is not None and other.key >= key:
        break
      reply = self._replies.get(other.key)
      if other.lane != lane and other.lane in self._links and reply and reply[1] == 'err':
        return other.lane, reply[2], other.task, other.key, other.key
    return lane, error, task, key, None

  def _unfinished_maker(self, error) -> Pending | None:
    """The unfinished call whose failure `error` names as its cause (`_error`), or None."""
    made = cluster.failed_maker(error)
    if made is None:
      return None
    for pending in self._unfinished.values():
      if (pending.lane, pending.key) == made and pending.lane in self._links:
        return None if pending.key in self._replies else pending
    return None

  def _describe(self, lane, error, task, host, key=None) -> LaneError:
    if (task is None or isinstance(task, Task)) and cluster.is_death(error):
      return self._death(lane, error, task, host, key)
    what = (
      'call failed' if task is None else (task if isinstance(task, str) else f'{task!r} raised')
    )
    return LaneError(lane, host or self._host(lane), f'{what}: {cluster.describe(error)}')

  def _death(self, lane, error, task, host, key) -> LaneError:
    """The `LaneError` of a call on `lane` (a task, or a fetch or export: `task` None)
    that failed of a death. A death reaches a call on a live lane too: a copy it takes in
    from a lane that died on its way raises the source's death there (a killed ASGD
    worker's push, inside the server's update, or in an export of the server's
    parameters that takes it in first). The lane whose process is gone is the cause."""
    lost = self._lost_sources.get(cluster.lost_source(error))
    if lost is not None:  # known at once: no death to wait for
      return self._lost_input(lane, error, task or 'a fetch or an export', host, lost)
    dead = self._dead_end(lane, within=0.0) or self._dead_end(*self._watch)
    if dead is not None and dead != lane:
      return self._dead_error(dead)
    pid = self._pid_said(lane)
    if task is None:  # a fetch, an export, its start: the lane died
      return LaneError(
        lane, host or self._host(lane), f'{pid}: its process died ({cluster.describe(error)}).'
      )
    replaced = [name for name, first in self._replaced.items() if key is not None and key < first]
    if dead is None and replaced:  # its source's process was lost, and replaced since
      return self._lost_input(lane, error, task, host, replaced[0])
    return LaneError(  # the lane died under the task
      lane,
      host or self._host(lane),
      f'{pid}: its process died ({cluster.describe(error)}) while running {task!r}.',
    )

  def _lost_input(self, lane, error, task, host, lost: str) -> LaneError:
    what = task if isinstance(task, str) else repr(task)  # (a move's: 'moving ... to it')
    return LaneError(
      lane,
      host or self._host(lane),
      f'{what} failed: a value it takes in was in the lost process of lane {lost!r} '
      f'({cluster.describe(error)}).',
      lost_input=lost,
    )


def _signature(task, treedef, leaves) -> Hashable:
  """The task and what its result's outline can depend on: its arguments' structure
  (`treedef`) and shapes (`leaves`, flattened from them).

  Python scalars and strings count by value (they may set shapes); arrays by shape
  and dtype; handles by what they hold.
  """
  return (task, treedef, tuple(map(_leaf_signature, leaves)))


def _leaf_signature(leaf) -> Hashable:
  if isinstance(leaf, Handle):
    return ('handle', leaf.nbytes, leaf.description)
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return ('array', tuple(leaf.shape), leaf.dtype)  # (a dtype hashes; its str took ~4 µs)
  return ('value', type(leaf).__name__, leaf if isinstance(leaf, Hashable) else id(leaf))


def _dumps(value) -> tuple[bytes, list]:
  """`value` pickled by `pickle` (C), or by cloudpickle if it holds something only
  cloudpickle can write (a class defined in `__main__`); `pickle.loads` reads both.
  Arrays of `wire.OUT_OF_BAND` bytes or more are left out of the pickle: returned beside
  it (as uint8 arrays, each a view of its array's memory), to go as frames of their own
  (wire.py), written from where they lie; pickled in, a batch was copied into the
  pickle here, and in the lane out of the call and again out of the pickle.
  """
  buffers = []

  def keep_large(buffer: pickle.PickleBuffer):
    raw = buffer.raw()
    if raw.nbytes < wire.OUT_OF_BAND:
      return True  # in the pickle
    buffers.append(np.frombuffer(raw, np.uint8))
    return False

  try:
    call = pickle.dumps(value, protocol=5, buffer_callback=keep_large)
  except (pickle.PicklingError, AttributeError, TypeError):
    buffers.clear()
    call = cloudpickle.dumps(value, protocol=5, buffer_callback=keep_large)
  return call, buffers


class _HostCopies:
  """A driver-side jax.Array goes to a lane as numpy (its device means nothing there).
  A small one is converted once: a policy sends the same few again and again (a
  parameter server's worker ids and staleness constants, with every update), and each
  `np.asarray` of a jax scalar cost the driver ~56 µs in a two-lane ASGD run under
  cProfile (1-2 µs alone: on a busy host the call waits for the lock and the cores). A
  jax.Array is immutable, so its copy stays right while it lives, and is dropped with
  it: an owned, read-only copy, since `np.asarray` of a CPU array is a view that would
  keep the array alive for ever. A deleted (donated) array's kept copy is not used:
  converting it raises, as it did before the cache."""

  SMALL = 4096  # bytes: kept up to this size (constants); larger ones are converted each time

  def __init__(self):
    self._copies: dict[int, tuple[weakref.ref, np.ndarray]] = {}

  def __call__(self, leaf):
    if not isinstance(leaf, jax.Array):
      return leaf
    key = id(leaf)
    kept = self._copies.get(key)  # looked up first: jax's `nbytes` took ~10 µs
    if kept is not None and kept[0]() is leaf and not leaf.is_deleted():
      return kept[1]
    if leaf.nbytes > self.SMALL or leaf.is_deleted():
      return np.asarray(leaf)
    copies = self._copies
    # (`drop` bound now: at the interpreter's exit the module's globals may be gone first)
    ref = weakref.ref(leaf, lambda dead, key=key, drop=_drop_copy: drop(copies, key, dead))
    copy = np.array(leaf, copy=True)
    copy.flags.writeable = False
    self._copies[key] = (ref, copy)
    return copy


def _drop_copy(copies: dict, key: int, dead) -> None:
  kept = copies.get(key)
  if kept is not None and kept[0] is dead:
    del copies[key]


_MAKER_REPLY = 10.0  # s: a failed call's error is on its way once its lane says it failed
_READERS_END = 2.0  # s: at most, for the readers of a closed pool's links to end


def _ray_wait(refs: list, timeout: float | None):
  """`cluster.wait` in slices of `_STOP_CHECK` s, raising `KeyboardInterrupt` between them
  while a stop signal is on record (module docstring: a handler's exception can be lost)."""
  deadline = None if timeout is None else time.monotonic() + timeout
  while True:
    _StopSignals.check()
    left = _STOP_CHECK if deadline is None else min(_STOP_CHECK, deadline - time.monotonic())
    done, rest = cluster.wait(refs, max(0.0, left))
    if done or (deadline is not None and time.monotonic() >= deadline):
      return done, rest


class _StopSignals:
  """While a pool is open: SIGTERM and Ctrl-C raise `KeyboardInterrupt` and are remembered
  (SIGTERM apart, for the exit status), so that `close()` runs and no Ray wait turns them
  into another exit status; `check` raises again if that exception was lost (module
  docstring)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)
  open_pools = 0
  before: dict = {}  # signal -> the handler installed before the first pool opened
  sigterm = False  # SIGTERM arrived while a pool was open
  stopped = False  # SIGTERM or Ctrl-C arrived while a pool was open
  closing = False
  on_sigterm = None  # `saving_on_sigterm`

  @classmethod
  def current(cls) -> dict:
    return {signum: signal.getsignal(signum) for signum in cls.SIGNALS}

  @classmethod
  def install(cls, before: dict) -> bool:
    """Our handlers from now on; `before`: those to restore when the last pool closes
    (the run's, not the `sys.exit(15)` that `ray.init` installs)."""
    if threading.current_thread() is not threading.main_thread():
      return False
    cls.open_pools += 1
    if cls.open_pools == 1:
      cls.sigterm = cls.stopped = False
      cls.before = before
    for signum in cls.SIGNALS:
      signal.signal(signum, cls._stop)
    return True

  @classmethod
  def restore(cls, installed: bool) -> None:
    if not installed:
      return
    cls.open_pools -= 1
    if cls.open_pools == 0 and threading.current_thread() is threading.main_thread():
      for signum, handler in cls.before.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)

  @classmethod
  def _stop(cls, signum, frame):
    del frame
    if signum == signal.SIGTERM and cls.on_sigterm is not None:
      cls.on_sigterm()  # the run saves a checkpoint at its next drained point, then stops
      return
    cls.stopped = True
    cls.sigterm = cls.sigterm or signum == signal.SIGTERM
    if not cls.closing:
      raise KeyboardInterrupt(f'signal {signum}')

  @classmethod
  @contextlib.contextmanager
  def saving_on_sigterm(cls, request_save):
    """Within: SIGTERM calls `request_save()` instead of stopping the run at once (a run
    that checkpoints saves at its next drained point and stops there). Ctrl-C still
    stops it at once."""
    cls.on_sigterm = request_save
    try:
      yield
    finally:
      cls.on_sigterm = None

  @classmethod
  def check(cls) -> None:
    """Raises `KeyboardInterrupt` if a stop signal arrived and the pools are not closing:
    its first exception was lost, or the run would not be here."""
    if cls.stopped and not cls.closing and cls.open_pools:
      raise KeyboardInterrupt('a stop signal arrived (its first interrupt was lost)')

  @classmethod
  @contextlib.contextmanager
  def deferred(cls):
    """Ctrl-C and SIGTERM only remembered (main thread), so that a clean-up runs to its end."""
    if threading.current_thread() is not threading.main_thread() or cls.closing:
      yield
      return
    cls.closing = True
    try:
      yield
    finally:
      cls.closing = False


def saving_on_sigterm(request_save):
  """Within: SIGTERM asks the run to save and stop (`_StopSignals.saving_on_sigterm`)."""
  return _StopSignals.saving_on_sigterm(request_save)


def sigterm_received() -> bool:
  """Whether SIGTERM arrived while a pool was open (since the first of them opened)."""
  return _StopSignals.sigterm
