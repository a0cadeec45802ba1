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

Resuming (a workdir holding the same config's checkpoint continues that run) is not
implemented yet; the message for the same config says so.

If anything fails before training starts, `release` gives the workdir back as it was:
the lock file is removed, and a workdir that `claim` created is removed if it is
still empty.
"""

import contextlib
import dataclasses
import json
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
)


class WorkdirHoldsRunError(ValueError):
  """The workdir holds another run's results; refused unless overwriting."""


@dataclasses.dataclass
class Claim:
  """A workdir held for one run (`lock` is None on processes that do not write)."""

  workdir: str
  lock: files.WorkdirLock | None
  created: bool  # The workdir did not exist before `claim`.
  replaced: tuple[str, ...] = ()  # An earlier run's files, removed by `clear`.

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
  if not primary:
    return Claim(workdir, None, created=False)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f'workdir: {workdir} exists and is not a directory.')
  created = not os.path.exists(workdir)
  result = Claim(workdir, files.WorkdirLock(workdir).acquire(), created)
  try:
    present = [name for name in RUN_FILES if os.path.lexists(os.path.join(workdir, name))]
    if present and not overwrite:
      raise WorkdirHoldsRunError(holds_run_message(config, workdir, present))
  except BaseException:
    result.release()
    raise
  result.replaced = tuple(present)
  return result


def holds_run_message(config, workdir: str, present: list[str]) -> str:
  """One line: what the workdir holds, how its config compares, what to do."""
  if 'summary.json' in present:
    earlier = saved_config(workdir)
    if earlier is None:
      what = 'the results of a run whose summary.json has no readable config'
    elif same_config(earlier, config):
      what = (
        'the finished results of a run of this same config (resuming from '
        'checkpoints is not implemented yet)'
      )
    else:
      what = f'the finished results of a run of a different config ({describe(earlier)})'
  elif 'metrics.jsonl' in present:
    what = 'an unfinished run (metrics.jsonl but no summary.json)'
  else:
    what = f'files of an earlier run ({", ".join(present)})'
  return (
    f'workdir: {workdir} holds {what}; choose a new workdir, delete this one, or '
    f'pass --overwrite (train_and_evaluate(..., overwrite=True)) to replace them.'
  )


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


def same_config(saved: dict, config) -> bool:
  """Whether `saved` (from a `summary.json`) is `config`, field for field."""
  return saved == as_json(config)


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
