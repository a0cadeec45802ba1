"""Claiming a workdir for one run: locked first, and never mixed with another run's files.

`claim(config, workdir)` is the first thing `train_and_evaluate` does, before data is
loaded or a model built:

1. it takes the workdir's lock (`files.WorkdirLock`): a second run into a workdir in
   use is refused, naming the first;
2. it looks for the files a run leaves (`RUN_FILES`). A workdir holding none of them
   is used as it is (other files of the user's stay untouched). A workdir holding a
   finished run (`summary.json`) or an unfinished one (`metrics.jsonl` without
   `summary.json`) is refused with one line saying which run it holds and whether its
   config is the same as this one, and what to do: choose another workdir, delete
   that one, or pass `overwrite=True` (`--overwrite` on the command line), which
   removes the earlier run's files first, so that no stale `trace.json` or
   `staleness.png` of another run is left beside the new results.

Resuming: a workdir holding a checkpoint (`checkpoints/`, `training.checkpoints`) of
this same config (`checkpoint_every` aside) is not refused: `claim` returns the latest
checkpoint's metadata as `Claim.resume`, and the run continues from it, its
`metrics.jsonl` taken up where the checkpoint was. A checkpoint of another config is
refused like any other run's files.

If anything fails before training starts, `release` gives the workdir back as it was:
the lock file is removed, and a workdir that `claim` created is removed if it is
still empty.
"""

import contextlib
import dataclasses
import json
import logging
import os
import shutil

from jaxsgd.training import files

# Every file (or folder) a run may leave in its workdir.
RUN_FILES = (
  'summary.json',
  'metrics.jsonl',
  'curves.png',
  'trace.json',
  'staleness.png',
  'params.npz',
  'tensorboard',
  'error.log',
  'checkpoints',
)
# Fields that may differ between a run and the run it resumes: how often it saves, and
# which Ray cluster its lane processes join and how long it waits for it, which do not
# change what it computes (a run is bit-identical on lane processes and in process): a run
# pre-empted with its cluster resumes on whichever cluster is up.
RESUME_MAY_CHANGE = ('checkpoint_every', 'cluster_address', 'cluster_timeout_s')


class WorkdirHoldsRunError(ValueError):
  """The workdir holds another run's results; refused unless overwriting."""


@dataclasses.dataclass
class Claim:
  """A workdir held for one run (`lock` is None on processes that do not write)."""

  workdir: str
  lock: files.WorkdirLock | None
  created: bool  # The workdir did not exist before `claim`.
  replaced: tuple[str, ...] = ()  # An earlier run's files, removed by `clear`.
  resume: dict | None = None  # The metadata of the checkpoint this run continues from.

  def clear(self) -> None:
    """Removes the earlier run's files (`overwrite`); call once the input is valid."""
    for name in self.replaced:
      path = os.path.join(self.workdir, name)
      if os.path.lexists(path):
        _remove(path)
    self.replaced = ()

  def release(self, *, remove_if_empty: bool = True) -> None:
    """Gives the workdir back (idempotent); removes it if `claim` made it and it is empty."""
    if self.lock is not None:
      self.lock.release()
    if remove_if_empty and self.created:
      with contextlib.suppress(OSError):
        os.rmdir(self.workdir)  # Only if empty.


def claim(config, workdir: str, *, primary: bool = True, overwrite: bool = False) -> Claim:
  """Locks `workdir` and refuses another run's results in it (see the module docstring).

  Args:
    config: this run's config (compared with the earlier run's `summary.json`).
    workdir: the run's directory; created if missing.
    primary: this process writes the workdir's files (process 0); other processes of
      a multi-process run take no lock and check nothing.
    overwrite: accept an earlier run's files (removed by `Claim.clear`) instead of
      refusing them.

  Raises:
    files.WorkdirLockedError: another live run holds the workdir.
    WorkdirHoldsRunError: the workdir holds a run's results and `overwrite` is False.
  """
  if not isinstance(workdir, str) or not workdir:
    raise ValueError(f'workdir: a directory path expected, got {workdir!r}.')
  if not primary:  # Resumes what process 0 resumes (it refuses anything else).
    resume = None
    if os.path.isdir(os.path.join(workdir, 'checkpoints')):
      resume = resumable_checkpoint(config, workdir)
    return Claim(workdir, None, created=False, resume=resume)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f'workdir: {workdir} exists and is not a directory.')
  created = not os.path.exists(workdir)
  try:
    lock = files.WorkdirLock(workdir).acquire()
  except PermissionError as error:  # a workdir this user may not write
    raise ValueError(
      f'workdir: {error.filename or workdir}: {error.strerror}; choose a workdir you can '
      'write (--workdir=PATH).'
    ) from None
  result = Claim(workdir, lock, created)
  try:
    present = [name for name in RUN_FILES if os.path.lexists(os.path.join(workdir, name))]
    if 'checkpoints' in present and not overwrite:
      result.resume = resumable_checkpoint(config, workdir)
      if result.resume is not None:
        return result
      if 'summary.json' not in present and _only_cut_short(config, workdir):
        overwrite = True  # an attempt that never saved a whole checkpoint: start over
    if present and not overwrite:
      raise WorkdirHoldsRunError(holds_run_message(config, workdir, present))
  except BaseException:
    result.release()
    raise
  result.replaced = tuple(present)
  return result


def resumable_checkpoint(config, workdir: str) -> dict | None:
  """The latest checkpoint's metadata if it is one of `config`'s run; else None."""
  from jaxsgd.training import checkpoints  # pylint: disable=g-import-not-at-top  # orbax: slow.

  meta = checkpoints.latest_meta(workdir)
  if meta is None or not same_config(meta.get('config') or {}, config, ignore=RESUME_MAY_CHANGE):
    return None
  return meta


