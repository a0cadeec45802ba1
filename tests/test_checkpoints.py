"""Checkpoints and exact resume: a run that crashes and is started again on its workdir
ends bit for bit where the uninterrupted run ends (metrics.jsonl but its wall times, and
the final parameters and optimizer state)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.configs import default
from jaxsgd import errors
from jaxsgd import training
from jaxsgd.data import pipeline
from jaxsgd.training import checkpoints
from jaxsgd.training import run as run_lib
from jaxsgd.training import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Crash(Exception):
  """Stands for the process dying at a step (raised from `Run.report`)."""


def smoke_config(data_dir, **overrides):
  config = default.get_config('smoke')
  config.data_dir = data_dir
  config.update(overrides)
  return config


def dasgd_config(data_dir, **overrides):
  config = smoke_config(data_dir, workers=2, **overrides)
  config.algorithm = default.algorithm('dasgd', period=4, delay=1)
  return config


def metrics(workdir) -> list[dict]:
  lines = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  return [{k: v for k, v in record.items() if k != 'wall_time'} for record in lines]


def final_state(workdir) -> tuple[int, list[np.ndarray]]:
  """Every array of the last checkpoint (written at the last step)."""
  root = checkpoints.directory(workdir)
  step = max(int(name) for name in os.listdir(root) if name.isdigit())
  tree = ocp.PyTreeCheckpointer().restore(os.path.join(root, str(step), 'state'))
  import jax  # pylint: disable=g-import-not-at-top

  return step, [np.asarray(x) for x in jax.tree.leaves(tree)]


def crash_at(monkeypatch, step: int) -> None:
  original = run_lib.Run.report

  def report(self, s, **kwargs):
    original(self, s, **kwargs)
    if s == step:
      raise Crash(f'crashed at step {s}')

  monkeypatch.setattr(run_lib.Run, 'report', report)


def assert_same_final_states(
  whole, broken, step: int, read=final_state, keep=lambda array: True
) -> list[tuple[np.ndarray, np.ndarray]]:
  """The two runs' last checkpoints (`read` from each workdir) are both of `step` and hold
  the same arrays bit for bit — those `keep` selects; returns the pairs compared."""
  (step_a, state_a), (step_b, state_b) = read(whole), read(broken)
  assert step_a == step_b == step
  assert len(state_a) == len(state_b) > 0
  pairs = [(a, b) for a, b in zip(state_a, state_b, strict=True) if keep(a)]
  for a, b in pairs:
    np.testing.assert_array_equal(a, b)
  return pairs


def whole_and_crashed(config, tmp_path, monkeypatch, crash_step: int) -> tuple[str, str]:
  """The workdirs of `config` run whole and of it crashed at `crash_step`."""
  whole, broken = str(tmp_path / 'whole'), str(tmp_path / 'broken')
  training.train_and_evaluate(config, whole, show_progress=False)
  with monkeypatch.context() as patch:
    crash_at(patch, crash_step)
    with pytest.raises(Crash):
      training.train_and_evaluate(config, broken, show_progress=False)
  return whole, broken


def assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step):
  whole, broken = whole_and_crashed(config, tmp_path, monkeypatch, crash_step)
  assert not os.path.exists(os.path.join(broken, 'summary.json'))
  written = metrics(broken)  # Lines past the checkpoint: the resume drops them.
  assert written and written[-1]['step'] > max(
    int(name) for name in os.listdir(checkpoints.directory(broken)) if name.isdigit()
  )
  summary = training.train_and_evaluate(config, broken, show_progress=False)
  assert metrics(broken) == metrics(whole)
  assert_same_final_states(whole, broken, config.train_steps)
  assert summary['final']['step'] == config.train_steps


def test_bp_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch):
  # Checkpoints at 25, 50, 60; evaluations at 20, 40, 60. The crash at 45 comes after the
  # line of step 40 was written: the resume starts from 25 (with steps 21-25's losses).
  config = smoke_config(data_dir, checkpoint_every=25)
  assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=45)


def test_dasgd_resumes_bit_for_bit(data_dir, tmp_path, monkeypatch):
  # Two workers on a mesh, period 4 (one program per period), delay 1. Checkpoints due at
  # 7, 14, 21, ... are saved at the ends of their programs: 8, 16, 24, ... The crash at
  # 22 comes after the line of step 20; the resume starts from 16, whose snapshot is
  # merged at step 17 (an average in flight, in the optimizer state).
  config = dasgd_config(data_dir, checkpoint_every=7, train_steps=40)
  assert_resumes_exactly(config, tmp_path, monkeypatch, crash_step=22)
  saved = sorted(int(n) for n in os.listdir(checkpoints.directory(str(tmp_path / 'whole'))))
  assert saved == [28, 36, 40]  # Saved at 8, 16, 24, 28, 36, 40; the last 3 kept.


@pytest.mark.parametrize('name', ['dasgd', 'diloco'])
def test_checkpoints_change_nothing_in_a_run(data_dir, tmp_path, name):
  """Programs are not cut at checkpoints: the same metrics with and without them."""
  runs = {}
  for every in (0, 7):
    config = smoke_config(data_dir, workers=2, train_steps=40, checkpoint_every=every)
    config.algorithm = default.algorithm(name, period=4)
    training.train_and_evaluate(config, str(tmp_path / str(every)), show_progress=False)
    runs[every] = metrics(str(tmp_path / str(every)))
  assert runs[0] == runs[7]


def test_keeps_the_last_three(data_dir, tmp_path):
  config = smoke_config(data_dir, checkpoint_every=10)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert sorted(int(n) for n in os.listdir(checkpoints.directory(str(tmp_path)))) == [40, 50, 60]


def test_batch_stream_position_is_exact(data_dir):
  dataset = pipeline.load('mnist1d/5k', data_dir)
  stream = dataset.train_batches(32, seed=3)
  for _ in range(130):  # Past an epoch (125 batches of 32 in 4,000).
    next(stream)
  position = stream.position
  expected = [next(stream)['label'] for _ in range(5)]
  other = dataset.train_batches(32, seed=3)
  other.seek(position)
  for labels in expected:
    np.testing.assert_array_equal(next(other)['label'], labels)
  with pytest.raises(ValueError, match='position'):
    other.seek({'epoch': 0, 'offset': 10**9})


def test_another_config_is_refused_and_checkpoint_every_may_change(data_dir, tmp_path):
  config = smoke_config(data_dir, checkpoint_every=30)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  with pytest.raises(workdir_lib.WorkdirHoldsRunError, match='different config'):
    training.train_and_evaluate(
      smoke_config(data_dir, checkpoint_every=30, seed=1), str(tmp_path), show_progress=False
    )
  # Same config, another checkpoint_every: resumes the finished run (its last step).
  summary = training.train_and_evaluate(
    smoke_config(data_dir, checkpoint_every=20), str(tmp_path), show_progress=False
  )
  assert summary['final']['step'] == 60 and len(metrics(str(tmp_path))) == 3


def test_a_bad_checkpoint_every_is_refused(data_dir, tmp_path):
  with pytest.raises(ValueError, match='^checkpoint_every: must be an integer >= 0'):
    training.train_and_evaluate(
      smoke_config(data_dir, checkpoint_every=-1), str(tmp_path), show_progress=False
    )


# --- pre-emption ---------------------------------------------------------------------------------
def _start(data_dir, workdir, *flags):
  command = [
    sys.executable,
    '-m',
    'experiments.train',
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
    '--config.train_steps=100000',
    '--config.eval_every=1000',
    *flags,
  ]
  # faulthandler: a run that does not end is made to print its threads' stacks (`_ended`).
  env = {**os.environ, 'PYTHONFAULTHANDLER': '1'}
  return subprocess.Popen(
    command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
  )


def _ended(process, timeout: float = 60.0) -> str:
  """`process`'s stderr once it has exited. One that has not within `timeout` s fails the
  test with its threads' stacks (SIGABRT, which faulthandler answers), and is killed: once,
  on a loaded machine, a run did not end within 60 s of Ctrl-C."""
  try:
    return process.communicate(timeout=timeout)[1]
  except subprocess.TimeoutExpired:
    process.send_signal(signal.SIGABRT)
    try:
      stderr = process.communicate(timeout=20)[1]
    except subprocess.TimeoutExpired:
      process.kill()
      stderr = process.communicate()[1]
    raise AssertionError(
      f'the run had not ended {timeout} s after the signal:\n{stderr[-8000:]}'
    ) from None


def _past_first_evaluation(workdir) -> bool:
  path = os.path.join(workdir, 'metrics.jsonl')
  return os.path.exists(path) and os.path.getsize(path) > 0


def _saved_checkpoints(workdir) -> bool:
  root = checkpoints.directory(workdir)
  return os.path.isdir(root) and len([n for n in os.listdir(root) if n.isdigit()]) >= 2


def _wait_for_training(process, workdir, ready=_past_first_evaluation, timeout=120.0):
  """Until `ready(workdir)`: the run is training."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if ready(workdir):
      return
    assert process.poll() is None, process.communicate()
    time.sleep(0.2)
  process.kill()
  raise AssertionError('the run did not start training')


