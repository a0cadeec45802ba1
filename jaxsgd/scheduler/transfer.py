"""The one module that moves arrays: host→device, device→device, device→host.

Everything else in the scheduler calls these functions, so a test can run a whole
pipeline under `jax.transfer_guard('disallow')` and catch any implicit copy, and a
profile of transfers has one place to look. `jax.device_put` is asynchronous: it
returns at once and the copy overlaps whatever the devices are doing.
"""

import jax
import numpy as np


def to_device(tree, device: jax.Device | None):
  """`tree` (host numpy or arrays on any device) placed on `device` (async).

  `device=None` (a lane with no device of its own, e.g. a simulated control lane)
  leaves `tree` where it is.
  """
  return tree if device is None else jax.device_put(tree, device)


def to_host(tree):
  """`tree` as numpy arrays on the host. Blocks: call only at logging points."""
  return jax.device_get(tree)


def constant(value, device: jax.Device, dtype=np.float32):
  """A scalar constant committed to `device` (e.g. the loss cotangent 1.0)."""
  return jax.device_put(np.asarray(value, dtype), device)


def nbytes(tree) -> int:
  """Bytes a transfer of `tree` moves (from shapes and dtypes: never syncs)."""
  return int(sum(getattr(leaf, 'nbytes', 0) for leaf in jax.tree_util.tree_leaves(tree)))


def wait(tree) -> None:
  """Blocks until every array in `tree` is computed (timing threads, calibration)."""
  jax.block_until_ready(
    [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, jax.Array)]
  )
