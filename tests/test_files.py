"""`jaxsgd.training.files`: atomic writes, valid JSON, whole JSON lines, the workdir lock.

Kills and races use real processes. They load `files.py` by path (it needs only
NumPy), so that each starts in a fraction of a second instead of importing JAX.
"""

import json
import math
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxsgd.training import files

FILES_PY = pathlib.Path(files.__file__)
_PRELUDE = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location('files', {str(FILES_PY)!r})
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
"""


def _child(code: str, *args, **kwargs) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, '-c', _PRELUDE + code, *map(str, args)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kwargs,
  )


def _wait_line(proc, expected: str, timeout: float = 30) -> None:
  """Reads `proc`'s stdout until the line `expected` (a hang fails the test)."""
  deadline = time.monotonic() + timeout
  while True:
    assert time.monotonic() < deadline, f'no {expected!r} from the child'
    line = proc.stdout.readline()
    assert line or proc.poll() is None, proc.stderr.read()
    if line.strip() == expected:
      return


def _strict_loads(text: str):
  """`json.loads` that refuses the non-standard tokens NaN, Infinity, -Infinity."""

  def refuse(token):
    raise ValueError(f'not valid JSON: {token}')

  return json.loads(text, parse_constant=refuse)


# --- atomic writes --------------------------------------------------------------------------


def test_atomic_write_writes_the_file_with_the_usual_mode(tmp_path):
  path = tmp_path / 'a.txt'
  files.atomic_write(str(path), 'hello')
  files.atomic_write(str(path), b'bytes')
  assert path.read_bytes() == b'bytes'
  umask = os.umask(0o022)
  os.umask(umask)
  assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
  assert os.listdir(tmp_path) == ['a.txt']  # No temporary file left.


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
  path = tmp_path / 'summary.json'
  path.write_text('old')
  with pytest.raises(OSError, match='No space left'):
    with files.atomic_open(str(path)) as f:
      f.write('new, but half')
      raise OSError(28, 'No space left on device')  # What a full disk raises.
  assert path.read_text() == 'old'
  assert os.listdir(tmp_path) == ['summary.json']


def test_atomic_path_keeps_the_extension_for_writers_that_read_it(tmp_path):
  with files.atomic_path(str(tmp_path / 'curves.png')) as temp:
    assert temp.endswith('.png') and os.path.dirname(temp) == str(tmp_path)
    pathlib.Path(temp).write_bytes(b'png')
  assert (tmp_path / 'curves.png').read_bytes() == b'png'


def test_a_kill_mid_write_leaves_the_old_file_intact(tmp_path):
  path = tmp_path / 'trace.json'
  old = b'{"old": true}\n'
  path.write_bytes(old)
  writer = _child(
    """
with files.atomic_open(sys.argv[1], 'wb') as f:
  f.write(b'x' * 1_000_000)
  f.flush()
  print('half written', flush=True)
  time.sleep(60)
  f.write(b'never')
""",
    path,
  )
  try:
    _wait_line(writer, 'half written')
    temps = [n for n in os.listdir(tmp_path) if n != 'trace.json']
    assert len(temps) == 1 and os.path.getsize(tmp_path / temps[0]) == 1_000_000
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
  finally:
    writer.kill()
  assert path.read_bytes() == old
  assert files.remove_stale_temp_files(str(tmp_path)) == temps  # What the lock clears.
  assert os.listdir(tmp_path) == ['trace.json']


# --- JSON ---------------------------------------------------------------------------------


def test_json_is_always_valid_non_finite_floats_are_encoded_as_strings():
  value = {
    'loss': math.nan,
    'sim_time': math.inf,
    'low': -math.inf,
    'ok': 1.5,
    'f32': np.float32('nan'),
    'i64': np.int64(7),
    'arr': np.array([1.0, np.inf]),
    'nested': [{'x': (np.float64(-np.inf),)}],
    3: True,
    'flag': np.bool_(False),
    'other': pathlib.PurePosixPath('/a'),
  }
  decoded = _strict_loads(files.to_json(value))
  assert decoded == {
    'loss': 'NaN',
    'sim_time': 'Infinity',
    'low': '-Infinity',
    'ok': 1.5,
    'f32': 'NaN',
    'i64': 7,
    'arr': [1.0, 'Infinity'],
    'nested': [{'x': ['-Infinity']}],
    '3': True,
    'flag': False,
    'other': '/a',
  }
  # The strings turn back into the floats.
  assert math.isnan(float(decoded['loss'])) and float(decoded['sim_time']) == math.inf
  assert float(decoded['low']) == -math.inf


def test_finite_json_is_what_the_json_module_writes():
  value = {'a': [1, 2.5, None, 'x', {'b': False}], 'c': {'d': 1e-300}, 4: 'four'}
  assert files.to_json(value, indent=2) == json.dumps(value, indent=2)


