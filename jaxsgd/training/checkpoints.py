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

Damage: once a save is complete, process 0 lists every file of the step's folder with
its size in `COMPLETE`. A resume takes the newest checkpoint whose files are all there,
whole, and whose `meta` reads; a damaged newer one (a truncated or missing file, an
emptied folder, a save cut short) is passed over with one warning line naming it and
why, and removed when the run opens its checkpoints. A save that fails (a full disk)
raises `CheckpointWriteError` naming the folder: a failed run, not bad input.

Pre-emption: `PreemptionWatch` turns SIGTERM into a flag; the run saves a checkpoint at
the next step and stops with `errors.Preempted` (the binary exits with 143, 128 +
SIGTERM, as a process killed by SIGTERM would). Ctrl-C (SIGINT) stops the run at once,
without a checkpoint of the step it was in, except that one arriving while orbax saves
or reads a checkpoint is held until it has ended (`ctrl_c_after_orbax`): orbax's threads
and tensorstore's callbacks outlive an interrupted save or restore and meet its closed
event loop (a traceback after the one-line message). A second Ctrl-C then interrupts it
at once. A Ctrl-C whose `KeyboardInterrupt` Python dropped (raised in a finalizer or a
callback from C) is raised again at the run's next step (`PreemptionWatch.interrupt_lost`),
where the run would have trained on.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
from typing import Any

import jax
import numpy as np

from jaxsgd.training import files

KEEP = 3  # Checkpoints kept (the last ones).
# Said once on stderr when a Ctrl-C comes during a save or a read (`ctrl_c_after_orbax`), on
# a line of its own: the progress bar's line (and a terminal's echoed ^C) has no newline.
HELD_CTRL_C = b'\nCtrl-C: held while the checkpoint is written; press it again to pass it on now.\n'
HELD_CTRL_C_READING = (
  b'\nCtrl-C: held while a checkpoint is read; press it again to pass it on now.\n'
)
_HOLDING = 'jaxsgd_holds_ctrl_c'  # marks `ctrl_c_after_orbax`'s handler (it nests)
DIRECTORY = 'checkpoints'
COMPLETE = 'jaxsgd-complete.json'  # in a step's folder: its files and their sizes


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (a full disk, a folder not writable)."""


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
  """The `meta` of the newest complete, undamaged checkpoint in `workdir` (None if there
  is none); a newer damaged one is passed over with one warning line."""
  meta, damaged = find_latest(workdir)
  if meta is not None and damaged:
    step, why = damaged[0]
    logging.warning(
      'checkpoint of step %d in %s is damaged (%s); resuming from step %d (the damaged '
      'one is removed).',
      step,
      directory(workdir),
      why,
      meta['step'],
    )
  return meta


def find_latest(workdir: str) -> tuple[dict | None, list[tuple[int, str]]]:
  """`(meta of the newest complete checkpoint or None, [(step, why damaged)] of the
  newer ones passed over)`."""
  root = directory(workdir)
  if not os.path.isdir(root):
    return None, []
  steps = sorted((int(name) for name in os.listdir(root) if name.isdigit()), reverse=True)
  damaged = []
  for step in steps:
    why = damage(os.path.join(root, str(step)))
    if why is None:
      try:
        return read_meta(workdir, step), damaged
      except Exception as error:  # pylint: disable=broad-except  # orbax, JSON, OS errors
        why = f'its meta does not read: {_first_line(error)}'
    damaged.append((step, why))
  return None, damaged


def read_meta(workdir: str, step: int) -> dict:
  """Step `step`'s `meta` (raises if it does not read)."""
  ocp = _ocp()
  manager = _manager(workdir, read_only=True)
  try:
    with ctrl_c_after_orbax(HELD_CTRL_C_READING):
      return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  finally:
    manager.close()


