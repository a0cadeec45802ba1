"""A simulation saved between two events, and started again from there, bit for bit.

A run on the virtual clock is the state of its executor (simulated time, the event
queue, the tasks queued and running on each lane, channel items and waiters, the
cost sampler's random streams, the timeline so far), of its policy (stores, counters,
logs) and of its processes. Generators cannot be saved, so every process is
*resumable* (`core.LoopState`): its loop variables and the yield it is suspended at
are data, and its program, started from them, yields that op again.

    state = snapshot.encode(data, executor, processes)   # between events: arrays + bytes
    ...                                           # a new run, the same session built
    data = snapshot.decode(state, executor, cluster, processes)
    session.load(data['session']); executor.run(cluster, processes, resume=data['executor'])

`encode` pickles `data` with every array kept apart (`state['arrays']`, saved by orbax
as they are: the bits of a float32 stay the bits), and with references in place of
what a resumed run builds again: processes and channels by their index, the executor,
devices by id. A `jax.vjp` result (the residuals of a forward kept for a later
backward) is saved as its residual arrays and the task that made it; `decode` rebuilds
its tree structure by `jax.eval_shape` of that task at the same argument shapes (the
same trace, so the same residual order) and puts the saved residuals in. The executor
records which task made each vjp structure (`note_vjps`) while checkpoints are on.

On lane processes (`process.ProcessExecutor`) values live in the lanes and the run
holds `Handle`s: each is saved as its value, exported by its lane (its arrays, and its
structure, or the task that made it where that does not pickle: a vjp), with the lane's
name (`state['handles']`); `decode` puts each back on its lane (`LanePool.restore`).

The structure is a pickle (`state['structure']`, bytes as a uint8 array): a checkpoint
is as trusted as the code that reads it.
"""

import io
import pickle
from typing import Any

import jax
import numpy as np

from jaxsgd.scheduler.core import Cluster, Process

# What `jax.vjp` returns: a `Partial` in older JAX, a `VJP` pytree (not public) in 0.10.
_VJP_TYPES = tuple(
  t
  for t in (jax.tree_util.Partial, getattr(jax._src.api, 'VJP', None))  # pylint: disable=protected-access
  if t is not None
)


class NotResumableError(ValueError):
  """A run's state holds something a checkpoint cannot save."""


# --- where each vjp came from --------------------------------------------------------------
_SOURCES: dict = {}  # a vjp's tree structure -> (task, argument shapes, index in its result)


def note_vjps(fn, args, result) -> None:
  """Records `fn(*args)` as the source of every vjp in `result` (itself, or an element
  of a tuple result), so that a checkpoint can save it (see the module docstring).

  Keyed by the vjp's tree structure (its jaxpr): every vjp of that structure — a copy
  to another device included — is rebuilt the same way. One entry per forward task and
  argument shapes."""
  items = result if isinstance(result, tuple) else (result,)
  for index, item in enumerate(items):
    if isinstance(item, _VJP_TYPES):
      structure = jax.tree.structure(item)
      if structure not in _SOURCES:
        _SOURCES[structure] = (fn, jax.tree.map(_shape_of, args), index)


def _shape_of(leaf):
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.aval.weak_type)
  if isinstance(leaf, np.ndarray):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  return leaf


def _source(vjp) -> tuple:
  source = _SOURCES.get(jax.tree.structure(vjp))
  if source is None:
    raise NotResumableError(
      'checkpoint: a vjp in the run state was not made by a task of the executor, so it '
      'cannot be rebuilt; make it a Compute of a named task (scheduler.tasks.Task).'
    )
  return source


