"""Exact resume of the scheduler families on the virtual clock, and of the stage-per-lane
families on the in-process real clock from a drained point.

A run interrupted at a step where tasks and messages are in flight (a crash at step k,
or SIGTERM) and started again on its workdir ends with the same `metrics.jsonl` (wall
times aside: simulated times included), the same final state bit for bit (every array
of the last checkpoint: stores, optimizer states, messages, residuals) and the same
timeline (`trace.json`) as the uninterrupted run. On the real clock the checkpoint is
taken once the devices finished what was dispatched (messages and stored forwards are
still in flight between the stages); all but the wall times is the same.
"""

import json
import os
import signal
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest

from experiments.configs import default
from jaxsgd import errors
from jaxsgd import training
from jaxsgd.algorithms import resume as resume_lib
from jaxsgd.scheduler import real, snapshot
from jaxsgd.scheduler.lanes import LaneError
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR
from jaxsgd.scheduler.real import RealExecutor, ThreadedExecutor
from jaxsgd.training import checkpoints

from test_checkpoints import Crash, _sigterm_at, assert_same_final_states, crash_at, metrics
from test_checkpoints import whole_and_crashed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), 'lanes'))
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone  # noqa: E402


def virtual_config(data_dir, name: str, **overrides):
  config = default.get_config('smoke')
  config.data_dir = data_dir
  config.clock = 'virtual'
  config.train_steps = 24
  config.eval_every = 8
  config.model = default.ml_collections.ConfigDict({'name': 'mlp', 'hidden': (32, 32)})
  config.cost.calibrate = False
  config.cost.compute.forward = 1.0
  config.cost.compute.backward = 2.0
  config.cost.compute.update = 0.25
  config.cost.straggler_std = 0.3  # Seeded noise: the sampler's state is saved too.
  config.cost.link_latency = 0.125
  config.algorithm = default.algorithm(name)
  config.update(overrides)
  return config


def final_state(workdir) -> tuple[int, list[np.ndarray]]:
  """Every array of the last checkpoint (written at the last step). The pickled structure
  is left out: it holds the same values, but Python shares strings differently in a
  resumed process, so its bytes differ."""
  root = checkpoints.directory(workdir)
  step = max(int(name) for name in os.listdir(root) if name.isdigit())
  tree = ocp.PyTreeCheckpointer().restore(os.path.join(root, str(step), 'state'))
  arrays = tree['arrays']
  return step, [np.asarray(arrays[key]) for key in sorted(arrays, key=int)]


def trace(workdir) -> list:
  with open(os.path.join(workdir, 'trace.json')) as f:
    return json.load(f)['traceEvents']


@pytest.fixture
def in_flight(monkeypatch):
  """Records, at every checkpoint saved, the tasks running and the messages on channels."""
  seen = {}
  original = resume_lib.SimulationCheckpoints._state

  def state(self):
    executor = self.executor
    events = executor._events
    running = [args for _, _, fn, args in events if fn == executor._finish]
    live = {args[0] for _, _, _, args in events} | {
      p for q in executor._queued.values() for p, *_ in q
    }
    seen[self.progress()] = {
      'running': len(running),  # tasks started, not ended (their results are saved)
      'queued': sum(len(q) for q in executor._queued.values()),
      'messages': sum(len(c.items) for c in executor.cluster.channels),
      'transfers': sum(p.name.startswith('transfer') for p in live),
      # forwards in flight, or done with their backward to come: their vjps are saved
      'vjps': sum(op.kind == 'forward' for _, op, *_ in running)
      + sum(_vjps(p.state.__dict__) for p in executor.policy_processes),
    }
    return original(self)

  monkeypatch.setattr(resume_lib.SimulationCheckpoints, '_state', state)
  return seen