def test_sigterm_saves_a_checkpoint_and_exits_143(data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  process = _start(data_dir, workdir)
  _wait_for_training(process, workdir)
  process.send_signal(signal.SIGTERM)
  stderr = _ended(process)
  assert process.returncode == 143, stderr
  assert 'SIGTERM' in stderr and 'resume' in stderr
  meta = checkpoints.latest_meta(workdir)
  # Saved when the signal came (no periodic checkpoints): at the first save point it met,
  # which is step 1000's own if the signal came between that step's log line and its save
  # point (seen once on a loaded machine), else a later step.
  assert meta is not None and meta['step'] >= 1000
  assert not os.path.exists(os.path.join(workdir, 'summary.json'))
  assert not [n for n in os.listdir(checkpoints.directory(workdir)) if not n.isdigit()]


def test_ctrl_c_leaves_no_partial_checkpoint(data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  process = _start(data_dir, workdir, '--config.checkpoint_every=1')  # Saving all the time.
  _wait_for_training(process, workdir, _saved_checkpoints)
  process.send_signal(signal.SIGINT)
  stderr = _ended(process)
  assert process.returncode == 130, stderr
  assert 'Traceback' not in stderr
  assert stderr.strip().splitlines()[-1].startswith('error: Ctrl-C: stopped at once'), stderr
  names = os.listdir(checkpoints.directory(workdir))
  complete = checkpoints.latest_meta(workdir)  # Only complete ones are seen ...
  assert complete is not None and str(complete['step']) in names
  # ... and a checkpoint cut by Ctrl-C is a temporary folder, never a step's folder.
  for name in names:
    assert name.isdigit() or 'tmp' in name, names


def _save_with_ctrl_cs(workdir: str, monkeypatch, ctrl_cs: int) -> list:
  """Saves step 1, `ctrl_cs` Ctrl-Cs coming as orbax's save begins, which must raise
  `KeyboardInterrupt`; the steps orbax went on to save."""
  checkpointer = checkpoints.Checkpointer(workdir, every=1, last=2)
  manager = checkpointer.manager()
  save = manager.save
  saved = []

  def interrupted_save(step, *args, **kwargs):
    for _ in range(ctrl_cs):
      os.kill(os.getpid(), signal.SIGINT)  # Handled before the next line runs (main thread).
    saved.append(step)
    return save(step, *args, **kwargs)

  monkeypatch.setattr(manager, 'save', interrupted_save)
  try:
    with pytest.raises(KeyboardInterrupt):
      checkpointer.save(1, {'w': np.arange(3.0)}, {'step': 1})
  finally:
    checkpointer.close()
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # The save's is gone.
  return saved


def test_a_ctrl_c_during_a_save_stops_the_run_once_the_checkpoint_is_complete(
  tmp_path, monkeypatch, capfd, ctrl_c_raises
):
  assert _save_with_ctrl_cs(str(tmp_path), monkeypatch, ctrl_cs=1) == [1]
  assert checkpoints.latest_meta(str(tmp_path)) == {'step': 1}  # Complete: it resumes.
  told = capfd.readouterr().err
  assert told.count(checkpoints.HELD_CTRL_C.decode()) == 1, told


def _ctrl_cs_as_orbax_reads(monkeypatch, ctrl_cs: int, fails: bool = False) -> list:
  """From now on, `ctrl_cs` Ctrl-Cs come as orbax's first read begins (which raises
  instead of reading if `fails`); the steps orbax then read to their end, in order."""
  restore = ocp.CheckpointManager.restore
  read = []

  def interrupted_restore(self, step, *args, **kwargs):
    if not read:
      for _ in range(ctrl_cs):
        os.kill(os.getpid(), signal.SIGINT)  # Handled before the next line (main thread).
      if fails:
        read.append('failed')
        raise ValueError('this checkpoint does not read')
    restored = restore(self, step, *args, **kwargs)
    read.append(step)
    return restored

  monkeypatch.setattr(ocp.CheckpointManager, 'restore', interrupted_restore)
  return read


@pytest.mark.parametrize('what', ['state', 'meta'])
def test_a_ctrl_c_during_a_restore_stops_the_run_once_the_checkpoint_is_read(
  tmp_path, monkeypatch, capfd, ctrl_c_raises, what
):
  """Interrupted, orbax's restore leaves its threads and tensorstore's callbacks to meet
  its closed event loop (a traceback after the run's line), as a save does."""
  workdir = str(tmp_path)
  checkpointer = checkpoints.Checkpointer(workdir, every=1, last=2)
  checkpointer.save(1, {'w': np.arange(3.0)}, {'step': 1})
  read = _ctrl_cs_as_orbax_reads(monkeypatch, ctrl_cs=1)
  try:
    with pytest.raises(KeyboardInterrupt):
      if what == 'state':
        checkpointer.restore(1, None)
      else:
        checkpoints.read_meta(workdir, 1)
  finally:
    checkpointer.close()
  assert read == [1]  # orbax's read ran to its end first
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  told = capfd.readouterr().err
  assert told.count(checkpoints.HELD_CTRL_C_READING.decode()) == 1, told


def test_a_save_that_fails_while_a_ctrl_c_is_held_ends_as_the_failed_save(
  tmp_path, monkeypatch, ctrl_c_raises
):
  """The save's error, not the held Ctrl-C: its clean-up runs, and it says more."""
  checkpointer = checkpoints.Checkpointer(str(tmp_path), every=1, last=2)
  manager = checkpointer.manager()

  def failing_save(step, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Handled before the next line runs (main thread).
    os.makedirs(os.path.join(checkpoints.directory(str(tmp_path)), f'{step}'))
    raise OSError('No space left on device')

  monkeypatch.setattr(manager, 'save', failing_save)
  try:
    checkpointer.save(1, {'w': np.arange(3.0)}, {'step': 1})
  except checkpoints.CheckpointWriteError as error:
    assert 'No space left' in str(error)
  except KeyboardInterrupt:
    pytest.fail("the held Ctrl-C was raised instead of the save's error")
  else:
    pytest.fail('the save did not fail')
  assert os.listdir(checkpoints.directory(str(tmp_path))) == []  # What it wrote is gone.
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_held_through_a_read_that_fails_is_not_lost(tmp_path, monkeypatch, ctrl_c_raises):
  """`find_latest` passes over a checkpoint whose meta does not read; the Ctrl-C held
  through that read must still stop the run."""
  workdir = str(tmp_path)
  checkpointer = checkpoints.Checkpointer(workdir, every=1, last=2)
  checkpointer.save(1, {'w': np.arange(3.0)}, {'step': 1})
  checkpointer.close()
  read = _ctrl_cs_as_orbax_reads(monkeypatch, ctrl_cs=1, fails=True)
  with pytest.raises(KeyboardInterrupt) as raised:
    checkpoints.find_latest(workdir)
  assert read == ['failed']
  assert 'does not read' in str(raised.value.__context__)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize('ctrl_cs', [1, 2])
def test_a_ctrl_c_during_a_resumes_nested_reads_is_held_once(
  tmp_path, monkeypatch, capfd, ctrl_c_raises, ctrl_cs
):
  """A restore opens the manager, which first reads the checkpoints' metas (to pass over
  damaged ones): one Ctrl-C there is held until the restore has ended and said once; a
  second goes on at once."""
  workdir = str(tmp_path)
  saved = checkpoints.Checkpointer(workdir, every=1, last=2)
  saved.save(1, {'w': np.arange(3.0)}, {'step': 1})
  saved.close()
  checkpointer = checkpoints.Checkpointer(workdir, every=1, last=2)  # (no manager yet)
  read = _ctrl_cs_as_orbax_reads(monkeypatch, ctrl_cs)
  try:
    with pytest.raises(KeyboardInterrupt):
      checkpointer.restore(1, None)
  finally:
    checkpointer.close()
  assert read == ([1, 1] if ctrl_cs == 1 else [])  # (its meta, then its state)
  told = capfd.readouterr().err
  assert told.count(checkpoints.HELD_CTRL_C_READING.decode()) == 1, told
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_during_a_save_with_stderr_gone_still_waits_for_the_save(
  tmp_path, monkeypatch, ctrl_c_raises
):
  read, write = os.pipe()
  os.close(read)  # As after `train ... 2>&1 | tee log`, the tee ended by the same Ctrl-C.
  stderr = os.dup(2)
  os.dup2(write, 2)
  os.close(write)
  try:
    saved = _save_with_ctrl_cs(str(tmp_path), monkeypatch, ctrl_cs=1)
  finally:
    os.dup2(stderr, 2)
    os.close(stderr)
  assert saved == [1]
  assert checkpoints.latest_meta(str(tmp_path)) == {'step': 1}


def test_a_second_ctrl_c_during_a_save_interrupts_it_at_once(tmp_path, monkeypatch, ctrl_c_raises):
  assert _save_with_ctrl_cs(str(tmp_path), monkeypatch, ctrl_cs=2) == []  # May hang: left.
  assert checkpoints.latest_meta(str(tmp_path)) is None


def test_the_watch_notes_a_ctrl_c_only_where_the_handler_it_found_raised(ctrl_c_raises):
  with checkpoints.PreemptionWatch() as watch:
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)  # Python's handler, through the watch's.
      time.sleep(1)
    assert watch.interrupted and watch.interrupt_lost()
  calls = []
  signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))  # Does not raise.
  with checkpoints.PreemptionWatch() as watch:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert calls == [signal.SIGINT] and not watch.interrupted
  os.kill(os.getpid(), signal.SIGINT)  # The handler found is back.
  time.sleep(0.05)
  assert calls == [signal.SIGINT, signal.SIGINT]


