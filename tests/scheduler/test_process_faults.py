"""Faults and signals of training runs on lane processes (`--config.executor=processes`).

Each test runs the real binary, `python -m experiments.train`, as a process of its own
(ASGD: a server and workers, each a lane process), does something to it while it
trains — SIGTERM, Ctrl-C, a lane killed with SIGKILL, a task that raises — and then
counts the processes of the run that are left: none may be.

The signal tests let the run start its own Ray cluster (as a run on one machine does),
so the count covers Ray's own processes too (GCS, raylet, workers, agents); the others
join the shared `ray start --head` node (`tests/lanes/ray_head.py`) and count its lane
processes. One test drives `ProcessExecutor` itself: a lane killed in the middle of a
task ends the run within 5 s.
"""

import os
import re
import signal
import sys
import threading
import time

import psutil
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone  # noqa: E402
from test_process_executor import _cluster, _probe  # noqa: E402
from train_driver import Driver, _descendants, no_driver_left  # noqa: E402, F401 (a fixture)

from jaxsgd.algorithms.settings import shared_settings  # noqa: E402
from jaxsgd.scheduler import Process  # noqa: E402
from jaxsgd.scheduler.lanes import LaneError, LanePlacement  # noqa: E402
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR  # noqa: E402
from jaxsgd.scheduler.process import ProcessExecutor  # noqa: E402

# Every test here bounds how long a fault takes to end the run: run with nothing beside it.
pytestmark = pytest.mark.alone


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['sigterm', 'ctrl-c'])
def test_a_signal_to_the_driver_ends_every_process_of_the_run(signum, data_dir, tmp_path):
  """SIGTERM (a checkpoint saved at the next drained point, exit 143, one line) or Ctrl-C
  (exit 130, one line, no traceback) while the run trains: the lane processes and the Ray
  cluster the run started (GCS, raylet, workers, agents) are all gone within 5 s. The run
  starts its cluster with Ray's default authentication (a token), as a user's does: the
  tests' own clusters run without (conftest.py)."""
  driver = Driver(
    tmp_path / 'run',
    data_dir,
    '--config.workers=2',
    '--config.train_steps=100000',
    env={'RAY_AUTH_MODE': None},
  )
  driver.wait_for_step(20)
  started = _descendants(driver.process.pid)
  lanes = [driver.lane_pid(lane) for lane in ('server', 'worker0', 'worker1')]
  assert set(lanes) <= set(started) and len(started) > len(lanes)  # Ray's own too
  driver.process.send_signal(signum)
  left = gone(started, within=5)  # counted from the signal
  status, last = driver.finish(timeout=60)
  assert left == [], [(pid, psutil.Process(pid).name()) for pid in gone(left, within=0)]
  if signum == signal.SIGTERM:
    assert status == 143, last
    assert last.startswith('error: SIGTERM: stopped after saving the checkpoint of step '), last
    assert last.endswith('run again with the same config and workdir to resume.'), last
  else:
    assert status == 130, last
    assert last.startswith('error: Ctrl-C: stopped at once'), last


@pytest.mark.parametrize('fault', ['raise', 'kill'])
def test_a_lost_lane_ends_a_training_run_naming_it(fault, head, data_dir, tmp_path):
  """Without `tolerate_lost_workers`, a worker's task that raises or its process killed
  with SIGKILL ends the run within 5 s (exit 1) with one line naming the lane and its
  host; no lane process is left."""
  before = set(_lane_processes(head))
  hook = {FAULT_VAR: 'worker1:backward:30'} if fault == 'raise' else {}
  driver = Driver(
    tmp_path / 'run',
    data_dir,
    '--config.workers=2',
    '--config.train_steps=100000',
    f'--config.cluster_address={head.address}',
    env=hook,
  )
  if fault == 'kill':
    driver.wait_for_step(20)
    killed = time.monotonic()
    os.kill(driver.lane_pid('worker1'), signal.SIGKILL)
  status, last = driver.finish(timeout=240)
  if fault == 'kill':
    assert time.monotonic() - killed < 5
  host = r"lane 'worker1' on host \d+\.\d+\.\d+\.\d+: "
  what = (
    r"Task\('backward' .* raised: RuntimeError: injected fault"
    if fault == 'raise'
    else r'pid \d+: its process died'
  )
  assert status == 1, last
  assert re.match(rf'error: LaneError: {host}{what}', last), last
  assert gone(set(_lane_processes(head)) - before) == []


def test_a_killed_lane_ends_the_run_within_5s_and_no_process_is_left(head):
  executor = ProcessExecutor(
    LanePlacement.spread(['stage0', 'stage1']), address=head.address, verbose=False
  )
  processes = [
    Process('stage 0', 0, _probe('hang', 60.0)),
    Process('stage 1', 1, _probe('hang', 60.0)),
  ]
  killed = {}

  def kill_when_started():
    while executor.pool is None or not getattr(executor, '_pending', None):
      time.sleep(0.05)
    pids = executor.pool.pids()
    killed.update(pids=list(pids.values()), host=executor.pool.info['stage1']['host'])
    time.sleep(0.5)
    killed['at'] = time.monotonic()
    os.kill(pids['stage1'], signal.SIGKILL)

  threading.Thread(target=kill_when_started, daemon=True).start()
  with pytest.raises(LaneError, match=r"lane 'stage1' on host .*process died") as error:
    executor.run(_cluster('stage 0', 'stage 1'), processes)
  assert time.monotonic() - killed['at'] < 5
  assert error.value.host == killed['host']
  assert executor.pool is None  # closed on the way out
  assert gone(killed['pids']) == []  # the hanging lane too


def test_tolerate_lost_workers_is_checked_before_anything_starts():
  from experiments.configs import asgd, ddg

  config = asgd.get_config()
  config.tolerate_lost_workers = True
  with pytest.raises(ValueError, match=r"tolerate_lost_workers: needs executor='processes'"):
    shared_settings(config)
  config.clock, config.executor = 'real', 'processes'
  assert shared_settings(config).tolerate_lost_workers
  del config['tolerate_lost_workers']  # a config built in Python may hold any type
  config.tolerate_lost_workers = 'yes'
  with pytest.raises(ValueError, match=r"^tolerate_lost_workers: True or False, got 'yes'\.$"):
    shared_settings(config)
  config = ddg.get_config()
  config.clock, config.executor, config.tolerate_lost_workers = 'real', 'processes', True
  with pytest.raises(ValueError, match=r'tolerate_lost_workers: ddg cannot go on without a lost'):
    shared_settings(config)