def _vjps(tree) -> int:
  """The vjps held in a process's variables."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, snapshot._VJP_TYPES))
  return sum(isinstance(leaf, snapshot._VJP_TYPES) for leaf in leaves)


def assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step):
  whole, broken = whole_and_crashed(config, tmp_path, monkeypatch, crash_step)
  saved = checkpoints.latest_meta(broken)['step']
  assert saved < crash_step
  training.train_and_evaluate(config, broken, show_progress=False)
  assert metrics(broken) == metrics(whole)
  assert [r['sim_time'] for r in metrics(whole)] == sorted({r['sim_time'] for r in metrics(whole)})
  assert trace(broken) == trace(whole)
  assert_same_final_states(whole, broken, config.train_steps, read=final_state)
  return saved


@pytest.mark.parametrize('name', ['asgd', 'dcasgd'])
def test_asgd_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch, in_flight, name):
  config = virtual_config(data_dir, name, workers=3, checkpoint_every=5)
  saved = assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=13)
  assert saved == 10
  at = in_flight[10]  # Of the run that was resumed: work in flight at its checkpoint.
  assert at['running'] >= 2 and at['transfers'] >= 1 and at['vjps'] >= 1, at


def test_sigterm_saves_the_simulation_and_resumes(data_dir, tmp_path, monkeypatch):
  config = virtual_config(data_dir, 'asgd', workers=2)  # checkpoint_every = 0: SIGTERM only.
  with monkeypatch.context() as patch:
    _sigterm_at(patch, 9)
    with pytest.raises(errors.Preempted, match='checkpoint of step 9'):
      training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  assert checkpoints.latest_meta(str(tmp_path / 'run'))['step'] == 9
  training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'whole'), show_progress=False)
  assert metrics(str(tmp_path / 'run')) == metrics(str(tmp_path / 'whole'))
  assert trace(str(tmp_path / 'run')) == trace(str(tmp_path / 'whole'))


def real_config(data_dir, name: str, **overrides):
  """`virtual_config` on the in-process real clock (stage k on device k of the test's 8)."""
  config = virtual_config(data_dir, name, clock='real', **overrides)
  config.cost = default.get_config('smoke').cost
  return config


def crash_and_resume(
  config, tmp_path, monkeypatch, crash: int = 13, saved_at=(10,)
) -> tuple[str, str, list]:
  """Runs `config` whole, and crashed at step `crash` then resumed (checkpoint_every=5,
  so saved at step 10: `saved_at`); the workdirs, and the batches of the tasks the
  resumed run dispatched."""
  whole, broken = whole_and_crashed(config, tmp_path, monkeypatch, crash)
  assert checkpoints.latest_meta(broken)['step'] in saved_at
  dispatched = []
  for executor in (RealExecutor, ThreadedExecutor):
    start_task = executor.start_task
    monkeypatch.setattr(
      executor,
      'start_task',
      lambda self, p, lane, op, start=start_task: [
        dispatched.append(op.batch),
        start(self, p, lane, op),
      ],
    )
  training.train_and_evaluate(config, broken, show_progress=False)
  assert 0 < len(dispatched) < len(trace(whole))
  return whole, broken, [b for b in dispatched if b is not None]


def assert_same_final_model(whole, broken, steps: int, at_least: int) -> None:
  """Every array of the two runs' last checkpoints but the timeline's columns (float64
  times, int64 lanes and batches: wall times, recorded in the order tasks finish);
  JAX's arrays are 32-bit."""
  model = assert_same_final_states(
    whole, broken, steps, read=final_state, keep=lambda array: array.dtype.itemsize <= 4
  )
  assert sum(a.size for a, _ in model) > at_least


@pytest.mark.parametrize(
  'name, algorithm',
  [('ddg', {}), ('local', {'variant': 'overlapping'})],
  ids=['ddg', 'local-overlapping'],  # (staged bp: the same stage roles, delay 0)
)
def test_real_clock_pipeline_resumes_from_a_drained_point(
  data_dir, tmp_path, monkeypatch, name, algorithm
):
  config = real_config(data_dir, name, stages=3, checkpoint_every=5)
  config.model.hidden = (32, 32, 32)
  config.algorithm.update(algorithm)
  whole, broken, batches = crash_and_resume(config, tmp_path, monkeypatch)
  # It went on from step 10: only the tasks after it (a stage's backward lags by < K steps).
  assert min(batches) >= 10 - config.stages
  assert metrics(broken) == metrics(whole)
  assert_same_final_model(
    whole, broken, config.train_steps, at_least=3 * 32 * 32
  )  # the stages' weights
  # The timeline goes on from the saved wall time: every task of the run, once.
  tasks = [(e['tid'], e['name']) for e in trace(broken) if e.get('ph') == 'X']
  assert sorted(tasks) == sorted((e['tid'], e['name']) for e in trace(whole) if e.get('ph') == 'X')


def test_one_asgd_worker_on_real_threads_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch):
  """One worker: its order does not depend on timing (sequential SGD), so the run resumed
  from the drained point (server and worker threads stopped between two ops) ends
  exactly as the uninterrupted one."""
  config = real_config(data_dir, 'asgd', workers=1, checkpoint_every=5)
  whole, broken, batches = crash_and_resume(config, tmp_path, monkeypatch)
  assert min(batches) >= 9
  assert metrics(broken) == metrics(whole)
  assert_same_final_model(whole, broken, config.train_steps, at_least=2 * 32 * 32)


