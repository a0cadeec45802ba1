"""`python -m jaxsgd.launch`: several processes, one JAX cluster, nobody left behind.

Every subprocess runs with a timeout, and the launcher's own `--timeout_s`, so a
broken launcher fails the test instead of hanging it.
"""

import io
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from experiments.configs import dasgd as dasgd_config
from jaxsgd import data as data_lib
from jaxsgd import launch
from jaxsgd.training import checkpoints
from jaxsgd.training import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_launcher(*args, timeout=150):
  start = time.monotonic()
  proc = subprocess.run(
    [sys.executable, '-m', 'jaxsgd.launch', *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return proc, time.monotonic() - start


def _smoke_config(name, data_dir):
  config = dasgd_config.get_config(f'{name},smoke')
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.algorithm.save_params = True
  # Plain SGD: Adam would amplify the ~1 ulp differences of the cross-process sums.
  config.optimizer.name, config.optimizer.learning_rate = 'sgd', 0.05
  return config


@pytest.mark.slow  # ~15 s: two fresh Python processes import JAX, load data, compile.
def test_two_processes_of_two_devices_equal_one_process_of_four(data_dir, tmp_path):
  single = tmp_path / 'single'
  train_and_evaluate(_smoke_config('dasgd', data_dir), str(single), show_progress=False)
  multi = tmp_path / 'multi'
  proc, _ = run_launcher(
    '--processes',
    '2',
    '--devices_per_process',
    '2',
    '--timeout_s',
    '120',
    '--',
    '--config=experiments/configs/dasgd.py:dasgd,smoke',
    '--config.dataset=digits',
    f'--config.data_dir={data_dir}',
    '--config.model.name=mlp',
    '--config.optimizer.name=sgd',
    '--config.optimizer.learning_rate=0.05',
    '--config.algorithm.save_params=True',
    f'--workdir={multi}',
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert '[p0] final test accuracy' in out and '[p1] final test accuracy' in out
  summary = json.loads((multi / 'summary.json').read_text())
  assert summary['processes'] == 2 and summary['workers'] == 4
  a, b = np.load(single / 'params.npz'), np.load(multi / 'params.npz')
  assert sorted(a) == sorted(b)
  for key in a:  # gloo may sum across processes in another order: ~1 ulp per step.
    np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=5e-7, err_msg=key)
  ra = [json.loads(l) for l in open(single / 'metrics.jsonl')]
  rb = [json.loads(l) for l in open(multi / 'metrics.jsonl')]
  for x, y in zip(ra, rb, strict=True):
    assert x['step'] == y['step'] and x['samples'] == y['samples']
    assert y['test_loss'] == pytest.approx(x['test_loss'], rel=1e-5)
    assert y['train_loss'] == pytest.approx(x['train_loss'], rel=1e-5)
  # Only process 0 wrote to the workdir.
  assert {p.name for p in multi.iterdir()} == {
    'metrics.jsonl',
    'summary.json',
    'curves.png',
    'params.npz',
  }


_FAIL_ONE = """
import os, signal, sys, time
me = int(os.environ["JAXSGD_PROCESS_ID"])
print("hello from", me, "of", os.environ["JAXSGD_NUM_PROCESSES"], flush=True)
if me == 1:
    time.sleep(0.5)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Like JAX's handler: ignores SIGTERM.
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""

# Two processes all-reduce in a loop; at step 30, process `failing` waits 0.5 s (so
# that its peer is stuck in the next all-reduce, waiting for it) and then fails as
# `mode` says, after writing the time to `MARK.failed_at`.
_COLLECTIVE_WORKER = """
import itertools, os, signal, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mode, failing, mark = sys.argv[1], int(sys.argv[2]), sys.argv[3]
me = jax.process_index()
mesh = Mesh(np.array(jax.devices()), ('d',))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('d')), np.ones(1, np.float32))
assert float(total(x)) == jax.process_count() == 2
print('all-reducing', flush=True)
for step in itertools.count():
    total(x).block_until_ready()
    if me == failing and step == 30:
        time.sleep(0.5)
        with open(mark + '.failed_at', 'w') as f:
            f.write(repr(time.time()))
        if mode == 'raise':
            raise RuntimeError(f'boom at step {step}')
        if mode == 'exit':
            sys.exit(3)
        if mode == 'sigkill':
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.005)
"""


def _alive(pid):
  """Whether `pid` runs (a zombie whose parent is gone counts as dead)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f'/proc/{pid}/status') as f:
      return not any(line.startswith('State:') and 'Z' in line for line in f)
  except FileNotFoundError:
    return False


