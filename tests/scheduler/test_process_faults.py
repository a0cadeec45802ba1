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

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone  # noqa: E402
from test_process_executor import _cluster, _probe  # noqa: E402

from jaxsgd.algorithms.settings import shared_settings  # noqa: E402
from jaxsgd.scheduler import Process  # noqa: E402
from jaxsgd.scheduler.lanes import LaneError, LanePlacement  # noqa: E402
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR  # noqa: E402
from jaxsgd.scheduler.process import ProcessExecutor  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every test here bounds how long a fault takes to end the run: run with nothing beside it.
pytestmark = pytest.mark.alone


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')), gone)


@pytest.fixture(autouse=True)
def no_driver_left():
  """Kills what a failed test left running (its driver and all it started), so that a
  failure here does not load the machine for the tests after it."""
  yield
  for driver in Driver.started:
    if driver.process.poll() is None:
      _kill([psutil.Process(driver.process.pid), *_family(driver.process.pid)])
  Driver.started.clear()


class Driver:
  """`python -m experiments.train` (`config`: ASGD smoke; lane processes) running in the
  background."""

  started: list['Driver'] = []

  def __init__(self, workdir, data_dir, *flags, env=None, config='asgd.py:smoke'):
    self.workdir = str(workdir)
    self.log_path = os.path.join(os.path.dirname(self.workdir), 'driver.log')
    self.log = open(self.log_path, 'w')
    command = [
      sys.executable,
      '-m',
      'experiments.train',
      f'--config=experiments/configs/{config}',
      f'--workdir={self.workdir}',
      f'--config.data_dir={data_dir}',
      '--config.clock=real',
      '--config.executor=processes',
      '--config.eval_every=20',
      *flags,
    ]
    self.process = subprocess.Popen(
      command,
      cwd=REPO,
      stdout=self.log,
      stderr=subprocess.STDOUT,
      # faulthandler: a run that does not end is made to print its threads' stacks.
      env={**os.environ, 'PYTHONFAULTHANDLER': '1', **(env or {})},
    )
    Driver.started.append(self)

  def output(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def wait_for_step(self, step: int, timeout: float = 240) -> None:
    """Until `metrics.jsonl` holds step `step` (the run is training)."""
    deadline = time.monotonic() + timeout
    path = os.path.join(self.workdir, 'metrics.jsonl')
    while time.monotonic() < deadline:
      assert self.process.poll() is None, self.output()[-3000:]
      if os.path.exists(path):
        with open(path) as f:
          if any(json.loads(line)['step'] >= step for line in f if line.strip()):
            return
      time.sleep(0.2)
    raise TimeoutError(f'step {step} not reached:\n{self.output()[-3000:]}')

  def lane_pid(self, lane: str) -> int:
    """The pid of `lane` from the placement printed at start (`  worker1: host=... pid=N`)."""
    for line in self.output().splitlines():
      if line.startswith(f'  {lane}: host='):
        return int(line.split(' pid=')[1].split()[0])
    raise AssertionError(f'no lane {lane} in the placement:\n{self.output()[-3000:]}')

  def finish(self, timeout: float = 300) -> tuple[int, str]:
    """The exit status and the last line of the output (after the progress bar). A run
    that has not ended within `timeout` s fails the test with its output and its threads'
    stacks (SIGABRT, which faulthandler answers), and is killed."""
    try:
      status = self.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      family = _family(self.process.pid)  # (once it is gone, its children cannot be found)
      self.process.send_signal(signal.SIGABRT)
      try:
        self.process.wait(timeout=20)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
      _kill(family)
      raise AssertionError(
        f'the run had not ended within {timeout} s:\n{self.output()[-12000:]}'
      ) from None
    self.log.close()
    lines = [line for line in self.output().replace('\r', '\n').splitlines() if line.strip()]
    return status, lines[-1]


def _kill(processes: list[psutil.Process]) -> None:
  for process in processes:
    try:
      process.kill()
    except psutil.NoSuchProcess:
      pass
  psutil.wait_procs(processes, timeout=10)


def _family(pid: int) -> list[psutil.Process]:
  try:
    return psutil.Process(pid).children(recursive=True)
  except psutil.NoSuchProcess:
    return []


def _descendants(pid: int) -> list[int]:
  return [p.pid for p in _family(pid)]


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['sigterm', 'ctrl-c'])
def test_a_signal_to_the_driver_ends_every_process_of_the_run(signum, data_dir, tmp_path):
  """SIGTERM (a checkpoint saved at the next drained point, exit 143, one line) or Ctrl-C
  (exit 130, one line, no traceback) while the run trains: the lane processes and the Ray
  cluster the run started (GCS, raylet, workers, agents) are all gone within 5 s."""
  driver = Driver(tmp_path / 'run', data_dir, '--config.workers=2', '--config.train_steps=100000')
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