@pytest.mark.parametrize(
  'name, algorithm',
  [
    ('dcasgd', {}),  # (asgd's processes, with delay compensation)
    ('lppsgd', {'devices': 2, 'workers_per_device': 2, 'averaging_freq': 2}),
    ('pdasgd', {'n_fwd': 2, 'n_bwd': 2}),
  ],
)
def test_asynchronous_workers_on_real_threads_resume_from_a_drained_point(
  data_dir, tmp_path, monkeypatch, name, algorithm
):
  """Several workers: the threads' interleaving is real time's, so the resumed run is
  another run from the checkpoint on; it trains to the end from there and reports the
  same steps. A checkpoint due at step 10 is taken at the first drained point from
  there: the threads busy with an op finish it first, and their ops may report a step
  or two more (four LPP-SGD workers and the averaging: up to three). Crashed at step 19,
  the run was saved at step 10 to 14, or 15 to 18."""
  config = real_config(data_dir, name, checkpoint_every=5)
  config.algorithm.update(algorithm)
  if name == 'dcasgd':
    config.workers = 3
  if name == 'pdasgd':
    config.stages = 3
    config.model.hidden = (32, 32, 32)
  whole, broken, _ = crash_and_resume(
    config, tmp_path, monkeypatch, crash=19, saved_at=range(10, 19)
  )
  assert [r['step'] for r in metrics(broken)] == [r['step'] for r in metrics(whole)]
  with open(os.path.join(broken, 'summary.json')) as f:
    assert json.load(f)['final']['step'] == config.train_steps


def test_a_ctrl_c_on_real_threads_lets_the_worker_finish_the_checkpoint_it_writes(
  data_dir, tmp_path, monkeypatch, ctrl_c_raises
):
  """A worker thread saves; Ctrl-C reaches the main thread, whose `run` then raises and the
  run's files are closed (`Run.abort`). The save in progress, longer here than the
  workers' grace, is complete before that: the run resumes from it."""
  monkeypatch.setattr(real, '_GRACE_S', 0.1)
  config = real_config(data_dir, 'asgd', workers=2, checkpoint_every=5)
  save = checkpoints.Checkpointer.save
  saving = []

  def save_after_a_ctrl_c(self, step, state, meta):
    saving.append(step)
    os.kill(os.getpid(), signal.SIGINT)  # Python runs its handler in the main thread.
    time.sleep(1.0)
    save(self, step, state, meta)

  monkeypatch.setattr(checkpoints.Checkpointer, 'save', save_after_a_ctrl_c)
  workdir = str(tmp_path / 'run')
  with pytest.raises(KeyboardInterrupt):
    training.train_and_evaluate(config, workdir, show_progress=False)
  assert len(saving) == 1 and 5 <= saving[0] < 10, saving
  assert checkpoints.latest_meta(workdir)['step'] == saving[0]


# --- lane processes (`executor='processes'`) ------------------------------------------------
# The lane runs join one `ray start --head` node by address (as a run over several hosts
# does) rather than each starting a Ray cluster of its own (seconds each), but for one
# crashed run here: that a run's own cluster ends with it after a signal is
# `test_process_faults.py`'s and `test_lanes.py`'s.
@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


def lanes_config(data_dir, head, name: str, **overrides):
  """`real_config` on lane processes of `head` (None: of a Ray cluster the run starts and
  ends): every lane an OS process of its own."""
  config = real_config(data_dir, name, executor='processes', **overrides)
  if head is not None:
    config.cluster_address = head.address
  return config


def own_cluster_left(head) -> list[str]:
  """This test process's descendants, `head`'s aside, that are lane processes
  (`LaneRuntime` actors) or the Ray cluster a run started: none once a run has ended,
  however it ended."""
  found = []
  for child in psutil.Process().children(recursive=True):
    try:
      command = ' '.join(child.cmdline())
      if child.status() != psutil.STATUS_ZOMBIE and ('ray' in command or 'LaneRuntime' in command):
        found.append((child.pid, command[:80]))
    except (psutil.Error, OSError):  # it ended meanwhile
      pass
  heads = {p.pid for p in head.processes()}  # after: what the head started meanwhile too
  return [command for pid, command in found if pid not in heads]


