"""Files a user can trust: atomic writes, valid JSON, whole JSON lines, a workdir lock.

* `atomic_write` / `atomic_open` / `atomic_path` write to a temporary file in the
  same directory, `fsync` it, then `os.replace` it over the target (and `fsync` the
  directory): a reader, a crash, a kill or a full disk leaves either the old file or
  the new one, never a half-written one. (A killed writer may leave its temporary
  `.NAME.tmp-*` file behind; `WorkdirLock.acquire` removes those.)
* `to_json` / `write_json` always produce valid JSON (RFC 8259): NaN and ±infinity,
  which Python's `json` would write as the bare tokens `NaN` / `Infinity` (invalid
  JSON), are **encoded** as the strings `"NaN"`, `"Infinity"`, `"-Infinity"` —
  `float(value)` turns them back into floats. NumPy scalars and arrays become
  numbers and lists; any other object becomes its `str`.
* `JsonLinesWriter` appends one JSON object per line with a single `write` on a file
  opened with `O_APPEND`: lines of concurrent writers never interleave, and a killed
  process leaves whole lines, except that the kernel may cut the very last one short
  (it stops a write interrupted by SIGKILL at a page boundary), as may a machine
  crash. Such a torn last line is cut off when the file is next opened for
  appending, and `read_json_lines` skips it.
* `WorkdirLock` holds a workdir for one run: a second run into it is refused with
  one line naming the first (pid, host, start time); the lock of a run that died
  (its `flock` went with its process) is taken over, with a warning.
"""

import contextlib
import datetime
import fcntl
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

LOCK_NAME = 'run.lock'
_TEMP_MARK = '.tmp-'
NON_FINITE = {math.inf: 'Infinity', -math.inf: '-Infinity'}  # NaN: 'NaN'.


# --- atomic writes ----------------------------------------------------------------------


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """Yields a temporary path (same directory, same extension) that becomes `path`.

  For writers that want a file name (e.g. `matplotlib`'s `savefig`, which picks the
  format from the extension). If the block raises, `path` is left as it was.
  """
  directory, name = os.path.split(os.path.abspath(path))
  stem, ext = os.path.splitext(name)
  fd, temp = tempfile.mkstemp(prefix=f'.{stem}{_TEMP_MARK}', suffix=ext, dir=directory)
  os.close(fd)
  try:
    yield temp
    _publish(temp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(temp)
    raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = 'w', **kwargs):
  """`open(path, mode)` whose content appears at `path` only when the block succeeds."""
  if mode not in ('w', 'wb'):
    raise ValueError(f'mode: atomic_open writes a whole new file, "w" or "wb"; got {mode!r}.')
  with atomic_path(path) as temp:
    with open(temp, mode, **kwargs) as f:
      yield f