def test_asgd_replaces_lost_workers_and_reports_them(head, data_dir, tmp_path):
  """`tolerate_lost_workers=True`, 3 workers: worker 1 SIGKILLed mid-run and worker 2
  whose 40th backward raises are each replaced by a new lane process, which rejoins:
  asks the server for the parameters and pushes again. Every step is applied; the summary
  lists every loss and replacement (which lane, when, why, when replaced); no lane
  process is left."""
  before = set(_lane_processes(head))
  driver = Driver(
    tmp_path / 'run',
    data_dir,
    '--config.workers=3',
    # Long enough after the losses for a new lane (a process started, its tasks compiled
    # or read from the cache) to push before the others have done every step.
    '--config.train_steps=1000',
    '--config.tolerate_lost_workers=True',
    f'--config.cluster_address={head.address}',
    env={FAULT_VAR: 'worker2:backward:40'},
  )
  driver.wait_for_step(20)
  killed_pid = driver.lane_pid('worker1')
  os.kill(killed_pid, signal.SIGKILL)
  status, last = driver.finish()
  assert status == 0, driver.output()[-3000:]
  with open(tmp_path / 'run' / 'summary.json') as f:
    summary = json.load(f)
  assert summary['final']['step'] == 1000
  lost = summary['lost_lanes']
  killed = [x for x in lost if x['lane'] == 'worker1']
  raised = [x for x in lost if x['lane'] == 'worker2']
  assert len(killed) == 1 and raised, lost
  assert re.match(r"lane 'worker1' on host \S+: pid \d+: its process died", killed[0]['reason'])
  assert re.match(
    r"lane 'worker2' on host \S+: Task\('backward' .* raised: RuntimeError: injected fault",
    raised[0]['reason'],
  )
  for loss in lost:
    assert 0 < loss['at'] <= loss['replaced_at'], loss
  assert killed[0]['processes'] == ['worker 1']
  assert summary['lost_workers'] == []  # none lost for good
  pushes = summary['pushes_per_worker']
  # The replacements pushed again: worker 1 after its kill at step ~20, worker 2 after
  # its 40th backward (the new lane counts its own backwards: it raises again at its
  # 40th, and is replaced again).
  assert pushes['worker 1'] > 20 and pushes['worker 2'] > 40, pushes
  assert sum(pushes.values()) >= 1000  # every step applied (pushes past the end dropped)
  assert gone(set(_lane_processes(head)) - before) == []


def test_pdasgd_replaces_lost_forward_and_backward_workers(head, data_dir, tmp_path):
  """PD-ASGD, `tolerate_lost_workers=True`, 2 forward and 2 backward workers, 4 layers:
  forward worker 0 SIGKILLed mid-run, and backward worker 1 killed in its 100th backward
  task (again in each new lane's 100th). Each is replaced and rejoins; every step is
  applied, and every layer was updated exactly once per step — none lost with a lane,
  none applied twice by a worker that sent its batch again; no lane process is left."""
  summary = _survives(
    head,
    data_dir,
    tmp_path,
    'pdasgd.py:smoke',
    'backwardworker1:backward:100:kill',
    'forwardworker0',
    '--config.algorithm.n_fwd=2',
  )
  lost = {x['lane'] for x in summary['lost_lanes']}
  assert lost == {'forwardworker0', 'backwardworker1'}, summary['lost_lanes']
  for loss in summary['lost_lanes']:
    assert 0 < loss['at'] <= loss['replaced_at'], loss
  assert [layer['updates'] for layer in summary['staleness'].values()] == [150] * 4


def test_lppsgd_replaces_lost_workers_and_heals_lost_replicas(head, data_dir, tmp_path):
  """LPP-SGD, `tolerate_lost_workers=True`, 3 replicas of 2 workers, each replica on a lane
  of its own: worker 0.0 SIGKILLed mid-run, and replica 1's lane killed in its 8th update
  (again in each new lane's 8th: the first loss comes before the first averaging round
  has ended, often while a worker is still connecting to the replica). The worker is
  replaced and rejoins; the replica is healed from a live peer (a worker whose task was
  taking in the lost replica's parameters fails and is replaced too). Every step is applied
  exactly once (the workers' updates add up to the steps), the replicas are still
  averaged, and no lane process is left."""
  summary = _survives(
    head, data_dir, tmp_path, 'lppsgd.py:smoke', 'replica1:update:8:kill', 'worker0.0'
  )
  lost = summary['lost_lanes']
  assert {'worker0.0', 'replica1'} <= {x['lane'] for x in lost}, lost
  # Every lane lost with a process on it is replaced; one lost once its worker had
  # stopped (every step taken; a task it had run ahead failed) has nothing to replace.
  assert all((x['replaced_at'] is not None) == bool(x['processes']) for x in lost), lost
  # Any other loss is a worker of replica 1 whose task was taking in the lost replica's
  # values (its reason names that lane, or, when the driver read a later task of it
  # first, that task's missing input).
  assert {x['lane'] for x in lost} <= {'worker0.0', 'replica1', 'worker1.0', 'worker1.1'}
  assert sum(worker['updates'] for worker in summary['staleness'].values()) == 150
  assert summary['averaging_rounds'] > 0


def _survives(head, data_dir, tmp_path, config, fault, killed, *flags) -> dict:
  """`config` for 150 steps with `tolerate_lost_workers` on the shared head, the lane
  fault `fault` injected and lane `killed` SIGKILLed at step 20: its summary, once it
  ended well with every step done and left no lane process."""
  before = set(_lane_processes(head))
  driver = Driver(
    tmp_path / 'run',
    data_dir,
    '--config.train_steps=150',
    '--config.tolerate_lost_workers=True',
    f'--config.cluster_address={head.address}',
    *flags,
    env={FAULT_VAR: fault},
    config=config,
  )
  driver.wait_for_step(20)
  os.kill(driver.lane_pid(killed), signal.SIGKILL)
  status, _ = driver.finish()
  assert status == 0, driver.output()[-3000:]
  assert gone(set(_lane_processes(head)) - before) == []
  with open(tmp_path / 'run' / 'summary.json') as f:
    summary = json.load(f)
  assert summary['final']['step'] == 150
  return summary


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