def lane_processes_left(head, before) -> list[int]:
  """The lane processes (`LaneRuntime` actors) on `head` that were not there `before`,
  still alive 5 s on: none once a run has ended, however it ended."""
  return gone(set(_lane_processes(head)) - set(before))


@pytest.mark.slow
def test_ddg_on_lane_processes_saves_on_sigterm_and_resumes_bit_for_bit(
  head, data_dir, tmp_path, monkeypatch
):
  """SIGTERM at step 9 of a DDG K=2 run on lane processes (saving only at its end): the run
  drains its lanes, saves step 9 (the lanes' values exported by their lanes), exits
  with `Preempted`, and ends every lane process; the same command resumes it and ends
  exactly as the uninterrupted run: the last step's metrics and every array of the last
  checkpoint but the wall-time columns. (Not the metrics of earlier evaluations: the
  driver runs ahead of the lanes as far as the lanes' pace lets it, so how many of the
  first stage's updates an evaluation at step 8 sees is real time's, on any two runs.)"""
  config = lanes_config(data_dir, head, 'ddg', stages=2, checkpoint_every=24)  # and the last step
  before = _lane_processes(head)
  whole, broken = str(tmp_path / 'whole'), str(tmp_path / 'broken')
  training.train_and_evaluate(config, whole, show_progress=False)
  with monkeypatch.context() as patch:
    _sigterm_at(patch, 9)
    with pytest.raises(errors.Preempted, match='checkpoint of step 9'):
      training.train_and_evaluate(config, broken, show_progress=False)
  assert lane_processes_left(head, before) == []
  assert checkpoints.latest_meta(broken)['step'] == 9
  training.train_and_evaluate(config, broken, show_progress=False)
  assert [r['step'] for r in metrics(broken)] == [8, 16, 24]
  assert metrics(broken)[-1] == metrics(whole)[-1]
  assert_same_final_model(whole, broken, config.train_steps, at_least=2 * 32 * 32)
  assert lane_processes_left(head, before) == []


def test_a_killed_pipeline_stage_ends_the_run_and_the_same_command_resumes_it(
  head, data_dir, tmp_path, monkeypatch
):
  """DDG K=2 on lane processes, checkpoint_every=5: stage 1's lane process is killed in
  its 15th backward task (a pipeline stage cannot be replaced: every other lane waits
  on it). The run ends with a `LaneError` naming the lane, no lane process is left,
  and the same config and workdir resume from the last checkpoint (step 10) to the end."""
  config = lanes_config(data_dir, head, 'ddg', stages=2, checkpoint_every=5)
  before = _lane_processes(head)
  workdir = str(tmp_path / 'run')
  with monkeypatch.context() as patch:
    patch.setenv(FAULT_VAR, 'stage1:backward:15:kill')
    with pytest.raises(LaneError, match=r"lane 'stage1' on host \S+: pid \d+: its process died"):
      training.train_and_evaluate(config, workdir, show_progress=False)
  assert lane_processes_left(head, before) == []
  assert checkpoints.latest_meta(workdir)['step'] == 10
  summary = training.train_and_evaluate(config, workdir, show_progress=False)
  assert summary['final']['step'] == config.train_steps
  assert [r['step'] for r in metrics(workdir)] == [8, 16, 24]
  assert lane_processes_left(head, before) == []


@pytest.mark.slow
def test_asgd_on_lane_processes_resumes_from_its_checkpoint_to_the_end(
  head, data_dir, tmp_path, monkeypatch
):
  """Two ASGD workers on lane processes, checkpoint_every=5, the driver crashed at step
  13 (a Ray cluster of the run's own: it ends with the run, as its lanes do): saved at
  step 10 (the server's parameters and Adam's state, each worker's pulled copy, the
  messages on their way, all exported by their lanes); the resumed run, on another
  cluster (the shared head: `cluster_address` may differ on a resume), trains from there
  to step 24 and reports the steps an uninterrupted run reports.
  The workers' order is real time's, so it is another run from the checkpoint on."""
  broken = str(tmp_path / 'broken')
  with monkeypatch.context() as patch:
    crash_at(patch, 13)
    with pytest.raises(Crash):
      own = lanes_config(data_dir, None, 'asgd', workers=2, checkpoint_every=5)
      training.train_and_evaluate(own, broken, show_progress=False)
  assert own_cluster_left(head) == []
  assert checkpoints.latest_meta(broken)['step'] == 10
  config = lanes_config(data_dir, head, 'asgd', workers=2, checkpoint_every=5)
  before = _lane_processes(head)
  summary = training.train_and_evaluate(config, broken, show_progress=False)
  assert summary['final']['step'] == config.train_steps
  assert [r['step'] for r in metrics(broken)] == [8, 16, 24]
  assert lane_processes_left(head, before) == []


