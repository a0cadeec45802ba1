"""Lost lanes replaced while a training run goes on (`--config.tolerate_lost_workers`):
the real binary on lane processes of the shared `ray start --head` node, a worker killed
with SIGKILL or a task that raises mid-run; the run ends well with every step applied
and no lane process left. How long a fault takes to end a run is bounded in
`test_process_faults.py`; nothing here bounds a time, so these run beside other tests
(a replaced lane still has to start and push before the run's last step: their runs
are long for that)."""

import json
import os
import re
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone  # noqa: E402
from train_driver import Driver, no_driver_left  # noqa: E402, F401 (a fixture)

from jaxsgd.scheduler.lanes.runtime import FAULT_VAR  # noqa: E402


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.mark.slow
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
  assert summary['driver_cpu_ms_per_task'] > 0  # (`executor_summary`)
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


@pytest.mark.slow
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
