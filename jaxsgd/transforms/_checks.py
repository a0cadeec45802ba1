"""Argument checks shared by the transforms: fail early, name the argument."""

from typing import Any

import jax


def concrete(value: Any) -> float | None:
  """Python float of a hyperparameter, or None when it is traced.

  Hyperparameters are traced inside `optax.inject_hyperparams`' jitted update;
  they were already checked (concrete) when the state was initialised.
  """
  if value is None or isinstance(value, jax.core.Tracer):
    return None
  return float(value)


def check_range(name: str, value: Any, allowed: str, ok) -> None:
  """Raises ValueError naming `name` unless `ok(float(value))` (skips tracers)."""
  v = concrete(value)
  if v is not None and not ok(v):
    raise ValueError(f'{name} must be {allowed}; got {value!r}.')


def static_int(name: str, value: Any, minimum: int, hint: str = '') -> int:
  """Returns `value` as a Python int >= minimum, or raises naming `name`."""
  if isinstance(value, jax.core.Tracer) or isinstance(value, bool):
    raise TypeError(
      f'{name} must be a Python int (it fixes the schedule/shapes, so it is '
      f'static){hint}; got {value!r}.'
    )
  try:
    as_int = int(value)
  except (TypeError, ValueError):
    raise TypeError(f'{name} must be an int; got {value!r}.') from None
  if as_int != value:
    raise TypeError(f'{name} must be an int; got {value!r}.')
  if as_int < minimum:
    raise ValueError(f'{name} must be an int >= {minimum}; got {value!r}.')
  return as_int


def require(name: str, value: Any, where: str, what: str) -> None:
  """Raises TypeError when the keyword argument `name` was not passed."""
  if value is None:
    raise TypeError(f'{where}.update requires the keyword argument `{name}` ({what}).')


def same_structure(name: str, tree: Any, ref: Any, ref_name: str) -> None:
  """Raises ValueError unless `tree` has the pytree structure of `ref`."""
  tree_def, ref_def = jax.tree.structure(tree), jax.tree.structure(ref)
  if tree_def != ref_def:
    raise ValueError(
      f'{name} must have the same tree structure as {ref_name}; got {tree_def} vs {ref_def}.'
    )


def worker_id_in_range(worker_id: Any, num_workers: Any) -> None:
  """Raises ValueError for a concrete worker_id outside [0, num_workers)."""
  wid, n = concrete(worker_id), concrete(num_workers)
  if wid is not None and n is not None and not 0 <= wid < n:
    raise ValueError(f'worker_id must be in [0, num_workers={int(n)}); got {worker_id!r}.')
