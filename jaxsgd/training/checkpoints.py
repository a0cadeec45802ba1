"""Checkpoints of a run with orbax-checkpoint, for an exact resume.

A checkpoint of step t, in `WORKDIR/checkpoints/<t>/` (an orbax `CheckpointManager`
keeping the last `KEEP`), holds two items:

    state   the algorithm's arrays (parameters, optimizer state, ...), any pytree, saved
            with `args.StandardSave` and restored into the shardings of a template
    meta    JSON (`args.JsonSave`): the step, the data streams' positions
            (`BatchIterator.position`), the metrics written so far, the losses of the
            steps since the last evaluation (their mean is the next record's
            `train_loss`), the wall time so far and the run's config

Resuming from step t therefore continues as if nothing had happened: the same batches
in the same order, the same optimizer state, the same next metrics record. Saves are
synchronous (the step waits for the write), so what a checkpoint holds is the state of
its step. orbax writes each step into a temporary folder and renames it when complete:
a run killed mid-save leaves no partial checkpoint that a resume could read (the
temporary folder is removed when the next manager opens the directory).

Pre-emption: `PreemptionWatch` turns SIGTERM into a flag; the run saves a checkpoint at
the next step and stops with `errors.Preempted` (the binary exits with 143, 128 +
SIGTERM, as a process killed by SIGTERM would). Ctrl-C (SIGINT) is left alone: it
stops the run at once, without a checkpoint of the step it was in.
"""

import logging
import os
import signal
import threading
from typing import Any

import jax

KEEP = 3  # Checkpoints kept (the last ones).
DIRECTORY = 'checkpoints'


class _QuietOrbax(logging.Filter):
  """Drops orbax's INFO lines (about 15 per save) from the absl log; keeps its warnings."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or f'{os.sep}orbax{os.sep}' not in record.pathname


_QUIET = _QuietOrbax()


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  # Slow import.

  for handler_owner in (logging.getLogger('absl'), logging.getLogger()):
    if _QUIET not in handler_owner.filters:
      handler_owner.addFilter(_QUIET)
  return ocp


def directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), DIRECTORY)


def _manager(workdir: str, *, read_only: bool = False):
  ocp = _ocp()
  options = ocp.CheckpointManagerOptions(
    max_to_keep=None if read_only else KEEP,
    enable_async_checkpointing=False,
    create=not read_only,
    read_only=read_only,
  )
  return ocp.CheckpointManager(directory(workdir), options=options)


def latest_meta(workdir: str) -> dict | None:
  """The `meta` of the latest complete checkpoint in `workdir`; None if there is none."""
  if not os.path.isdir(directory(workdir)):
    return None
  ocp = _ocp()
  manager = _manager(workdir, read_only=True)
  try:
    step = manager.latest_step()
    if step is None:
      return None
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  finally:
    manager.close()


class Checkpointer:
  """Saves and restores one run's checkpoints (every `every` steps and at `last`)."""

  def __init__(self, workdir: str, *, every: int, last: int):
    self.every = every
    self.last = last
    self._workdir = workdir
    self._manager = None

  @property
  def enabled(self) -> bool:
    return self.every > 0

  def due(self, step: int) -> bool:
    return self.enabled and (step % self.every == 0 or step == self.last)

  def manager(self):
    if self._manager is None:
      self._manager = _manager(self._workdir)
    return self._manager

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Writes step `step`'s checkpoint (every process calls it: arrays may be sharded)."""
    ocp = _ocp()
    self.manager().save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
      force=True,
    )
    self.manager().wait_until_finished()

  def restore(self, step: int, template: Any) -> Any:
    """Step `step`'s state, in the structure, dtypes and shardings of `template` (None:
    as saved; numpy arrays stay numpy arrays)."""
    ocp = _ocp()
    restored = self.manager().restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))
    )['state']
    if template is None:
      return restored
    # orbax gives namedtuples back as tuples: rebuild the template's structure.
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(restored))

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
      self._manager = None


class PreemptionWatch:
  """Sets `requested` on SIGTERM while installed (main thread only; a no-op elsewhere)."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
