"""`python -m jaxsgd.launch`: several processes, one JAX cluster, nobody left behind.

Every subprocess runs with a timeout, and the launcher's own `--timeout_s`, so a
broken launcher fails the test instead of hanging it.
"""

import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from experiments.configs import dasgd as dasgd_config
from jaxsgd import launch
from jaxsgd.training import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_launcher(*args, timeout=150):
  start = time.monotonic()
  proc = subprocess.run([sys.executable, '-m', 'jaxsgd.launch', *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)
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
      '--processes', '2', '--devices_per_process', '2', '--timeout_s', '120', '--',
      '--config=experiments/configs/dasgd.py:dasgd,smoke', '--config.dataset=digits',
      f'--config.data_dir={data_dir}', '--config.model.name=mlp',
      '--config.optimizer.name=sgd', '--config.optimizer.learning_rate=0.05',
      '--config.algorithm.save_params=True', f'--workdir={multi}')
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
  assert {p.name for p in multi.iterdir()} == {'metrics.jsonl', 'summary.json',
                                               'curves.png', 'params.npz'}


_FAIL_ONE = '''
import os, signal, sys, time
me = int(os.environ["JAXSGD_PROCESS_ID"])
print("hello from", me, "of", os.environ["JAXSGD_NUM_PROCESSES"], flush=True)
if me == 1:
    time.sleep(0.5)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Like JAX's handler: ignores SIGTERM.
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
'''


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


def test_a_failing_process_stops_the_others(tmp_path):
  pid_file = tmp_path / 'pid'
  proc, elapsed = run_launcher('--processes', '2', '--grace_s', '1', '--timeout_s', '30',
                               '--', 'python', '-c', _FAIL_ONE, str(pid_file), timeout=40)
  assert proc.returncode == 3, proc.stdout
  assert elapsed < 15
  assert '[p0] hello from 0 of 2' in proc.stdout and '[p1] hello from 1 of 2' in proc.stdout
  assert 'process 1 exited with status 3' in proc.stdout
  assert not _alive(int(pid_file.read_text()))  # SIGKILLed after the grace period.


def test_launcher_timeout_kills_everything():
  proc, elapsed = run_launcher('--processes', '2', '--grace_s', '0.5', '--timeout_s', '1',
                               '--', 'python', '-c', 'import time; time.sleep(60)',
                               timeout=30)
  assert proc.returncode == 124 and elapsed < 10
  assert 'timed out' in proc.stdout


def test_sigterm_to_the_launcher_stops_the_children(tmp_path):
  launcher, pids = _start_sleepers(tmp_path / 'pid', '--grace_s', '1')
  try:
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=15) != 0
    assert not any(_alive(p) for p in pids)
  finally:
    if launcher.poll() is None:
      launcher.kill()


def _start_sleepers(pid_file, *extra):
  script = ('import os, sys, time; open(sys.argv[1] + os.environ["JAXSGD_PROCESS_ID"], "w")'
            '.write(str(os.getpid())); time.sleep(60)')
  launcher = subprocess.Popen([sys.executable, '-m', 'jaxsgd.launch', '--processes', '2',
                               *extra, '--', 'python', '-c', script, str(pid_file)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  files = [pathlib.Path(f'{pid_file}{k}') for k in range(2)]
  deadline = time.monotonic() + 20
  while not all(f.exists() and f.read_text() for f in files):
    assert time.monotonic() < deadline, 'children did not start'
    time.sleep(0.05)
  return launcher, [int(f.read_text()) for f in files]


def test_sigkill_to_the_launcher_kills_the_children(tmp_path):
  launcher, pids = _start_sleepers(tmp_path / 'pid')
  launcher.kill()
  launcher.wait(timeout=10)
  deadline = time.monotonic() + 5
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_alive(p) for p in pids)


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
  port = launch.free_port()  # Nobody listens there.
  proc, elapsed = run_launcher(
      '--processes', '1', '--num_processes', '2', '--first_process_id', '1',
      '--coordinator', f'127.0.0.1:{port}', '--init_timeout_s', '1', '--timeout_s', '60',
      '--', '--config=experiments/configs/dasgd.py:smoke', f'--workdir={tmp_path}', timeout=90)
  assert proc.returncode != 0
  assert f'coordinator (JAXSGD_COORDINATOR_ADDRESS / jaxsgd.launch --coordinator): cannot ' \
         f'reach 127.0.0.1:{port} within 1 s' in proc.stdout
  assert elapsed < 30


def test_child_command_and_environment():
  py = sys.executable
  assert launch.child_command(['--config=c.py']) == [
      py, '-u', '-m', 'jaxsgd.spmd.bootstrap', 'experiments.train', '--config=c.py']
  assert launch.child_command(['-m', 'pkg.mod', '-x']) == [
      py, '-u', '-m', 'jaxsgd.spmd.bootstrap', 'pkg.mod', '-x']
  assert launch.child_command(['python', 'a.py']) == [py, 'a.py']
  args, _ = launch.parse_args(['--processes', '2', '--devices_per_process', '3', '--', '-x'])
  env = launch.child_env(args, 1, '127.0.0.1:5')
  assert env['XLA_FLAGS'].count('--xla_force_host_platform_device_count=') == 1
  assert '--xla_force_host_platform_device_count=3' in env['XLA_FLAGS']
  assert (env['JAXSGD_PROCESS_ID'], env['JAXSGD_NUM_PROCESSES']) == ('1', '2')


@pytest.mark.parametrize('argv, match', [
    (['--processes', '2'], 'the "--" is required'),
    (['--processes', '0', '--', '-x'], '--processes: must be >= 1'),
    (['--processes', '2', '--first_process_id', '1', '--', '-x'], '--first_process_id'),
    (['--processes', '1', '--num_processes', '2', '--first_process_id', '1', '--', '-x'],
     '--coordinator: needed'),
])
def test_bad_launcher_arguments(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.parse_args(argv)
  assert exit_info.value.code != 0
  assert match in capsys.readouterr().err + str(exit_info.value.code)


class _Chunks:
  """A pipe that delivers `data` `size` bytes at a time."""

  def __init__(self, data, size):
    self._chunks = [data[i:i + size] for i in range(0, len(data), size)]

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