def atomic_write(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` atomically (see the module docstring)."""
  with atomic_open(path, 'wb') as f:
    f.write(data.encode() if isinstance(data, str) else data)


def _publish(temp: str, path: str) -> None:
  """fsyncs `temp`, gives it the mode a new file would get, renames it onto `path`."""
  fd = os.open(temp, os.O_RDONLY)
  try:
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files.
    os.fsync(fd)
  finally:
    os.close(fd)
  os.replace(temp, path)
  _fsync_directory(os.path.dirname(os.path.abspath(path)))


def _fsync_directory(directory: str) -> None:
  """Makes a rename in `directory` durable (a no-op where directories cannot be opened)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _umask() -> int:
  """This process's umask, read without changing it (Linux), else by setting it back."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('Umask:'):
          return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def remove_stale_temp_files(directory: str) -> list[str]:
  """Removes temporary files that killed writers left in `directory`; returns their names.

  Only safe while no one else writes there (e.g. holding the `WorkdirLock`).
  """
  removed = []
  for name in os.listdir(directory):
    if name.startswith('.') and _TEMP_MARK in name:
      with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        os.unlink(os.path.join(directory, name))
        removed.append(name)
  return removed


# --- JSON ---------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
  """`value` with only JSON types: non-finite floats as strings, NumPy as Python."""
  if isinstance(value, dict):
    return {_key(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return jsonable(value.tolist())
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    value = float(value)
    return value if math.isfinite(value) else ('NaN' if math.isnan(value) else NON_FINITE[value])
  if value is None or isinstance(value, str):
    return value
  return str(value)


def _key(key) -> str:
  """JSON object keys are strings; Python's `json` would turn 1 into "1" too."""
  if isinstance(key, str):
    return key
  converted = jsonable(key)
  return converted if isinstance(converted, str) else json.dumps(converted)


def to_json(value: Any, *, indent: int | None = None) -> str:
  """Valid JSON for `value` (see `jsonable`); never the bare tokens NaN or Infinity."""
  try:  # Fast: C encoder; only what it cannot take as is goes through `jsonable`.
    return json.dumps(value, indent=indent, allow_nan=False, default=jsonable)
  except (ValueError, TypeError):  # A non-finite float, or a key JSON cannot have.
    return json.dumps(jsonable(value), indent=indent, allow_nan=False)


def write_json(path: str, value: Any, *, indent: int | None = 2) -> None:
  """Writes `to_json(value)` to `path` atomically."""
  atomic_write(path, to_json(value, indent=indent) + '\n')


_DECODED = {'NaN': math.nan, 'Infinity': math.inf, '-Infinity': -math.inf}


def decode_non_finite(value: Any) -> Any:
  """Undoes `jsonable`'s encoding: the strings "NaN", "Infinity", "-Infinity" become floats."""
  if isinstance(value, dict):
    return {k: decode_non_finite(v) for k, v in value.items()}
  if isinstance(value, list):
    return [decode_non_finite(v) for v in value]
  if isinstance(value, str):
    return _DECODED.get(value, value)
  return value


def read_json(path: str) -> Any:
  """What `write_json` wrote, non-finite floats included (`decode_non_finite`)."""
  with open(path) as f:
    return decode_non_finite(json.load(f))


# --- JSON lines --------------------------------------------------------------------------


class JsonLinesWriter:
  """Appends JSON objects to a file, one per line, never leaving a torn line.

  Each record is one `os.write` of one line on a descriptor opened with `O_APPEND`,
  so lines of writers sharing the file do not interleave, and a process killed at any
  moment leaves whole lines but perhaps a torn last one (see the module docstring),
  which opening for appending cuts off. A write that fails (a full disk) cuts its
  part-written line off before it raises. `fsync=True` also makes each line durable
  before `write` returns (one disk flush per line).

  Args:
    path: the file.
    mode: 'w' starts the file afresh, 'a' continues it.
    fsync: flush each line to the disk, not only to the kernel.
  """

  def __init__(self, path: str, mode: str = 'a', *, fsync: bool = False):
    if mode not in ('a', 'w'):
      raise ValueError(f'mode: "a" (append) or "w" (start afresh), got {mode!r}.')
    self.path, self._fsync = path, fsync
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if mode == 'w' else 0)
    self._fd = os.open(path, flags, 0o666)
    if mode == 'a':
      self.torn_bytes = _cut_torn_tail(self._fd)
    else:
      self.torn_bytes = 0

  def write(self, record: dict) -> None:
    """Appends `record` as one line of valid JSON (see `to_json`)."""
    if self._fd is None:
      raise ValueError(f'{self.path}: the writer is closed.')
    data = memoryview((to_json(record) + '\n').encode())
    with _flocked(self._fd, fcntl.LOCK_SH):  # Keeps a new appender from cutting it.
      whole = os.fstat(self._fd).st_size
      try:
        while data:  # A regular file takes it in one write; loop on the rare short write.
          data = data[os.write(self._fd, data) :]
        if self._fsync:
          os.fsync(self._fd)
      except OSError:  # a full disk: no torn line is left behind
        with contextlib.suppress(OSError):
          os.ftruncate(self._fd, whole)
        raise

  def close(self) -> None:
    if self._fd is not None:
      with contextlib.suppress(OSError):
        os.fsync(self._fd)
      os.close(self._fd)
      self._fd = None

  @property
  def closed(self) -> bool:
    return self._fd is None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    if getattr(self, '_fd', None) is not None:
      os.close(self._fd)


@contextlib.contextmanager
def _flocked(fd: int, operation: int):
  """Holds `flock(fd, operation)` (nothing on a file system without locks).

  Appenders hold it shared while they write a line; `_cut_torn_tail` holds it
  exclusive, so a line another process is still writing (a reader may see part of
  a write larger than a page) is never taken for a torn one and cut.
  """
  try:
    fcntl.flock(fd, operation)
  except OSError:
    yield
    return
  try:
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)


def _cut_torn_tail(fd: int) -> int:
  """Truncates the file after its last newline; returns the bytes cut (0 if whole)."""
  with _flocked(fd, fcntl.LOCK_EX):
    return _cut_torn_tail_locked(fd)


def _cut_torn_tail_locked(fd: int) -> int:
  size = os.fstat(fd).st_size
  end = size
  while end > 0:
    start = max(0, end - 65536)
    chunk = os.pread(fd, end - start, start)
    newline = chunk.rfind(b'\n')
    if newline >= 0:
      end = start + newline + 1
      break
    end = start
  if end < size:
    os.ftruncate(fd, end)
    logging.warning(
      '%s ended in a torn line (%d bytes, from a killed or crashed writer); cut it off.',
      _fd_path(fd),
      size - end,
    )
  return size - end


def _fd_path(fd: int) -> str:
  with contextlib.suppress(OSError):
    return os.readlink(f'/proc/self/fd/{fd}')
  return f'file descriptor {fd}'


def read_json_lines(path: str) -> list[dict]:
  """The records of a JSON-lines file (`decode_non_finite`), without a torn last line."""
  with open(path, 'rb') as f:
    data = f.read()
  whole = data[: data.rfind(b'\n') + 1]  # A last line with no newline is torn.
  return [decode_non_finite(json.loads(line)) for line in whole.splitlines() if line.strip()]


# --- the workdir lock ----------------------------------------------------------------------


class WorkdirLockedError(RuntimeError):
  """Another live run holds the workdir."""


_HELD: dict[str, 'WorkdirLock'] = {}  # Locks this process holds, by real path.


class WorkdirLock:
  """Holds `workdir` for one run, as long as this object holds it (or the process lives).

  The lock is an exclusive `flock` on `WORKDIR/run.lock`, which also records who
  holds it (pid, host, start time, command). The kernel releases a `flock` when its
  process dies, however it dies, so a lock file whose lock is free belongs to a dead
  run: it is taken over (with a warning naming that run). Within one process, a new
  lock on a workdir takes over from an earlier one (a run that failed and was never
  closed, e.g. in a notebook). Works on local file systems and NFS (Linux emulates
  `flock` with NFS byte-range locks).
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_NAME)
    self._file = None
    self.taken_over: dict | None = None  # The dead run's record, if there was one.

  def acquire(self) -> 'WorkdirLock':
    """Takes the lock, or raises `WorkdirLockedError` naming the run that holds it."""
    os.makedirs(self.workdir, exist_ok=True)
    key = os.path.realpath(self.path)
    earlier = _HELD.get(key)
    if earlier is not None and earlier is not self:
      logging.warning(
        '%s: taking over from an earlier run in this process that was not finished.', self.workdir
      )
      earlier.release()
    while self._file is None:
      f = open(self.path, 'a+')  # pylint: disable=consider-using-with
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(f, wait_s=1.0)
        f.close()
        raise WorkdirLockedError(_locked_message(self.workdir, holder)) from None
      except OSError as e:  # A file system without locks: run, but say it is unguarded.
        f.close()
        logging.warning(
          '%s: cannot lock %s (%s); another run into this workdir would not be refused.',
          self.workdir,
          LOCK_NAME,
          e,
        )
        return self
      if not _same_file(f, self.path):  # Its holder removed it as we opened it: again.
        f.close()
        continue
      self.taken_over = _read_holder(f) or None
      _write_holder(f)
      self._file = f
    _HELD[key] = self
    if self.taken_over:
      logging.warning(
        '%s: took over the lock of a run that is no longer running (%s).',
        self.workdir,
        _describe(self.taken_over),
      )
    remove_stale_temp_files(self.workdir)
    return self

  def release(self) -> None:
    """Removes the lock file and releases the lock (idempotent)."""
    if self._file is None:
      return
    _HELD.pop(os.path.realpath(self.path), None)
    with contextlib.suppress(FileNotFoundError):
      if _same_file(self._file, self.path):
        os.unlink(self.path)  # Still holding the lock: nobody else can be using it.
    self._file.close()
    self._file = None

  @property
  def held(self) -> bool:
    return self._file is not None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def read_lock_holder(workdir: str) -> dict | None:
  """The record in `WORKDIR/run.lock` (of a live run, or of one that died), if any."""
  try:
    with open(os.path.join(workdir, LOCK_NAME)) as f:
      return _read_holder(f)
  except FileNotFoundError:
    return None


def _same_file(f, path: str) -> bool:
  try:
    a, b = os.fstat(f.fileno()), os.stat(path)
  except FileNotFoundError:
    return False
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _holder_record() -> dict:
  return {
    'pid': os.getpid(),
    'host': socket.gethostname(),
    'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'command': ' '.join(sys.argv)[:500],
  }


def _write_holder(f) -> None:
  f.seek(0)
  f.truncate()
  f.write(to_json(_holder_record()) + '\n')
  f.flush()
  os.fsync(f.fileno())


def _read_holder(f, wait_s: float = 0.0) -> dict:
  """The holder's record; waits up to `wait_s` for a holder that is still writing it."""
  deadline = time.monotonic() + wait_s
  while True:
    f.seek(0)
    text = f.read()
    if text.endswith('\n'):
      try:
        return json.loads(text)
      except ValueError:
        return {}
    if time.monotonic() >= deadline:
      return {}
    time.sleep(0.02)


def _describe(holder: dict) -> str:
  if not holder:
    return 'details not recorded'
  return (
    f'pid {holder.get("pid")} on host {holder.get("host")}, started '
    f'{holder.get("started")}: {holder.get("command")}'
  )


def _locked_message(workdir: str, holder: dict) -> str:
  return (
    f'workdir {workdir} is in use by another run ({_describe(holder)}); wait for it '
    f'to finish, stop it, or choose another workdir.'
  )
