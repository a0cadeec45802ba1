"""Damaged checkpoints, saves cut short and full disks: a resume falls back to the newest
whole checkpoint and says so in one line, a save cut short never blocks the next run,
a failed save is a failed run (not bad input) that leaves no part-written step, and a
refused input leaves no file that would refuse the corrected command."""

import errno
import json
import logging
import os
import shutil

import pytest

from jaxsgd import training
from jaxsgd.training import checkpoints
from jaxsgd.training import files
from jaxsgd.training import workdir as workdir_lib
from test_checkpoints import Crash, crash_at, metrics, smoke_config


def _crashed_at_25(config, workdir, monkeypatch) -> None:
  """`config` (checkpoint_every=10) run into `workdir` and crashed at step 25: its
  checkpoints are of steps 10 and 20."""
  with monkeypatch.context() as patch:
    crash_at(patch, 25)
    with pytest.raises(Crash):
      training.train_and_evaluate(config, workdir, show_progress=False)
  assert sorted(n for n in os.listdir(checkpoints.directory(workdir)) if n.isdigit()) == [
    '10',
    '20',
  ]


def _largest_file(folder: str) -> str:
  paths = [os.path.join(p, n) for p, _, names in os.walk(folder) for n in names]
  return max(paths, key=os.path.getsize)


def _truncate(step_folder: str) -> str:
  """Cuts the step's largest file (an array file) to half."""
  path = _largest_file(os.path.join(step_folder, 'state'))
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  return 'has'


def _remove_metadata(step_folder: str) -> str:
  os.unlink(os.path.join(step_folder, '_CHECKPOINT_METADATA'))
  return '_CHECKPOINT_METADATA is missing'


def _empty(step_folder: str) -> str:
  for name in os.listdir(step_folder):
    path = os.path.join(step_folder, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
  return 'its save did not finish'


def _garble_meta(step_folder: str) -> str:
  """Overwrites the meta's JSON with as many bytes of garbage: every file keeps its size."""
  path = os.path.join(step_folder, 'meta', 'metadata')
  with open(path, 'r+b') as f:
    f.write(b'#' * os.path.getsize(path))
  return 'its meta does not read'


@pytest.mark.parametrize('damage', [_truncate, _remove_metadata, _empty, _garble_meta])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newer_whole_one(
  data_dir, tmp_path, monkeypatch, caplog, damage
):
  """Step 20's checkpoint damaged: the resume says so in one line, goes on from step 10
  and ends exactly as the uninterrupted run (fused bp is bit-exact on resume), its
  checkpoints whole."""
  config = smoke_config(data_dir, checkpoint_every=10)
  whole, broken = str(tmp_path / 'whole'), str(tmp_path / 'broken')
  training.train_and_evaluate(config, whole, show_progress=False)
  _crashed_at_25(config, broken, monkeypatch)
  why = damage(os.path.join(checkpoints.directory(broken), '20'))
  with caplog.at_level(logging.WARNING):
    summary = training.train_and_evaluate(config, broken, show_progress=False)
  warnings = [r.getMessage() for r in caplog.records if 'is damaged' in r.getMessage()]
  assert len(warnings) == 1
  assert warnings[0].startswith('checkpoint of step 20 in ') and why in warnings[0]
  assert warnings[0].endswith('; resuming from step 10 (the damaged one is removed).')
  assert summary['final']['step'] == config.train_steps
  assert metrics(broken) == metrics(whole)
  root = checkpoints.directory(broken)
  kept = sorted(int(n) for n in os.listdir(root) if n.isdigit())
  assert kept == [40, 50, 60]  # the last three, each whole
  assert [checkpoints.damage(os.path.join(root, str(step))) for step in kept] == [None] * 3


def test_a_first_save_cut_short_does_not_block_the_same_command(
  data_dir, tmp_path, monkeypatch, caplog
):
  """The only checkpoint was never finished (its folder without orbax's commit marker nor
  jaxsgd's list of files): the same command starts over, says so, and ends as an
  uninterrupted run; another config is refused, naming the fields that differ."""
  config = smoke_config(data_dir, checkpoint_every=10)
  whole, broken = str(tmp_path / 'whole'), str(tmp_path / 'broken')
  training.train_and_evaluate(config, whole, show_progress=False)
  with monkeypatch.context() as patch:
    crash_at(patch, 15)
    with pytest.raises(Crash):
      training.train_and_evaluate(config, broken, show_progress=False)
  step = os.path.join(checkpoints.directory(broken), '10')
  for name in (checkpoints.COMPLETE, 'commit_success.txt'):
    os.unlink(os.path.join(step, name))
  other = smoke_config(data_dir, checkpoint_every=10, seed=7)
  with pytest.raises(workdir_lib.WorkdirHoldsRunError, match=r'it differs in seed: 0 → 7'):
    training.train_and_evaluate(other, broken, show_progress=False)
  with caplog.at_level(logging.WARNING):
    summary = training.train_and_evaluate(config, broken, show_progress=False)
  assert any(
    'holds no whole checkpoint (step 10: its save did not finish); starting over' in r.getMessage()
    for r in caplog.records
  )
  assert summary['final']['step'] == config.train_steps
  assert metrics(broken) == metrics(whole)


def test_a_full_disk_during_a_save_is_a_failed_run_leaving_no_part_of_the_step(
  data_dir, tmp_path, monkeypatch
):
  """orbax's save raising ENOSPC: `CheckpointWriteError` naming the step and the folder
  (exit 1 from the binary: a failed run, not bad input), no folder of the step left;
  the checkpoint before it stays whole and the same command resumes from it."""
  config = smoke_config(data_dir, checkpoint_every=10)
  workdir = str(tmp_path / 'run')
  real_save = checkpoints.Checkpointer.save

  def save(self, step, state, meta):
    if step == 20:
      ocp = checkpoints._ocp()
      original = ocp.CheckpointManager.save

      def full(manager, *args, **kwargs):
        original(manager, *args, **kwargs)  # writes part of it, then the disk is full
        raise OSError(errno.ENOSPC, 'No space left on device')

      with monkeypatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, 'save', full)
        return real_save(self, step, state, meta)
    return real_save(self, step, state, meta)

  with monkeypatch.context() as patch:
    patch.setattr(checkpoints.Checkpointer, 'save', save)
    with pytest.raises(checkpoints.CheckpointWriteError) as raised:
      training.train_and_evaluate(config, workdir, show_progress=False)
  root = checkpoints.directory(workdir)
  assert str(raised.value) == (
    f'checkpoint: saving step 20 in {root} failed: [Errno 28] No space left on device'
  )
  assert not isinstance(raised.value, ValueError)  # experiments.train: a failed run, exit 1
  assert sorted(os.listdir(root)) == ['10']
  summary = training.train_and_evaluate(config, workdir, show_progress=False)
  assert summary['final']['step'] == config.train_steps