CONTRACT_S = 5.0  # The launcher ends the run within this long of a failure or a stop.


def _start_marked(tmp_path, *args):
  """Starts the launcher with a unique mark in its environment (see `_leftovers`)."""
  mark = str(tmp_path / f'mark-{uuid.uuid4().hex}')
  env = dict(
    os.environ, JAXSGD_TEST_MARK=mark, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)])
  )
  (tmp_path / 'collective_worker.py').write_text(_COLLECTIVE_WORKER)
  launcher = subprocess.Popen(
    [sys.executable, '-m', 'jaxsgd.launch', *args],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  return launcher, mark


def _start_collective(tmp_path, mode='none', failing=-1, *, processes=2, launcher_flags=()):
  """Starts `collective_worker` (`mode`: how process `failing` fails, 'none': never) on
  `processes` local processes, with `launcher_flags` added."""
  return _start_marked(
    tmp_path,
    *('--processes', str(processes), '--timeout_s', '100', *launcher_flags),
    *('--', '-m', 'collective_worker', mode, str(failing), str(tmp_path / 'run')),
  )


def _leftovers(mark: str) -> list[int]:
  """Running processes that inherited `mark` (the launcher's children and theirs)."""
  needle = f'JAXSGD_TEST_MARK={mark}\0'.encode()
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit() and int(entry) != os.getpid():
      try:
        with open(f'/proc/{entry}/environ', 'rb') as f:
          if needle in f.read() and _alive(int(entry)):
            found.append(int(entry))
      except OSError:  # Gone, or not ours.
        pass
  return found


def _communicate(launcher, timeout=120):
  """The launcher's output and the time it ended; a hang fails the test here."""
  try:
    out, err = launcher.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    launcher.kill()
    out, err = launcher.communicate()
    pytest.fail(f'the launcher hung:\n{out[-3000:]}\n{err[-3000:]}')
  return out, err, time.time()


@pytest.mark.alone  # bounds how long the launcher takes to end the run
@pytest.mark.slow  # Two fresh JAX processes, ~10-15 s on 2 busy cores.
@pytest.mark.parametrize(
  'mode, failing, status, line',
  [
    # In each case the peer is blocked in an all-reduce, waiting for the failing process.
    ('raise', 1, 1, 'process 1 failed (exit status 1): RuntimeError: boom at step 30'),
    ('raise', 0, 1, 'process 0 failed (exit status 1): RuntimeError: boom at step 30'),
    ('exit', 1, 3, 'process 1 failed (exit status 3): sys.exit(3)'),
    ('sigkill', 1, 137, 'process 1 was killed by SIGKILL (status 137)'),
  ],
)
def test_a_failing_process_ends_the_run_within_the_contract(tmp_path, mode, failing, status, line):
  launcher, mark = _start_collective(
    tmp_path, mode, failing, launcher_flags=('--devices_per_process', '1')
  )
  out, err, ended = _communicate(launcher)
  assert launcher.returncode == status, out[-3000:] + err
  assert err.strip().splitlines()[-1] == f'jaxsgd.launch: {line}; stopped the other 1 process.'
  assert '[p0] all-reducing' in out and '[p1] all-reducing' in out
  failed_at = float((tmp_path / 'run.failed_at').read_text())
  assert ended - failed_at < CONTRACT_S, f'the run ended {ended - failed_at:.1f} s after'
  assert not _leftovers(mark)


def _status_files(directory, records):
  """One status file per process: its `failed` record at `time` (None: no record)."""
  directory.mkdir()
  files = []
  for k, when in enumerate(records):
    path = directory / f'p{k}.jsonl'
    if when is not None:
      path.write_text(json.dumps({'event': 'failed', 'time': when, 'reason': f'p{k}'}) + '\n')
    files.append(str(path))
  return files


def test_the_process_that_recorded_its_failure_first_is_named_not_the_first_to_exit(tmp_path):
  """Process 1 exited first (its all-reduce failed when process 0's connection closed),
  but process 0 recorded its failure before: it is the cause, with its own status."""
  exits = queue.Queue()
  exits.put((0, 1))
  files = _status_files(tmp_path / 'a', [100.0, 100.2])
  assert launch._first_cause(1, 7, exits, files) == (0, 1)
  # The first to exit is kept when it recorded first, or recorded nothing (a signal).
  assert launch._first_cause(0, 1, queue.Queue(), files) == (0, 1)
  killed = _status_files(tmp_path / 'b', [100.0, None])
  assert launch._first_cause(1, -9, exits, killed) == (1, -9)


def _wait_for(launcher, text, timeout=60):
  """Reads the launcher's stdout until `text` appears (both processes running)."""
  deadline, seen = time.monotonic() + timeout, ''
  while text not in seen:
    assert time.monotonic() < deadline and launcher.poll() is None, seen[-3000:]
    seen += launcher.stdout.readline()
  return seen


@pytest.mark.alone  # bounds how long the launcher takes to end the run
@pytest.mark.slow  # Two fresh JAX processes, ~10-15 s on 2 busy cores.
@pytest.mark.parametrize('sig, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopping_the_launcher_ends_a_jax_run_within_the_contract(tmp_path, sig, status):
  launcher, mark = _start_collective(tmp_path, launcher_flags=('--devices_per_process', '1'))
  _wait_for(launcher, '[p1] all-reducing')
  sent = time.time()
  launcher.send_signal(sig)
  _, err, ended = _communicate(launcher)
  assert launcher.returncode == status
  assert err.strip().splitlines()[-1] == (
    f'jaxsgd.launch: stopped by {sig.name}; stopped all 2 processes.'
  )
  assert ended - sent < CONTRACT_S, f'the run ended {ended - sent:.1f} s after {sig.name}'
  assert not _leftovers(mark)


@pytest.mark.alone  # bounds how long the launcher takes to end the run
@pytest.mark.slow  # Two fresh JAX processes, ~10-15 s on 2 busy cores.
def test_a_stopped_process_ends_the_run_after_the_heartbeat_timeout(tmp_path):
  heartbeat_s = 2
  launcher, mark = _start_collective(
    tmp_path,
    launcher_flags=('--devices_per_process', '1', '--heartbeat_timeout_s', str(heartbeat_s)),
  )
  _wait_for(launcher, '[p1] all-reducing')
  p1 = next(
    pid
    for pid in _leftovers(mark)
    if _environ(pid).get('JAXSGD_PROCESS_ID') == '1' and pid != launcher.pid
  )
  stopped = time.time()
  os.kill(p1, signal.SIGSTOP)  # Frozen: alive, but silent. Only heartbeats can tell.
  _, err, ended = _communicate(launcher)
  assert launcher.returncode != 0
  assert (
    err.strip()
    .splitlines()[-1]
    .endswith(
      f', after process 1 was stopped (SIGSTOP or a debugger) for longer than the heartbeat '
      f'timeout ({heartbeat_s} s); stopped the other 1 process.'
    )
  ), err
  assert ended - stopped < heartbeat_s + CONTRACT_S
  assert not _leftovers(mark)


def _environ(pid: int) -> dict[str, str]:
  with open(f'/proc/{pid}/environ', 'rb') as f:
    return dict(
      item.decode(errors='replace').partition('=')[::2] for item in f.read().split(b'\0') if item
    )


@pytest.mark.slow  # Two fresh JAX processes, ~10-15 s on 2 busy cores.
def test_a_cluster_that_never_forms_is_a_clear_error(tmp_path):
  # Process 0 starts here; process 1 of 2 is never started anywhere.
  launcher, mark = _start_collective(
    tmp_path,
    processes=1,
    launcher_flags=('--num_processes', '2', '--init_timeout_s', '2'),
  )
  out, err, _ = _communicate(launcher)
  assert launcher.returncode == 1, out + err
  assert err.startswith(
    'jaxsgd.launch: process 0 failed (exit status 1): the cluster did not '
    'form within 2 s: process 0 waited at 127.0.0.1:'
  ), err
  assert 'this launcher starts processes 0..0 of 2' in err
  assert '[p0] error: the cluster did not form within 2 s' in out
  assert 'Check failure' not in out  # No C++ abort.
  assert not _leftovers(mark)


@pytest.mark.alone  # bounds how long the launcher takes to end the run
def test_a_failing_process_stops_the_others(tmp_path):
  pid_file = tmp_path / 'pid'
  proc, elapsed = run_launcher(
    '--processes',
    '2',
    '--timeout_s',
    '30',
    '--',
    'python',
    '-c',
    _FAIL_ONE,
    str(pid_file),
    timeout=40,
  )
  assert proc.returncode == 3, proc.stdout
  assert elapsed < 15
  assert '[p0] hello from 0 of 2' in proc.stdout and '[p1] hello from 1 of 2' in proc.stdout
  assert proc.stderr == (
    'jaxsgd.launch: process 1 failed (exit status 3); stopped the other 1 process.\n'
  )
  assert not _alive(int(pid_file.read_text()))  # SIGKILLed: it ignores SIGTERM.


def test_a_command_that_cannot_start_is_one_line(tmp_path):
  proc, _ = run_launcher('--processes', '2', '--', str(tmp_path / 'missing'), timeout=30)
  assert proc.returncode == 127
  assert proc.stderr == (
    f"jaxsgd.launch: cannot start '{tmp_path / 'missing'}': No such file or directory.\n"
  )


@pytest.mark.alone  # bounds how long the launcher takes to end the run
def test_launcher_timeout_kills_everything():
  proc, elapsed = run_launcher(
    '--processes',
    '2',
    '--grace_s',
    '0.5',
    '--timeout_s',
    '1',
    '--',
    'python',
    '-c',
    'import time; time.sleep(60)',
    timeout=30,
  )
  assert proc.returncode == 124 and elapsed < 10
  assert 'timed out after 1 s' in proc.stderr


def test_sigterm_to_the_launcher_stops_the_children(tmp_path):
  launcher, pids = _start_sleepers(tmp_path / 'pid', '--grace_s', '1')
  try:
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=15) == 143
    assert not any(_alive(p) for p in pids)
  finally:
    if launcher.poll() is None:
      launcher.kill()


def _start_sleepers(pid_file, *extra):
  script = (
    'import os, sys, time; open(sys.argv[1] + os.environ["JAXSGD_PROCESS_ID"], "w")'
    '.write(str(os.getpid())); time.sleep(60)'
  )
  launcher = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'jaxsgd.launch',
      '--processes',
      '2',
      *extra,
      '--',
      'python',
      '-c',
      script,
      str(pid_file),
    ],
    cwd=REPO,
    # The launcher's status folder in the test's own (a launcher killed by SIGKILL cannot
    # remove it).
    env={**os.environ, 'TMPDIR': str(pid_file.parent)},
    stdout=subprocess.DEVNULL,
    stderr=subprocess.STDOUT,
  )
  files = [pathlib.Path(f'{pid_file}{k}') for k in range(2)]
  deadline = time.monotonic() + 20
  while not all(f.exists() and f.read_text() for f in files):
    assert time.monotonic() < deadline, 'children did not start'
    time.sleep(0.05)
  return launcher, [int(f.read_text()) for f in files]


