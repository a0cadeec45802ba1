"""The `data` mesh, its shardings, and how host batches become global arrays.

Worker `m` is the device at position `m` of `jax.devices()` (positions, not
`.id`: global ids in a multi-process cluster are `process * 2048 + local`). In a
multi-process run `jax.devices()` lists process 0's devices first, so each
process holds a contiguous block of workers.

Layouts (leading axis sizes in the names):

    replicated  P()        every worker holds the same copy (SSGD's params)
    per_worker  P('data')  leading axis M, row m on worker m (local methods'
                           params and optimizer states; batches [M*B, ...])
"""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = 'data'


def data_mesh(workers: int, devices=None) -> Mesh:
  """A 1-D mesh with axis `data` over the first `workers` devices."""
  devices = jax.devices() if devices is None else list(devices)
  if workers > len(devices):
    raise ValueError(
      f'workers: {workers} workers need {workers} devices, but '
      f'{len(devices)} are visible; lower workers or set '
      f'algorithm.stacked=True to run them on one device.'
    )
  # Explicit Mesh (not jax.make_mesh, whose axes default to Explicit sharding
  # mode): inputs are placed with NamedShardings below.
  return Mesh(np.asarray(devices[:workers]), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def per_worker(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(AXIS))


def local_workers(mesh: Mesh) -> list[int]:
  """Indices of the workers whose device belongs to this process, in mesh order."""
  me = jax.process_index()
  return [m for m, d in enumerate(mesh.devices.flat) if d.process_index == me]


def global_batch(mesh: Mesh, local_batches: list[dict[str, np.ndarray]], axis: int = 0) -> dict:
  """The `[M*B, ...]` global batch, sharded by worker, from this process's batches.

  Args:
    mesh: the data mesh.
    local_batches: one numpy batch per local worker (`local_workers(mesh)` order).
    axis: the examples' axis: 0, or 1 for `[τ, B, ...]` batches of τ steps
      (global `[τ, M*B, ...]`, sharded `P(None, 'data')`).
  """
  sharding = NamedSharding(mesh, P(*([None] * axis), AXIS))
  workers = mesh.devices.size

  def one(*parts):
    local = np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
    shape = list(parts[0].shape)
    shape[axis] *= workers
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))

  return jax.tree.map(one, *local_batches)


def first_local_shard(x: jax.Array) -> jax.Array:
  """This process's first shard of `x` as a one-device array (no copy, no sync)."""
  return x.addressable_shards[0].data
