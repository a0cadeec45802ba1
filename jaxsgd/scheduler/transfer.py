"""The one module that moves arrays: host→device, device→device, device→host.

Everything else in the scheduler calls these functions, so a test can run a whole
pipeline under `jax.transfer_guard('disallow')` and catch any implicit copy, and a
profile of transfers has one place to look. `jax.device_put` is asynchronous: it
returns at once and the copy overlaps whatever the devices are doing.

A value already on the destination (every leaf a committed `jax.Array` on that
device) is not copied: `to_device` returns it as it is, since JAX arrays are
immutable and a copy would cost a `device_put` (tens of µs of host time per leaf
batch) for nothing. A task that donates its inputs must therefore not be handed a
value another lane still holds.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import numpy as np


def to_device(tree, device: jax.Device | None):
  """`tree` (host numpy or arrays on any device) placed on `device` (async).

  `device=None` (a lane with no device of its own, e.g. a simulated control lane)
  leaves `tree` where it is, and so does a `tree` whose arrays are all on `device`.
  """
  if device is None or on_device(tree, device):
    return tree
  if _all_host(tree):
    return _host_placer(device)(tree)
  return jax.device_put(tree, device)


def for_task(tree, device: jax.Device | None):
  """`tree` for a task called through `HostInputs` on `device`: a tree of host numpy
  arrays as it is (the task's own call copies it in), anything else `to_device`."""
  return tree if _all_host(tree) else to_device(tree, device)


def _all_host(tree) -> bool:
  """Whether every leaf of `tree` is a host numpy array (an empty tree: vacuously)."""
  return all(type(leaf) is np.ndarray for leaf in jax.tree_util.tree_leaves(tree))  # pylint: disable=unidiomatic-typecheck


@dataclasses.dataclass(frozen=True)
class HostInputs:
  """`fn` (a jitted task), allowed to take host numpy arrays among its arguments and copy
  them to its device as part of its call: an explicit placement, like `to_device`'s,
  which a `jax.transfer_guard('disallow')` around the run lets through.

  A batch handed to the task that reads it this way costs one dispatch where placing it
  first (`to_device`) and then calling the task cost two, the second of them on arrays
  not yet ready, so the host spends less time per task (`benchmarks/simulator_host_cost.py`;
  the measured saving is in benchmarks/results/simulator_host_cost.md). jit
  puts the host arrays on the device of the call's other arguments and canonicalizes
  their dtypes as `to_device` does, so the task computes on the same values and returns
  the same bits. Every host array among the arguments is let through, so wrap only a
  task whose other arguments are committed device arrays (their device is where the
  host ones go, and a stray host array among them is not a batch). The process executor
  sends the task itself (`fn`) to the lane, which reads host arrays as its arguments.
  """

  fn: Callable

  def __call__(self, *args):
    with jax.transfer_guard_host_to_device('allow'):
      return self.fn(*args)


@functools.lru_cache(maxsize=None)
def _host_placer(device: jax.Device):
  """Places a tree of host arrays on `device` through a jitted identity.

  The same arrays as `jax.device_put(tree, device)` (dtypes canonicalized alike,
  committed to `device`), for less host time: jit's C++ argument path instead of
  `device_put`'s Python one. Measured here while the device runs other tasks (a
  64-example batch, 2 arrays): `device_put` ~100–200 µs of host CPU, this ~10–40 µs.
  Compiled once per tree structure and shapes. It is an explicit placement, so a
  `jax.transfer_guard('disallow')` around the run lets it through.
  """
  sharding = _sharding(device)
  identity = jax.jit(lambda tree: tree, in_shardings=sharding, out_shardings=sharding)

  def place(tree):
    with jax.transfer_guard_host_to_device('allow'):
      return identity(tree)

  return place


def on_device(tree, device: jax.Device) -> bool:
  """Whether every leaf of `tree` is a `jax.Array` committed to `device` alone."""
  return leaves_on_device(jax.tree_util.tree_leaves(tree), device)


def leaves_on_device(leaves, device: jax.Device) -> bool:
  """`on_device` of a tree flattened already (`jax.tree_util.tree_leaves`)."""
  known, array_types = _known_shardings(device), _ARRAY_TYPES
  for leaf in leaves:
    if not ((type(leaf) in array_types or _is_array(leaf)) and leaf.committed):
      return False
    sharding = leaf.sharding
    if known.get(id(sharding)) is not sharding and not _places_on(sharding, device, known):
      return False
  return True


# The concrete classes seen to be `jax.Array`s: a set lookup by type is several times
# cheaper than `isinstance(leaf, jax.Array)` (an ABC check), and `on_device` and
# `nbytes` ask it for every leaf of every message.
_ARRAY_TYPES: set[type] = set()


def _is_array(leaf) -> bool:
  if isinstance(leaf, jax.Array):
    _ARRAY_TYPES.add(type(leaf))
    return True
  return False


_KNOWN_SHARDINGS: dict[jax.Device, dict[int, jax.sharding.Sharding]] = {}


def _known_shardings(device: jax.Device) -> dict[int, jax.sharding.Sharding]:
  """The shardings seen to place arrays on `device` alone, by id (see `_places_on`)."""
  known = _KNOWN_SHARDINGS.get(device)
  if known is None:
    known = _KNOWN_SHARDINGS.setdefault(device, {})
  return known


def _places_on(sharding: jax.sharding.Sharding, device: jax.Device, known: dict) -> bool:
  """`sharding == SingleDeviceSharding(device)`, remembered by identity in `known`.

  The outputs of a jitted function share its output sharding objects from call to
  call, so a message's shardings are nearly always ones seen before: an identity
  lookup (done inline by `on_device`) replaces a comparison that reads several
  attributes. (The cache holds each sharding it remembers, so no other object can
  take its id.)
  """
  if sharding != _sharding(device):
    return False
  if len(known) < 4096:
    known[id(sharding)] = sharding
  return True


@functools.lru_cache(maxsize=None)
def _sharding(device: jax.Device) -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(device)


def to_host(tree):
  """`tree` as numpy arrays on the host. Blocks: call only at logging points."""
  return jax.device_get(tree)


def constant(value, device: jax.Device, dtype=np.float32):
  """A scalar constant committed to `device` (e.g. the loss cotangent 1.0, a push's
  staleness): the array `jax.device_put` makes, placed by `_host_placer`, which costs
  less host time than `device_put` (figures in benchmarks/results/simulator_host_cost.md;
  a parameter server makes one per staleness it meets). Like `to_device`'s host path, it
  is not seen by the `*_explicit` transfer guards, which only `jax.device_put` reports."""
  return _host_placer(device)(np.asarray(value, dtype))


def nbytes(tree) -> int:
  """Bytes a transfer of `tree` moves (from shapes and dtypes: never syncs)."""
  return leaves_nbytes(jax.tree_util.tree_leaves(tree))


def leaves_nbytes(leaves) -> int:
  """`nbytes` of a tree flattened already (`jax.tree_util.tree_leaves`)."""
  total, array_types, known = 0, _ARRAY_TYPES, _AVAL_BYTES
  for leaf in leaves:
    if type(leaf) in array_types or _is_array(leaf):
      aval = leaf.aval  # `leaf.nbytes` costs ~1 µs; the aval does not.
      size = known.get(id(aval))
      total += size[1] if size is not None and size[0] is aval else _aval_bytes(aval)
    else:
      total += getattr(leaf, 'nbytes', 0)
  return int(total)


_AVAL_BYTES: dict[int, tuple] = {}


def _aval_bytes(aval) -> int:
  """Bytes of an array of `aval`, remembered by identity (looked up inline by `nbytes`):
  the outputs of a jitted function share its output avals from call to call (as
  `_places_on` does for shardings), so a message's avals are nearly always ones seen
  before."""
  size = math.prod(aval.shape) * aval.dtype.itemsize
  if len(_AVAL_BYTES) < 4096:
    _AVAL_BYTES[id(aval)] = (aval, size)
  return size


def wait(tree) -> None:
  """Blocks until every array in `tree` is computed (timing threads, timing calls)."""
  jax.block_until_ready(tree)  # One flatten, one batched wait; host leaves are skipped.