def test_a_metrics_line_cut_by_a_full_disk_is_not_left_torn(tmp_path, monkeypatch):
  path = str(tmp_path / 'metrics.jsonl')
  writer = files.JsonLinesWriter(path, 'w')
  writer.write({'step': 1})
  real_write = os.write

  def half_then_full(fd, data):
    real_write(fd, bytes(data[: len(data) // 2]))
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(os, 'write', half_then_full)
  with pytest.raises(OSError, match='No space left'):
    writer.write({'step': 2, 'train_loss': 0.5})
  monkeypatch.undo()
  writer.close()
  with open(path) as f:
    assert f.read() == json.dumps({'step': 1}) + '\n'


def test_another_configs_results_are_refused_naming_the_fields_that_differ(data_dir, tmp_path):
  config = smoke_config(data_dir, train_steps=20, eval_every=10)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  other = smoke_config(data_dir, train_steps=20, eval_every=10, seed=3, batch_size=16)
  with pytest.raises(
    workdir_lib.WorkdirHoldsRunError,
    match=r'a different config \(.*; it differs in batch_size: 32 → 16; seed: 0 → 3\)',
  ):
    training.train_and_evaluate(other, str(tmp_path), show_progress=False)


def test_a_workdir_or_data_dir_that_cannot_be_written_is_refused_naming_it(
  data_dir, tmp_path, monkeypatch
):
  """The OS refusing the workdir or the data_dir (permissions; simulated, since a test run
  as root may write anywhere) is bad input naming the setting and the path, not a failed
  run naming neither."""
  from jaxsgd.data import pipeline  # pylint: disable=g-import-not-at-top

  def denied(path):
    def refuse(*args, **kwargs):
      raise PermissionError(errno.EACCES, 'Permission denied', path)

    return refuse

  cases = [
    (files.WorkdirLock, 'acquire', '/locked/run', r'^workdir: /locked/run: .*; choose a workdir'),
    (
      pipeline.tfds,
      'data_source',
      '/locked/data',
      r'^data_dir: /locked/data: .*; choose a data_dir',
    ),
  ]
  for owner, name, path, message in cases:
    pipeline._load_cached.cache_clear()
    with monkeypatch.context() as patch:
      patch.setattr(owner, name, denied(path))
      with pytest.raises(ValueError, match=message.replace('.*', 'Permission denied')):
        training.train_and_evaluate(
          smoke_config(data_dir), str(tmp_path / name), show_progress=False
        )
  pipeline._load_cached.cache_clear()
  assert not os.path.exists(tmp_path / 'data_source' / 'metrics.jsonl')