@pytest.mark.alone  # bounds how long the children take to end (5 s)
def test_sigkill_to_the_launcher_kills_the_children(tmp_path):
  launcher, pids = _start_sleepers(tmp_path / 'pid')
  launcher.kill()
  launcher.wait(timeout=10)
  deadline = time.monotonic() + 5
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_alive(p) for p in pids)


@pytest.mark.alone  # bounds how long the launcher takes to end the run
def test_unreachable_coordinator_is_a_clear_error(tmp_path):
  port = launch.free_port()  # Nobody listens there.
  proc, elapsed = run_launcher(
    '--processes',
    '1',
    '--num_processes',
    '2',
    '--first_process_id',
    '1',
    '--coordinator',
    f'127.0.0.1:{port}',
    '--init_timeout_s',
    '1',
    '--timeout_s',
    '60',
    '--',
    '--config=experiments/configs/dasgd.py:smoke',
    f'--workdir={tmp_path}',
    timeout=90,
  )
  assert proc.returncode == 1
  assert (
    f'coordinator (JAXSGD_COORDINATOR_ADDRESS / jaxsgd.launch --coordinator): cannot '
    f'reach 127.0.0.1:{port} within 1 s' in proc.stdout
  )
  assert proc.stderr.startswith(
    'jaxsgd.launch: process 1 failed (exit status 1): coordinator (JAXSGD_COORDINATOR_ADDRESS'
  )
  assert elapsed < 30