def test_write_json_is_atomic_and_strict(tmp_path):
  path = tmp_path / 'summary.json'
  files.write_json(str(path), {'final': {'sim_time': math.inf}})
  assert _strict_loads(path.read_text()) == {'final': {'sim_time': 'Infinity'}}
  assert files.read_json(str(path)) == {'final': {'sim_time': math.inf}}


# --- JSON lines ---------------------------------------------------------------------------


def test_json_lines_append_and_restart(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  with files.JsonLinesWriter(path, 'w') as w:
    w.write({'step': 1, 'loss': math.nan})
  with files.JsonLinesWriter(path, 'a') as w:
    w.write({'step': 2})
  lines = pathlib.Path(path).read_text().splitlines()
  assert [_strict_loads(line) for line in lines] == [{'step': 1, 'loss': 'NaN'}, {'step': 2}]
  records = files.read_json_lines(path)  # Decodes the non-finite floats.
  assert math.isnan(records[0]['loss']) and records[1] == {'step': 2}
  with files.JsonLinesWriter(path, 'w') as w:
    w.write({'step': 9})
  assert files.read_json_lines(path) == [{'step': 9}]


def test_a_torn_last_line_is_skipped_by_readers_and_cut_by_appenders(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"st')  # A crash mid-line.
  assert files.read_json_lines(str(path)) == [{'step': 1}, {'step': 2}]
  with files.JsonLinesWriter(str(path)) as w:
    assert w.torn_bytes == 4
    w.write({'step': 3})
  assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
  path.write_bytes(b'{"no newline at all"')
  with files.JsonLinesWriter(str(path)) as w:
    w.write({'step': 1})
  assert path.read_bytes() == b'{"step": 1}\n'


_APPEND = """
w = files.JsonLinesWriter(sys.argv[1])
print('writing', flush=True)
for i in range(int(sys.argv[3])):
  w.write({'writer': int(sys.argv[2]), 'i': i, 'pad': 'x' * (i * 97 % 9000)})
"""


def _check_lines(records, writers):
  for k in range(writers):  # Each writer's lines, whole, in order, none lost.
    mine = [r['i'] for r in records if r['writer'] == k]
    assert mine == list(range(len(mine)))
  assert all(r['pad'] == 'x' * (r['i'] * 97 % 9000) for r in records)


def test_concurrent_appenders_do_not_interleave_their_lines(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  writers = [_child(_APPEND, path, k, 2000) for k in range(3)]
  for w in writers:
    assert w.wait(timeout=120) == 0, w.stderr.read()
  records = [_strict_loads(line) for line in path.read_text().splitlines()]
  assert len(records) == 3 * 2000
  _check_lines(records, 3)


def test_a_killed_appender_leaves_whole_lines_but_perhaps_a_torn_last_one(tmp_path):
  # The kernel may stop a write that SIGKILL interrupts at a page boundary: a torn last
  # line is possible, and readers and the next appender must cope with it.
  path = tmp_path / 'metrics.jsonl'
  writer = _child(_APPEND, path, 0, 10**9)
  try:
    _wait_line(writer, 'writing')
    while path.stat().st_size < 1_000_000:
      time.sleep(0.01)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
  finally:
    writer.kill()
  lines = path.read_bytes().split(b'\n')
  for line in lines[:-1]:  # All but the last piece (b'' unless torn) are whole.
    _strict_loads(line.decode())
  records = files.read_json_lines(str(path))
  assert len(records) == len(lines) - 1
  _check_lines(records, 1)
  files.JsonLinesWriter(str(path)).close()  # Opening to append cuts a torn tail off.
  assert path.read_bytes().endswith(b'\n')
  assert files.read_json_lines(str(path)) == records


# --- the workdir lock -----------------------------------------------------------------------

_HOLD = """
lock = files.WorkdirLock(sys.argv[1]).acquire()
print('locked', flush=True)
time.sleep(60)
"""


def test_a_second_run_is_refused_naming_the_first(tmp_path):
  first = _child(_HOLD, tmp_path)
  try:
    _wait_line(first, 'locked')
    with pytest.raises(files.WorkdirLockedError) as error:
      files.WorkdirLock(str(tmp_path)).acquire()
    message = str(error.value)
    assert message.startswith(
      f'workdir {tmp_path} is in use by another run (pid {first.pid} '
      f'on host {socket.gethostname()}, started 20'
    )
    assert '\n' not in message and 'choose another workdir' in message
    assert files.read_lock_holder(str(tmp_path))['pid'] == first.pid
  finally:
    first.kill()
    first.wait()


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path, caplog):
  dead = _child(_HOLD, tmp_path)
  _wait_line(dead, 'locked')
  dead.send_signal(signal.SIGKILL)
  dead.wait(timeout=10)
  assert files.read_lock_holder(str(tmp_path))['pid'] == dead.pid  # Left behind.
  (tmp_path / '.summary.tmp-abc.json').write_text('a killed writer left this')
  with files.WorkdirLock(str(tmp_path)) as lock:
    assert lock.taken_over['pid'] == dead.pid
    assert files.read_lock_holder(str(tmp_path))['pid'] == os.getpid()
    assert os.listdir(tmp_path) == [files.LOCK_NAME]  # Stale temporary file removed.
  assert f'took over the lock of a run that is no longer running (pid {dead.pid}' in caplog.text
  assert os.listdir(tmp_path) == []  # Released: the lock file is gone.


def test_processes_racing_for_one_workdir_exactly_one_wins(tmp_path):
  go = tmp_path / 'go'
  workdir = tmp_path / 'workdir'
  code = """
while not os.path.exists(sys.argv[2]):
  time.sleep(0.001)
try:
  lock = files.WorkdirLock(sys.argv[1]).acquire()
except files.WorkdirLockedError as e:
  print('refused:', e, flush=True)
  sys.exit(0)
print('won', flush=True)
time.sleep(3)
lock.release()
"""
  racers = [_child(code, workdir, go) for _ in range(4)]
  time.sleep(1.0)  # All started and polling for the start signal.
  go.touch()
  outputs = [r.communicate(timeout=60)[0] for r in racers]
  winners = [r.pid for r, out in zip(racers, outputs, strict=True) if out.strip() == 'won']
  assert len(winners) == 1, outputs
  for r, out in zip(racers, outputs, strict=True):
    if r.pid != winners[0]:
      assert out.startswith(
        f'refused: workdir {workdir} is in use by another run (pid {winners[0]} on host'
      ), out


def test_the_same_process_takes_over_from_a_run_it_never_finished(tmp_path):
  earlier = files.WorkdirLock(str(tmp_path)).acquire()  # E.g. a failed run in a notebook.
  later = files.WorkdirLock(str(tmp_path)).acquire()
  assert not earlier.held and later.held
  refused = _child(
    """
try:
  files.WorkdirLock(sys.argv[1]).acquire()
except files.WorkdirLockedError as e:
  print(e)
""",
    tmp_path,
  )
  out, _ = refused.communicate(timeout=30)
  assert f'(pid {os.getpid()} on host' in out  # Other processes are still refused.
  later.release()
  later.release()  # Idempotent.


# --- a training run ---------------------------------------------------------------------------


def _smoke_config(data_dir, **overrides):
  from experiments.configs import default  # pylint: disable=g-import-not-at-top

  config = default.get_config('smoke')
  config.data_dir = data_dir
  config.update(overrides)
  return config


def test_a_run_into_a_workdir_in_use_is_refused_and_touches_nothing(data_dir, tmp_path):
  from jaxsgd import training  # pylint: disable=g-import-not-at-top

  (tmp_path / 'metrics.jsonl').write_text('{"step": 1}\n')  # The first run's records.
  first = _child(_HOLD, tmp_path)
  try:
    _wait_line(first, 'locked')
    with pytest.raises(files.WorkdirLockedError, match=f'pid {first.pid} on host'):
      training.train_and_evaluate(
        _smoke_config(data_dir, train_steps=4, eval_every=2), str(tmp_path), show_progress=False
      )
  finally:
    first.kill()
    first.wait()
  assert (tmp_path / 'metrics.jsonl').read_text() == '{"step": 1}\n'
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl', files.LOCK_NAME]


def test_a_finished_run_releases_its_workdir_and_writes_valid_json(data_dir, tmp_path):
  from jaxsgd import training  # pylint: disable=g-import-not-at-top

  config = _smoke_config(data_dir, train_steps=4, eval_every=2, target_accuracy=None)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert sorted(os.listdir(tmp_path)) == ['curves.png', 'metrics.jsonl', 'summary.json']
  summary = _strict_loads((tmp_path / 'summary.json').read_text())
  assert summary['final']['step'] == 4
  assert [r['step'] for r in files.read_json_lines(str(tmp_path / 'metrics.jsonl'))] == [2, 4]
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)  # Free again.


def test_a_file_system_without_locks_runs_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
  def no_locks(*_):
    raise OSError(37, 'No locks available')

  monkeypatch.setattr(files.fcntl, 'flock', no_locks)
  lock = files.WorkdirLock(str(tmp_path)).acquire()
  assert not lock.held and 'cannot lock run.lock ([Errno 37] No locks available)' in caplog.text
  lock.release()