# --- saving ----------------------------------------------------------------------------------
class _Saver(pickle.Pickler):
  def __init__(self, file, executor, processes: list[Process]):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self.arrays: list = []
    self._array_index: dict[int, int] = {}
    self._keep: list = []  # keeps ids valid while pickling
    self._executor = executor
    self._channels = {id(c): i for i, c in enumerate(executor.cluster.channels)}
    self._processes = {id(p): i for i, p in enumerate(processes)}
    self._initial = {id(p) for p in executor.policy_processes}
    self._process_list = processes
    self._handle_type = getattr(executor, 'handle_type', None)  # lane processes' values
    self.handles: list = []
    self._handle_index: dict[int, int] = {}

  def _array(self, array) -> int:
    key = id(array)
    if key not in self._array_index:
      self._array_index[key] = len(self.arrays)
      self.arrays.append(array)
      self._keep.append(array)
    return self._array_index[key]

  def persistent_id(self, obj):  # pylint: disable=too-many-return-statements
    if self._handle_type is not None and isinstance(obj, self._handle_type):
      if id(obj) not in self._handle_index:
        self._handle_index[id(obj)] = len(self.handles)
        self.handles.append(obj)
        self._keep.append(obj)
      return ('handle', self._handle_index[id(obj)])
    if isinstance(obj, jax.Array):
      if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        raise NotResumableError('checkpoint: typed PRNG keys in the run state are not saved.')
      devices = obj.sharding.device_set
      if len(devices) != 1:
        raise NotResumableError(f'checkpoint: an array on {len(devices)} devices in the run state.')
      (device,) = devices
      weak = bool(obj.aval.weak_type)
      if obj.size == 0:
        return ('jax0', obj.shape, obj.dtype.name, device.id, weak)
      return ('jax', self._array(obj), device.id, weak)
    if type(obj) is np.ndarray:  # pylint: disable=unidiomatic-typecheck
      if obj.size == 0 or obj.dtype == object:
        return None  # Pickled in the structure.
      return ('np', self._array(obj))
    if isinstance(obj, _VJP_TYPES):
      fn, shapes, index = _source(obj)
      leaves = jax.tree.leaves(obj)
      return ('vjp', fn, shapes, index, [self.persistent_id(leaf) for leaf in leaves])
    if isinstance(obj, jax.Device):
      return ('device', obj.id)
    if obj is self._executor:
      return ('executor',)
    if isinstance(obj, Process):
      if id(obj) not in self._processes:
        raise NotResumableError(f'checkpoint: {obj.name} is referenced but not saved.')
      initial = id(obj) in self._initial
      return ('process', self._processes[id(obj)], obj.name, obj.lane, initial)
    key = id(obj)
    if key in self._channels and self._executor.cluster.channels[self._channels[key]] is obj:
      return ('channel', self._channels[key])
    if isinstance(obj, Cluster):
      return ('cluster',)
    return None


def encode(data: Any, executor, processes: list[Process]) -> dict:
  """`data` as `{'structure': uint8 array, 'arrays': {'0': array, ...}}` (orbax-savable).

  `processes`: every process `data` refers to (the executor's, then spawned ones).
  """
  buffer = io.BytesIO()
  saver = _Saver(buffer, executor, processes)
  try:
    saver.dump(data)
  except (pickle.PicklingError, TypeError, AttributeError) as e:
    raise NotResumableError(
      f'checkpoint: the run state cannot be saved (are its tasks named, scheduler.tasks.Task?): {e}'
    ) from e
  structure = np.frombuffer(buffer.getvalue(), np.uint8).copy()
  state = {'structure': structure}
  if saver.handles:  # their values, exported by their lanes (all at once)
    saved = []
    for handle, (kind, leaves) in zip(saver.handles, executor.save_handles(saver.handles)):
      saved.append((handle.lane, kind, [saver._array(np.asarray(leaf)) for leaf in leaves]))  # pylint: disable=protected-access
    state['handles'] = np.frombuffer(pickle.dumps(saved), np.uint8).copy()
  state['arrays'] = {str(i): a for i, a in enumerate(saver.arrays)}
  return state