def damage(folder: str) -> str | None:
  """Why the checkpoint in `folder` cannot be resumed from, or None if its files are all
  there, whole (`COMPLETE`; a checkpoint saved before that file existed counts as whole
  once orbax committed it)."""
  listed = os.path.join(folder, COMPLETE)
  if not os.path.exists(listed):
    if os.path.exists(os.path.join(folder, 'commit_success.txt')):
      return None
    return 'its save did not finish'
  try:
    with open(listed) as f:
      sizes = json.load(f)
    expected = {str(name): int(size) for name, size in sizes.items()}
  except (OSError, ValueError, AttributeError, TypeError):
    return f'{COMPLETE} does not read'
  for name, size in sorted(expected.items()):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      return f'{name} is missing'
    if os.path.getsize(path) != size:
      return f'{name} has {os.path.getsize(path)} of its {size} bytes'
  return None


def _list_files(folder: str) -> dict[str, int]:
  listed = {}
  for parent, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(parent, name)
      listed[os.path.relpath(path, folder)] = os.path.getsize(path)
  listed.pop(COMPLETE, None)
  return listed


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


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
      self._remove_damaged()  # before orbax lists the steps: it would refuse to save them
      self._manager = _manager(self._workdir)
    return self._manager

  def _remove_damaged(self) -> None:
    """Removes the step folders newer than the checkpoint a resume reads, which it passed
    over as damaged (`find_latest`; `latest_meta` named them)."""
    if jax.process_index() != 0:
      return
    for step, _ in find_latest(self._workdir)[1]:
      shutil.rmtree(os.path.join(directory(self._workdir), str(step)), ignore_errors=True)

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Writes step `step`'s checkpoint (every process calls it: arrays may be sharded),
    then process 0 lists its files (`COMPLETE`). Raises `CheckpointWriteError` if the
    save fails; what it wrote of the step is removed."""
    ocp = _ocp()
    folder = os.path.join(directory(self._workdir), str(step))
    primary = jax.process_index() == 0
    try:
      with ctrl_c_after_orbax(HELD_CTRL_C, even_after_an_error=False):
        self.manager().save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
          force=True,
        )
        self.manager().wait_until_finished()
        if primary:
          files.atomic_write(os.path.join(folder, COMPLETE), json.dumps(_list_files(folder)))
    except Exception as error:
      if primary:
        self._remove_partial(step)
      raise CheckpointWriteError(
        f'checkpoint: saving step {step} in {directory(self._workdir)} failed: {_first_line(error)}'
      ) from error

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of `step` left (its folder, orbax's temporary one)."""
    self.close()
    root = directory(self._workdir)
    for name in os.listdir(root) if os.path.isdir(root) else ():
      if name == str(step) or name.startswith(f'{step}.orbax-checkpoint-tmp'):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)

  def restore(self, step: int, template: Any) -> Any:
    """Step `step`'s state, in the structure, dtypes and shardings of `template` (None:
    as saved; numpy arrays stay numpy arrays)."""
    ocp = _ocp()
    with ctrl_c_after_orbax(HELD_CTRL_C_READING):
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