@pytest.mark.parametrize(
  'name, algorithm',
  [
    ('ddg', {}),
    ('ddg', {'variant': 'stale_graph'}),
    ('local', {'variant': 'overlapping', 'agreement_every': 3}),
    ('local', {'variant': 'chunked', 'chunks': 1}),
  ],
  ids=['ddg', 'ddg-stale_graph', 'local-overlapping-probe', 'local-chunked'],
)
def test_pipeline_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch, in_flight, name, algorithm):
  config = virtual_config(data_dir, name, stages=3, checkpoint_every=5)
  config.model.hidden = (32, 32, 32)
  config.algorithm.update(algorithm)
  config.cost.straggler_std = 0.0  # (Per-stage noise is covered by the ASGD tests.)
  assert assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=13) == 10
  at = in_flight[10]
  assert at['running'] >= 2 and at['transfers'] + at['messages'] >= 1, at
  if algorithm.get('variant') != 'stale_graph':
    assert at['vjps'] >= 2, at  # Delay lines of stored forwards.


def test_staged_bp_resumes_after_sigterm(data_dir, tmp_path, monkeypatch):
  config = virtual_config(data_dir, 'bp', stages=2)
  with monkeypatch.context() as patch:
    _sigterm_at(patch, 7)
    with pytest.raises(errors.Preempted, match='checkpoint of step 7'):
      training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'whole'), show_progress=False)
  assert metrics(str(tmp_path / 'run')) == metrics(str(tmp_path / 'whole'))
  assert trace(str(tmp_path / 'run')) == trace(str(tmp_path / 'whole'))


@pytest.mark.parametrize('updates', ['layer', 'block'])
def test_pdasgd_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch, in_flight, updates):
  config = virtual_config(data_dir, 'pdasgd', stages=3, checkpoint_every=5)
  config.model.hidden = (32, 32, 32)
  config.algorithm.update({'n_fwd': 2, 'n_bwd': 2, 'updates': updates})
  assert assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=13) == 10
  at = in_flight[10]  # A forward's result queued with its residuals, others running.
  assert at['running'] >= 2 and at['messages'] >= 1 and at['vjps'] >= 2, at


def test_lppsgd_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch, in_flight):
  # 2 replicas of 2 workers, averaging every 2 updates of a replica: rounds in flight.
  config = virtual_config(data_dir, 'lppsgd', checkpoint_every=5)
  config.algorithm.update({'devices': 2, 'workers_per_device': 2, 'averaging_freq': 2})
  assert assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=13) == 10
  at = in_flight[10]  # A replica's snapshot waits for its round; workers are running.
  assert at['running'] >= 2 and at['messages'] >= 1 and at['vjps'] >= 1, at


def test_checkpoints_change_nothing_in_a_run(data_dir, tmp_path):
  runs = {}
  for every in (0, 4):
    config = virtual_config(data_dir, 'asgd', workers=3, checkpoint_every=every)
    training.train_and_evaluate(config, str(tmp_path / str(every)), show_progress=False)
    runs[every] = metrics(str(tmp_path / str(every))), trace(str(tmp_path / str(every)))
  assert runs[0] == runs[4]
  assert not os.path.exists(checkpoints.directory(str(tmp_path / '0')))


@pytest.mark.parametrize('name', ['asgd', 'ddg'])
def test_a_finished_run_resumes_to_its_end(data_dir, tmp_path, name):
  """The last checkpoint is of the last step: running again finishes the same run."""
  config = virtual_config(data_dir, name, checkpoint_every=10, stages=1 if name == 'asgd' else 2)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  first = metrics(str(tmp_path)), trace(str(tmp_path))
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert (metrics(str(tmp_path)), trace(str(tmp_path))) == first
  assert summary['final']['step'] == config.train_steps and len(first[0]) == 3