def test_child_command_and_environment():
  py = sys.executable
  bootstrap = [py, '-u', '-m', 'jaxsgd.spmd.bootstrap']
  train = bootstrap + ['experiments.train', '--config=c.py']
  assert launch.child_command(['--config=c.py']) == train
  assert launch.child_command(['-m', 'pkg.mod', '-x']) == bootstrap + ['pkg.mod', '-x']
  assert launch.child_command(['python', 'a.py']) == [py, 'a.py']
  # What users type (and earlier docs showed): a module joined to the cluster first.
  assert launch.child_command(['python', '-m', 'experiments.train', '--config=c.py']) == train
  args, _ = launch.parse_args(['--processes', '2', '--devices_per_process', '3', '--', '-x'])
  env = launch.child_env(args, 1, '127.0.0.1:5')
  assert env['XLA_FLAGS'].count('--xla_force_host_platform_device_count=') == 1
  assert '--xla_force_host_platform_device_count=3' in env['XLA_FLAGS']
  assert (env['JAXSGD_PROCESS_ID'], env['JAXSGD_NUM_PROCESSES']) == ('1', '2')


@pytest.mark.parametrize(
  'argv, match',
  [
    (['--processes', '2'], 'the "--" is required'),
    (['--processes', '0', '--', '-x'], '--processes: must be >= 1'),
    (['--processes', '100000', '--', '-x'], "do not fit in this machine's memory"),
    (['--processes', '2', '--first_process_id', '1', '--', '-x'], '--first_process_id'),
    (
      ['--processes', '1', '--num_processes', '2', '--first_process_id', '1', '--', '-x'],
      '--coordinator: needed',
    ),
  ],
)
def test_bad_launcher_arguments(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.parse_args(argv)
  assert exit_info.value.code != 0
  assert match in capsys.readouterr().err + str(exit_info.value.code)


class _Chunks:
  """A pipe that delivers `data` `size` bytes at a time."""

  def __init__(self, data, size):
    self._chunks = [data[i : i + size] for i in range(0, len(data), size)]

  def read1(self, _):
    return self._chunks.pop(0) if self._chunks else b''

  def close(self):
    pass


@pytest.mark.parametrize('size', [1, 3, 1000])
def test_output_is_prefixed_and_progress_redraws_are_thinned(size):
  data = b'hello\nbar 1\rbar 2\r   \rbar 3\rbar final\nno newline'
  out = io.StringIO()
  launch._forward(_Chunks(data, size), '[p1] ', threading.Lock(), out, progress_every_s=1e9)
  assert out.getvalue() == '[p1] hello\n[p1] bar 1\n[p1] bar final\n[p1] no newline\n'


def _pid_of_process(mark: str, process_id: int) -> int | None:
  """The pid of the launched process `process_id` (by its environment), if it runs."""
  needles = (f'JAXSGD_TEST_MARK={mark}\0'.encode(), f'JAXSGD_PROCESS_ID={process_id}\0'.encode())
  for pid in _leftovers(mark):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        environ = f.read()
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        command = f.read()
    except OSError:
      continue
    if all(n in environ for n in needles) and b'jaxsgd.spmd.bootstrap' in command:
      return pid
  return None


@pytest.mark.alone  # bounds how long the run takes to save and end (30 s)
def test_sigterm_to_one_process_of_a_launch_saves_at_an_agreed_step_and_ends_the_run(
  data_dir, tmp_path
):
  """SIGTERM to process 1 only (not the launcher) while 2 processes train DaSGD: the
  processes agree on a step (the cluster's key-value store), both save it — no process
  waits in orbax's barrier while its peer waits in a collective — and the run ends with
  143 within seconds; the checkpoint is whole and the same command resumes from it."""
  data_lib.load('digits', data_dir)  # prepared once here, not by both processes at once
  workdir = tmp_path / 'run'
  flags = (
    '--processes',
    '2',
    '--devices_per_process',
    '2',
    '--timeout_s',
    '200',
    '--',
    '--config=experiments/configs/dasgd.py:dasgd,smoke',
    '--config.dataset=digits',
    f'--config.data_dir={data_dir}',
    '--config.model.name=mlp',
    '--config.train_steps=100000',
    f'--workdir={workdir}',
  )
  launcher, mark = _start_marked(tmp_path, *flags)
  try:
    deadline = time.monotonic() + 90
    while not (workdir / 'metrics.jsonl').exists():  # training has started
      assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
      time.sleep(0.2)
    time.sleep(2.0)
    pid = _pid_of_process(mark, 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    signalled = time.monotonic()
    out, err = launcher.communicate(timeout=60)
    assert time.monotonic() - signalled < 30, err[-2000:]
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode == 143, err[-3000:]
  assert 'SIGTERM: stopped after saving the checkpoint of step' in out + err
  meta = checkpoints.latest_meta(str(workdir))
  assert meta is not None and meta['step'] > 0
  assert _leftovers(mark) == []
