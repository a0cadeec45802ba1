"""The watcher that ends a cluster started by a run when the run's driver ends
(`jaxsgd/scheduler/lanes/reaper.py`): by hand on a made-up /proc, with a stand-in driver
and cluster, and with the real binary and Ray's own processes."""

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'scheduler'))
from test_lanes import gone  # noqa: E402
from train_driver import Driver, _descendants, no_driver_left  # noqa: E402, F401 (a fixture)

from jaxsgd.scheduler.lanes import reaper  # noqa: E402


def _fake_process(proc, pid: int, parent: int, command: str, state='S', files=()) -> None:
  folder = proc / str(pid)
  (folder / 'fd').mkdir(parents=True)
  (folder / 'cmdline').write_bytes(command.replace(' ', '\0').encode() + b'\0')
  # A name with a space and parentheses, as a process that rewrote its title may have.
  (folder / 'stat').write_bytes(f'{pid} (a (b) c) {state} {parent} 1 1 0 -1'.encode())
  for number, path in enumerate(['/dev/null', *files]):
    (folder / 'fd' / str(number)).symlink_to(path)


def test_the_cluster_is_every_process_naming_its_directory_or_holding_its_files(tmp_path):
  """Worked out by hand. Of the cluster in /tmp/jaxsgd-ray-abc: 10 names the directory,
  11 is its child and 12 its grandchild (neither names it); 16 is an agent whose raylet
  is gone (its parent is 1, its title rewritten), holding a log of the directory, removed
  since. Not of it: 13 has ended (a zombie), 14 and 15 are another cluster's, 17 holds a
  file of a directory whose name starts as the cluster's does, 18 names that one."""
  proc = tmp_path / 'proc'
  (proc / 'self').mkdir(parents=True)  # not a process
  abc = '/tmp/jaxsgd-ray-abc'
  _fake_process(proc, 10, 1, f'gcs_server --temp_dir={abc}')
  _fake_process(proc, 11, 10, 'ray::IDLE')
  _fake_process(proc, 12, 11, 'jaxsgd::LaneRuntime stage0 (forked)')
  _fake_process(proc, 13, 10, '', state='Z')
  _fake_process(proc, 14, 1, 'raylet --session_dir=/tmp/jaxsgd-ray-xyz/session_1')
  _fake_process(proc, 15, 14, 'ray::IDLE')
  _fake_process(proc, 16, 1, 'ray::DashboardAgent', files=[f'{abc}/s/agent.log (deleted)'])
  _fake_process(proc, 17, 1, 'tail', files=[f'{abc}2/s/agent.log'])
  _fake_process(proc, 18, 1, f'ls {abc}2')
  assert reaper.cluster_pids(abc, proc=str(proc)) == {10, 11, 12, 16}
  assert reaper.cluster_pids('/tmp/jaxsgd-ray-xyz/', proc=str(proc)) == {14, 15}
  assert reaper.cluster_pids('/tmp/jaxsgd-ray-none', proc=str(proc)) == set()


# A stand-in driver: it starts the watcher of `folder`, then a stand-in cluster process
# that names the folder and has a child of its own that does not, each in a session of
# its own (nothing that ends the driver reaches them), prints their pids and waits.
_DRIVER = textwrap.dedent(
  """
  import subprocess, sys, time
  from jaxsgd.scheduler.lanes import reaper
  folder = sys.argv[1]
  watcher = reaper.watch(folder)
  sleeper = (
    'import subprocess, sys, time; '
    'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], '
    'start_new_session=True); time.sleep(300)'
  )
  cluster = subprocess.Popen(
    [sys.executable, '-c', sleeper, folder], start_new_session=True
  )
  import psutil
  deadline = time.monotonic() + 60
  while not psutil.Process(cluster.pid).children() and time.monotonic() < deadline:
    time.sleep(0.05)  # until its child started
  pids = [cluster.pid] + [c.pid for c in psutil.Process(cluster.pid).children()]
  print(watcher.pid, *pids, flush=True)
  if sys.argv[2] == 'release':
    reaper.release(watcher)
    print('released', flush=True)
  time.sleep(300)
  """
)


def _start_driver(folder, how: str):
  driver = subprocess.Popen(
    [sys.executable, '-c', _DRIVER, str(folder), how], stdout=subprocess.PIPE, text=True
  )
  watcher, *cluster = map(int, driver.stdout.readline().split())
  assert len(cluster) == 2, cluster  # the stand-in cluster process and its child
  return driver, watcher, cluster


def test_a_driver_killed_with_sigkill_takes_its_cluster_and_directory_with_it(tmp_path):
  folder = tmp_path / 'jaxsgd-ray-test'
  (folder / 'logs').mkdir(parents=True)
  driver, watcher, cluster = _start_driver(folder, 'kill')
  try:
    assert gone(cluster, within=0) == cluster  # running while the driver lives
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # (10 s: this runs beside other tests; left alone, the agents outlived the driver)
    assert gone([watcher, *cluster], within=10) == []
    assert not folder.exists()
  finally:
    for pid in gone([watcher, *cluster], within=0):
      os.kill(pid, signal.SIGKILL)


def test_a_released_watcher_ends_at_once_and_kills_nothing(tmp_path):
  """`release` (what `cluster.shutdown` calls once it stopped the cluster itself): the
  watcher ends, and what it would have killed lives on (here, the stand-in cluster)."""
  folder = tmp_path / 'jaxsgd-ray-test'
  folder.mkdir()
  driver, watcher, cluster = _start_driver(folder, 'release')
  try:
    assert driver.stdout.readline().strip() == 'released'
    assert gone([watcher], within=0) == []  # `release` waited for it
    assert gone(cluster, within=0) == cluster
    assert folder.exists()
  finally:
    driver.kill()
    driver.wait()
    for pid in gone(cluster, within=0):
      os.kill(pid, signal.SIGKILL)


def _command(pid: int) -> list[str]:
  try:
    return psutil.Process(pid).cmdline()
  except psutil.Error:  # ended meanwhile
    return []


def test_a_driver_killed_with_sigkill_leaves_no_process_of_its_cluster(data_dir, tmp_path):
  """SIGKILL runs none of the driver's own clean-up: the watcher it started with its
  cluster (`lanes/reaper.py`) ends every process of the run within 10 s (Ray's agents,
  whose raylet died with the driver, outlived it before) and removes the cluster's
  directory of logs."""
  clusters = os.path.join(tempfile.gettempdir(), 'jaxsgd-ray-*')
  before = set(glob.glob(clusters))
  driver = Driver(tmp_path / 'run', data_dir, '--config.train_steps=100000')
  driver.wait_for_step(20)
  started = _descendants(driver.process.pid)
  names = {psutil.Process(pid).name() for pid in started}
  assert {'raylet', 'ray::DashboardAgent', 'ray::RuntimeEnvAgent'} <= names, names
  # The run's own cluster: the new directory its processes name (a test beside this one
  # may start a cluster of its own meanwhile).
  commands = ' '.join(' '.join(_command(pid)) for pid in started)
  new = {folder for folder in set(glob.glob(clusters)) - before if folder in commands}
  assert len(new) == 1, new
  driver.process.send_signal(signal.SIGKILL)
  left = gone(started, within=10)  # from the signal (beside other tests: not `alone`)
  status, _ = driver.finish(timeout=60)
  assert status == -signal.SIGKILL
  assert left == [], [(pid, psutil.Process(pid).name()) for pid in gone(left, within=0)]
  assert not any(os.path.exists(folder) for folder in new), new