def _only_cut_short(config, workdir: str) -> bool:
  """Whether `workdir`'s checkpoints are all damaged (its first save was cut short: a
  kill, a full disk) and none is of another config (by its meta, where it reads): the
  run starts over, replacing that attempt's files, and says so."""
  from jaxsgd.training import checkpoints  # pylint: disable=g-import-not-at-top  # orbax: slow.

  meta, damaged = checkpoints.find_latest(workdir)
  if meta is not None or not damaged or _damaged_of_another(config, workdir, damaged):
    return False
  step, why = damaged[0]
  logging.warning(
    'workdir: %s holds no whole checkpoint (step %d: %s); starting over, replacing that '
    "attempt's files.",
    workdir,
    step,
    why,
  )
  return True


def _damaged_of_another(config, workdir: str, damaged) -> tuple[int, str, str] | None:
  """`(step, why damaged, the fields that differ)` of the first of `damaged` whose meta
  reads and is of another config; None if there is none."""
  from jaxsgd.training import checkpoints  # pylint: disable=g-import-not-at-top  # orbax: slow.

  for step, why in damaged:
    try:
      saved = checkpoints.read_meta(workdir, step).get('config') or {}
    except Exception:  # pylint: disable=broad-except  # unreadable: nothing says otherwise
      continue
    if not same_config(saved, config, ignore=RESUME_MAY_CHANGE):
      return step, why, differences(saved, config, ignore=RESUME_MAY_CHANGE)
  return None


def differences(saved: dict, config, *, ignore=(), most: int = 3) -> str:
  """The fields where `saved` and `config` differ, `field: saved → this run`, the first
  `most` of them (and how many more)."""
  found = []

  def walk(a, b, prefix):
    for key in sorted(set(a) | set(b), key=str):
      if not prefix and key in ignore:
        continue
      x, y = a.get(key, '(none)'), b.get(key, '(none)')
      if isinstance(x, dict) and isinstance(y, dict):
        walk(x, y, f'{prefix}{key}.')
      elif x != y:
        found.append(f'{prefix}{key}: {x!r} → {y!r}')

  walk(saved, as_json(config), '')
  more = f' and {len(found) - most} more' if len(found) > most else ''
  return '; '.join(found[:most]) + more


def holds_run_message(config, workdir: str, present: list[str]) -> str:
  """One line: what the workdir holds, how its config compares, what to do."""
  if 'summary.json' in present:
    earlier = saved_config(workdir)
    if earlier is None:
      what = 'the results of a run whose summary.json has no readable config'
    elif same_config(earlier, config):
      what = (
        'the finished results of a run of this same config, without a checkpoint to '
        'resume from (set checkpoint_every > 0 to leave one)'
      )
    else:
      what = (
        f'the finished results of a run of a different config ({describe(earlier)}; '
        f'it differs in {differences(earlier, config)})'
      )
  elif 'checkpoints' in present:
    what = _checkpoints_of_another(config, workdir)
  elif 'metrics.jsonl' in present:
    what = 'an unfinished run (metrics.jsonl but no summary.json)'
  else:
    what = f'files of an earlier run ({", ".join(present)})'
  return (
    f'workdir: {workdir} holds {what}; choose a new workdir, delete this one, or '
    f'pass --overwrite (train_and_evaluate(..., overwrite=True)) to replace them.'
  )


def _checkpoints_of_another(config, workdir: str) -> str:
  """What the workdir's checkpoints are, where none resumes this run."""
  from jaxsgd.training import checkpoints  # pylint: disable=g-import-not-at-top  # orbax: slow.

  meta, damaged = checkpoints.find_latest(workdir)
  if meta is not None:
    fields = differences(meta.get('config') or {}, config, ignore=RESUME_MAY_CHANGE)
    return f'checkpoints of a run of a different config (it differs in {fields}; a run resumes only its own)'
  other = _damaged_of_another(config, workdir, damaged)
  if other is not None:
    step, why, fields = other
    return f'an unfinished checkpoint (step {step}: {why}) of a run of a different config (it differs in {fields})'
  step, why = damaged[0] if damaged else (None, 'none is complete')
  return f'checkpoints none of which is whole (step {step}: {why})'


def saved_config(workdir: str) -> dict | None:
  """The config recorded in `workdir/summary.json`, as plain JSON values; None if none."""
  try:
    with open(os.path.join(workdir, 'summary.json')) as f:
      config = json.load(f).get('config')
  except (OSError, ValueError, AttributeError):
    return None
  return config if isinstance(config, dict) else None


def as_json(config) -> dict:
  """A config as `summary.json` records it (tuples as lists, NaN/inf as strings)."""
  value = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
  return json.loads(files.to_json(value))


def same_config(saved: dict, config, *, ignore=()) -> bool:
  """Whether `saved` (from a `summary.json` or a checkpoint) is `config`, field for field
  (the top-level fields `ignore` aside)."""
  drop = lambda c: {k: v for k, v in c.items() if k not in ignore}
  return drop(saved) == drop(as_json(config))


def describe(saved: dict) -> str:
  algorithm = (saved.get('algorithm') or {}).get('name')
  model = (saved.get('model') or {}).get('name')
  return (
    f'algorithm {algorithm}, model {model}, dataset {saved.get("dataset")}, '
    f'seed {saved.get("seed")}, {saved.get("train_steps")} steps'
  )


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  else:
    os.unlink(path)