def test_a_ctrl_c_whose_keyboard_interrupt_was_dropped_stops_the_run_at_its_next_step(
  data_dir, tmp_path, monkeypatch, ctrl_c_raises
):
  original = run_lib.Run.report
  steps = []

  def report(self, s, **kwargs):
    steps.append(s)
    if s == 5:
      try:
        os.kill(os.getpid(), signal.SIGINT)  # Handled before the next line runs.
        time.sleep(1)
      except KeyboardInterrupt:
        pass  # Dropped, as Python drops one raised in a finalizer.
    original(self, s, **kwargs)

  monkeypatch.setattr(run_lib.Run, 'report', report)
  with pytest.raises(KeyboardInterrupt, match='lost; stopped at step 5'):
    training.train_and_evaluate(smoke_config(data_dir), str(tmp_path / 'run'), show_progress=False)
  assert steps[-1] == 5
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # The run's is gone.


def _sigterm_at(monkeypatch, step: int) -> None:
  original = run_lib.Run.report

  def report(self, s, **kwargs):
    if s == step:
      os.kill(os.getpid(), signal.SIGTERM)  # Handled by the run: it sets a flag.
      # Python runs the handler in the main thread only: a worker thread reporting this
      # step waits until it has, so that the signal has come in at this step (else a
      # fast worker ran on two steps before the main thread took it, on a loaded CI).
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline and not (self.preemption and self.preemption.requested):
        time.sleep(0.001)
    original(self, s, **kwargs)

  monkeypatch.setattr(run_lib.Run, 'report', report)


