"""Versioned parameter stores: every write makes a new version; reads see one.

A stage's (or a parameter server's) parameters and optimizer state live in a
`VersionedStore`. `read()` returns a `Snapshot(version, value)`; `write(value,
read_version=v)` applies an update computed from the snapshot of version `v` and
records its *staleness*, the number of writes that happened between that read and
this write:

    snapshot = store.read()                 # at a task's start
    ...                                     # compute a gradient at snapshot.value
    store.write(new_value, read_version=snapshot.version)   # at a task's end
    # store.updates[-1].staleness == writes by others in between

Writes that are not gradient updates (running BatchNorm statistics) pass no
`read_version` and record nothing. A lock makes reads and writes atomic, so
worker threads of the real clock can share a store.
"""

import dataclasses
import threading
from typing import Any, NamedTuple

import numpy as np


_NONE = -(2**62)  # None in a saved update record


class Snapshot(NamedTuple):
  version: int
  value: Any


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
  """One applied gradient: the version it was computed at and its staleness."""

  read_version: int  # the version the gradient was computed from
  version: int  # the version this write created
  staleness: int  # writes between the read and this write
  lane: int | None = None
  batch: int | None = None


class VersionedStore:
  """A value with a version counter and a history of applied updates."""

  def __init__(self, name: str, value: Any):
    self.name = name
    self._value = value
    self._version = 0
    self._lock = threading.Lock()
    self.updates: list[UpdateRecord] = []

  @property
  def version(self) -> int:
    return self._version

  def read(self) -> Snapshot:
    with self._lock:
      return Snapshot(self._version, self._value)

  def write(
    self,
    value: Any,
    *,
    read_version: int | None = None,
    lane: int | None = None,
    batch: int | None = None,
  ) -> UpdateRecord | None:
    """Stores `value` as a new version; records the update if `read_version` is given."""
    with self._lock:
      if read_version is not None and not 0 <= read_version <= self._version:
        raise ValueError(
          f'{self.name}: read_version {read_version} is not a version '
          f'this store has had (0..{self._version}).'
        )
      staleness = None if read_version is None else self._version - read_version
      self._value = value
      self._version += 1
      if staleness is None:
        return None
      record = UpdateRecord(read_version, self._version, staleness, lane, batch)
      self.updates.append(record)
      return record

  def snapshot(self) -> dict:
    """The value, version and update records (for a checkpoint; `load` puts them back)."""
    with self._lock:
      updates = [[_NONE if f is None else f for f in dataclasses.astuple(u)] for u in self.updates]
      return {
        'value': self._value,
        'version': self._version,
        'updates': np.asarray(updates, np.int64).reshape(-1, 5),
      }

  def load(self, saved: dict) -> None:
    with self._lock:
      self._value, self._version = saved['value'], saved['version']
      self.updates = [
        UpdateRecord(*(None if f == _NONE else int(f) for f in row)) for row in saved['updates']
      ]

  def staleness(self) -> np.ndarray:
    """Staleness of every update applied so far, in order."""
    return np.asarray([u.staleness for u in self.updates], np.int64)