@contextlib.contextmanager
def ctrl_c_after_orbax(line: bytes, *, even_after_an_error: bool = True):
  """Within (an orbax save or read), in the main thread: a Ctrl-C is held (`line` on
  stderr says so) and handed to the handler that was installed (Python's, raising
  `KeyboardInterrupt`, or a lane pool's) once the block has ended; a second Ctrl-C within
  is handed on at once, for the block may be what hangs. If the block raised (other than
  that second Ctrl-C's `KeyboardInterrupt`), the held Ctrl-C is handed on all the same
  (its `KeyboardInterrupt` then carries the error as its context: a read's error may be
  caught, and the run would go on) unless `even_after_an_error` is False (a save: its
  error ends the run, exit 1, and the save's clean-up needs that error). Nested within
  another, it leaves the Ctrl-C to the outer one (a save or a restore opens the manager,
  which reads the checkpoints' metas). Outside the main thread, or with no Python handler
  for SIGINT (ignored, as `nohup cmd &` leaves it), a no-op: a save in a worker thread
  (the threaded real clock) is not interrupted by Ctrl-C, which only the main thread
  hears."""
  before = signal.getsignal(signal.SIGINT)
  main = threading.current_thread() is threading.main_thread()
  if not main or not callable(before) or getattr(before, _HOLDING, False) is True:
    yield
    return
  held = []

  def hold(signum, frame):
    if held:  # The second: the block may be what hangs.
      signal.signal(signal.SIGINT, before)
      before(signum, frame)
    held.append(frame)
    if len(held) == 1:
      _say(line)

  setattr(hold, _HOLDING, True)
  signal.signal(signal.SIGINT, hold)
  error = None
  try:
    yield
  except BaseException as raised:
    error = raised
    raise
  finally:
    signal.signal(signal.SIGINT, before)
    passed_on = error is None or (even_after_an_error and not isinstance(error, KeyboardInterrupt))
    if held and passed_on:
      before(signal.SIGINT, held[0])  # (raised here, it carries `error` as its context)


def _say(line: bytes) -> None:
  """`line` on stderr from a signal handler: os.write, for the code it interrupted may be
  inside a write to sys.stderr; an error (a closed pipe, after `| tee` ended) is ignored,
  for raised there it would fail the save or read the handler is holding a Ctrl-C for."""
  try:
    os.write(2, line)
  except OSError:
    pass


class PreemptionWatch:
  """Sets `requested` on SIGTERM while installed (main thread only; a no-op elsewhere).
  Ctrl-C goes on to the handler it found, and if that raised `KeyboardInterrupt` (Python's
  does), `interrupted` is set: `Run.report` raises it again in the main thread at the
  run's next step (`interrupt_lost`), for Python drops a `KeyboardInterrupt` raised in a
  finalizer or a callback from C, and the run would train on. (While a lane pool is open
  its own handler takes Ctrl-C, and raises a lost one again: `_StopSignals.check`.)

  In a multi-process run the processes agree on the step to save at (`due`): SIGTERM
  may reach one process only (an operator's `kill`, a machine's pre-emption notice),
  and a process that saved alone would wait in orbax's cross-process barrier while its
  peers wait in the step's collective, for ever. Every process gathers every process's
  flag at each step the run asks (`Run.maybe_save`: the same steps in every process),
  so all see a request at the same step and save there. The gather also holds each
  process's host there until the others arrive (the hosts may otherwise dispatch steps
  ahead of one another); a key-value protocol without it saved at different steps when
  one host ran ahead.
  """

  def __init__(self):
    self.requested = False
    self.interrupted = False
    self._previous = None
    self._previous_ctrl_c = None

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def _ctrl_c(self, signum, frame):
    try:
      (self._previous_ctrl_c or signal.default_int_handler)(signum, frame)
    except KeyboardInterrupt:
      self.interrupted = True
      raise

  def interrupt_lost(self) -> bool:
    """Whether a Ctrl-C came and this is the main thread: had its `KeyboardInterrupt`
    reached the run, the run would have stopped."""
    return self.interrupted and threading.current_thread() is threading.main_thread()

  def due(self, step: int) -> bool:
    """Whether the run must save at `step` and stop (see the class docstring)."""
    del step  # the same in every process: the gathers pair up in order
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    flags = multihost_utils.process_allgather(np.int32(self.requested))
    self.requested = bool(np.any(flags))
    return self.requested

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      if callable(signal.getsignal(signal.SIGINT)):  # (not when ignored: `nohup cmd &`)
        self._previous_ctrl_c = signal.signal(signal.SIGINT, self._ctrl_c)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
    if self._previous_ctrl_c is not None:
      signal.signal(signal.SIGINT, self._previous_ctrl_c)
      self._previous_ctrl_c = None