def test_sigterm_saves_the_step_it_came_in_and_resumes(data_dir, tmp_path, monkeypatch):
  config = smoke_config(data_dir)  # checkpoint_every = 0: only SIGTERM saves.
  before = signal.getsignal(signal.SIGTERM)  # Other tests' (JAX's, Ray's) may be installed.
  with monkeypatch.context() as patch:
    _sigterm_at(patch, 33)
    with pytest.raises(errors.Preempted, match='checkpoint of step 33'):
      training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  assert signal.getsignal(signal.SIGTERM) is before  # The run's handler is gone again.
  assert checkpoints.latest_meta(str(tmp_path / 'run'))['step'] == 33
  training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'whole'), show_progress=False)
  assert metrics(str(tmp_path / 'run')) == metrics(str(tmp_path / 'whole'))


def test_sigterm_saves_worker_threads_at_a_drained_point_and_resumes(
  data_dir, tmp_path, monkeypatch
):
  """ASGD on the real clock (a thread per worker, one worker: sequential SGD): SIGTERM
  saves the checkpoint once every thread has stopped between two ops (the step the
  signal came in, or the next the busy thread reported) and the run started again ends
  as an uninterrupted one."""
  config = smoke_config(data_dir, workers=1)
  config.algorithm = default.algorithm('asgd')
  with monkeypatch.context() as patch:
    _sigterm_at(patch, 33)
    with pytest.raises(errors.Preempted, match=r'checkpoint of step 3[34]'):
      training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  training.train_and_evaluate(config, str(tmp_path / 'whole'), show_progress=False)
  assert metrics(str(tmp_path / 'run')) == metrics(str(tmp_path / 'whole'))