# --- restoring -------------------------------------------------------------------------------
class _Loader(pickle.Unpickler):
  def __init__(self, file, arrays: dict, executor, cluster, processes, transfer_start, handles=()):
    super().__init__(file)
    self._arrays = arrays
    self._handles = handles  # (lane, structure, array indices) of each saved handle
    self._executor = executor
    self._cluster = cluster
    self._initial = list(processes)
    self._spawned: dict[int, Process] = {}
    self._transfer_start = transfer_start
    self._devices = {d.id: d for d in jax.devices()}
    self._structures: dict = {}
    self._loaded: dict[int, Any] = {}

  def persistent_load(self, pid):  # pylint: disable=too-many-return-statements
    kind = pid[0]
    if kind == 'jax':  # Shared as saved: an array in several places is one array again.
      _, index, device, weak = pid
      if index not in self._loaded:
        self._loaded[index] = _placed(self._arrays[str(index)], self._devices[device], weak)
      return self._loaded[index]
    if kind == 'jax0':
      _, shape, dtype, device, weak = pid
      return _placed(np.zeros(shape, dtype), self._devices[device], weak)
    if kind == 'np':
      if pid[1] not in self._loaded:
        self._loaded[pid[1]] = np.asarray(self._arrays[str(pid[1])])
      return self._loaded[pid[1]]
    if kind == 'handle':  # put back on its lane, once however often it is referenced
      key = ('handle', pid[1])
      if key not in self._loaded:
        lane, structure, indices = self._handles[pid[1]]
        leaves = [np.asarray(self._arrays[str(i)]) for i in indices]
        self._loaded[key] = self._executor.restore_handle(self._cluster, lane, (structure, leaves))
      return self._loaded[key]
    if kind == 'vjp':
      _, fn, shapes, index, leaves = pid
      return jax.tree.unflatten(
        self._vjp_structure(fn, shapes, index), [self.persistent_load(p) for p in leaves]
      )
    if kind == 'device':
      return self._devices[pid[1]]
    if kind == 'executor':
      return self._executor
    if kind == 'cluster':
      return self._cluster
    if kind == 'channel':
      return self._cluster.channels[pid[1]]
    if kind == 'process':
      _, index, name, lane, initial = pid
      if initial:
        process = self._initial[index]
        if process.name != name:
          raise ValueError(
            f'checkpoint: process {index} is {name!r}, this run has {process.name!r}.'
          )
        return process
      if index not in self._spawned:
        self._spawned[index] = Process(name, lane, _nothing(), start=self._transfer_start)
      return self._spawned[index]
    raise pickle.UnpicklingError(f'unknown reference {pid!r}')

  def _vjp_structure(self, fn, shapes, index):
    """The tree structure of the vjp `fn` returns at argument shapes `shapes`."""
    key = (fn, jax.tree.structure(shapes), tuple(map(_key, jax.tree.leaves(shapes))), index)
    if key not in self._structures:
      out = jax.eval_shape(fn, *shapes)
      self._structures[key] = jax.tree.structure(out[index] if isinstance(out, tuple) else out)
    return self._structures[key]


def _key(leaf):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return (leaf.shape, leaf.dtype.name, leaf.weak_type)
  return leaf


def _placed(array, device, weak: bool):
  placed = jax.device_put(array, device)
  if weak:  # A Python scalar's weak type (jit's argument types depend on it).
    placed = jax._src.lax.lax._convert_element_type(placed, weak_type=True)  # pylint: disable=protected-access
  return placed


def decode(state: dict, executor, cluster: Cluster, processes: list[Process]) -> Any:
  """The `data` that `encode` saved, its references bound to this run's `executor`,
  `cluster`'s channels and `processes` (the same as the saved run's, freshly built)."""
  from jaxsgd.scheduler.executor import _transfer  # pylint: disable=g-import-not-at-top

  structure = np.asarray(state['structure'], np.uint8).tobytes()
  handles = (
    pickle.loads(np.asarray(state['handles'], np.uint8).tobytes()) if 'handles' in state else ()
  )
  loader = _Loader(
    io.BytesIO(structure), state['arrays'], executor, cluster, processes, _transfer, handles
  )
  return loader.load()


def _nothing():
  yield from ()
