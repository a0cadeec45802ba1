"""The experiment: the smoke config trains end to end; bad configs are refused early."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.configs import default
from jaxsgd import training
from jaxsgd.training import run as run_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_FIELDS = {
  'step',
  'samples',
  'epoch',
  'wall_time',
  'train_loss',
  'test_loss',
  'test_accuracy',
}


def smoke_config(data_dir, **overrides):
  config = default.get_config('smoke')
  config.data_dir = data_dir
  config.update(overrides)
  return config


def test_smoke_run_learns_and_writes_its_files(data_dir, tmp_path):
  summary = training.train_and_evaluate(smoke_config(data_dir), str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['step'] for r in records] == [20, 40, 60]
  assert all(RECORD_FIELDS <= set(r) for r in records)
  assert records[-1]['samples'] == 60 * 32
  assert records[-1]['train_loss'] < records[0]['train_loss']
  assert records[-1]['test_loss'] < 2.3  # Below chance (ln 10 = 2.303) after 60 steps.
  assert records[-1]['test_accuracy'] > 0.2
  saved = json.load(open(tmp_path / 'summary.json'))
  assert saved['config']['dataset'] == 'mnist1d/5k' and saved['final'] == records[-1]
  assert summary['final'] == records[-1]
  assert (tmp_path / 'curves.png').stat().st_size > 10_000


def test_fused_bp_is_deterministic(data_dir, tmp_path):
  config = smoke_config(data_dir, train_steps=20, eval_every=20)
  first = training.train_and_evaluate(config, str(tmp_path / 'a'), show_progress=False)
  second = training.train_and_evaluate(config, str(tmp_path / 'b'), show_progress=False)
  for key in ('train_loss', 'test_loss', 'test_accuracy'):
    assert first['final'][key] == second['final'][key]


def test_time_to_target_is_recorded(data_dir, tmp_path):
  config = smoke_config(data_dir, target_accuracy=0.15)
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  # Checked every step (1 % of 60 steps, rounded up), not only at the evaluations.
  assert summary['target_resolution_steps'] == 1
  assert 1 <= summary['time_to_target']['step'] <= 60
  assert summary['time_to_target']['test_accuracy'] >= 0.15
  assert summary['time_to_target']['wall_time'] > 0


def test_nan_loss_stops_the_run_naming_the_step(data_dir, tmp_path):
  config = smoke_config(data_dir)
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 1e12
  with pytest.raises(
    training.NonFiniteLossError, match=r'training loss became (nan|inf) at step \d+'
  ):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)


@pytest.mark.parametrize(
  'field,value,message',
  [
    ('algorithm.name', 'sgd_plus', r"algorithm.name: unknown algorithm 'sgd_plus'; allowed: bp"),
    ('model.name', 'vgg', r"model.name: unknown model 'vgg'"),
    ('dataset', 'imagenet_in_a_zip', r"dataset: unknown dataset 'imagenet_in_a_zip'"),
    ('batch_size', 0, r'batch_size: must be a positive integer, got 0'),
    ('train_steps', -5, r'train_steps: must be a positive integer'),
    ('workers', 0, r'workers: must be a positive integer'),
    ('workers', 4, r'workers: bp does not read `workers` \(got 4\); leave it at 1'),
    ('clock', 'wall', r"clock: 'wall'; allowed: real, virtual"),
    ('optimizer.name', 'adamax_pro', r"optimizer.name: 'adamax_pro' is not an optax optimizer"),
    ('optimizer.learning_rate', -0.1, r'optimizer.learning_rate: must be > 0'),
    ('optimizer.schedule', 'linear', r"optimizer.schedule: 'linear'; allowed"),
    ('optimizer.kwargs', {'momentun': 0.9}, r"optimizer.kwargs: \{'momentun': 0.9\} do not fit"),
    ('stages', 9, r"stages: 9 stages asked for, but model 'cnn' has only 4 layers"),
  ],
)
def test_bad_config_is_refused_before_training(data_dir, tmp_path, field, value, message):
  config = smoke_config(data_dir)
  parent, _, leaf = field.rpartition('.')
  (config[parent] if parent else config)[leaf] = value
  with pytest.raises(ValueError, match=message):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  assert not (tmp_path / 'metrics.jsonl').exists()  # Refused before anything ran.


def _train_command(config: str, tmp_path, data_dir, *fields: str):
  """`python -m experiments.train --config=experiments/configs/CONFIG` into `tmp_path`,
  with `--config.FIELD=VALUE`s `fields`: the finished process, its output captured."""
  return subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.train',
      f'--config=experiments/configs/{config}',
      f'--workdir={tmp_path}',
      *(f'--config.{field}' for field in fields),
      f'--config.data_dir={data_dir}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


def test_command_line_binary_with_overrides(data_dir, tmp_path):
  """`python -m experiments.train` with `:smoke` and `--config.field=` overrides."""
  result = _train_command(
    'default.py:smoke', tmp_path, data_dir, 'dataset=digits', 'train_steps=30', 'eval_every=30'
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'final test accuracy' in result.stdout
  assert re.search(r'at step 30 \(\d+\.\d s wall\); results in ', result.stdout)
  # Libraries' INFO lines (tfds describing the dataset, JAX looking for a TPU) stay off.
  for chatter in ('dataset_info.py', 'dataset_builder.py', 'xla_bridge.py'):
    assert chatter not in result.stderr, result.stderr[-2000:]
  assert 'Training bp on digits' in result.stderr  # the run's own lines stay
  record = json.loads(open(tmp_path / 'metrics.jsonl').read().splitlines()[-1])
  assert record['step'] == 30
  assert json.load(open(tmp_path / 'summary.json'))['config']['dataset'] == 'digits'


def test_what_a_run_logs_after_its_last_step_is_on_a_line_of_its_own(data_dir, tmp_path):
  """DDG logs its staleness after the last step: the bar (which tqdm ends with a carriage
  return, not a new line) is closed at the last evaluation, before it."""
  result = _train_command('ddg.py:smoke', tmp_path, data_dir, 'train_steps=20', 'eval_every=10')
  assert result.returncode == 0, result.stderr[-2000:]
  staleness = re.search(r'.*outputs\.py:\d+\] ddg: staleness per stage', result.stderr)
  assert staleness and re.match(r'[IWE]\d{4} ', staleness.group()), result.stderr[-2000:]


def test_tensorboard_events_are_written_when_asked(data_dir, tmp_path):
  from tensorboardX.event_file_writer import event_pb2  # pylint: disable=g-import-not-at-top

  config = smoke_config(data_dir, train_steps=20, eval_every=10, tensorboard=True)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  files = list((tmp_path / 'tensorboard').glob('events.out.tfevents.*'))
  assert len(files) == 1
  # Read the records back (TFRecord framing: 8-byte length, 4-byte crc, data, 4-byte crc).
  raw, tags, offset = files[0].read_bytes(), set(), 0
  while offset < len(raw):
    length = int.from_bytes(raw[offset : offset + 8], 'little')
    event = event_pb2.Event.FromString(raw[offset + 12 : offset + 12 + length])
    tags.update(v.tag for v in event.summary.value)
    offset += 16 + length
  assert {'test_accuracy', 'train_loss', 'test_loss'} <= tags


# --- a NaN/inf loss is caught at the step it appears, without waiting every step ----------------
class _Loss:
  """A loss as an algorithm reports it: `is_ready()` like a `jax.Array`, no device."""

  def __init__(self, value, ready=True):
    self.value, self.ready = value, ready

  def is_ready(self):
    return self.ready

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self.value, dtype)


def _bare_run(data_dir, tmp_path, show_progress=False, **overrides):
  from jaxsgd import data as data_lib  # pylint: disable=g-import-not-at-top

  config = smoke_config(data_dir, **overrides)
  dataset = data_lib.load(config.dataset, data_dir)
  return training.Run(
    config,
    str(tmp_path),
    dataset,
    training.build_model(config, dataset),
    show_progress=show_progress,
  )


def test_the_progress_bar_is_drawn_at_the_first_step_not_before(data_dir, tmp_path, capsys):
  """What a run prints while it starts (`lanes: starting ...`, the placement) comes on
  lines of its own: the bar is not drawn before the first step."""
  run = _bare_run(data_dir, tmp_path, show_progress=True)
  steps = run.config.train_steps
  time.sleep(0.2)  # (past tqdm's shortest interval between two draws)
  assert f'0/{steps}' not in capsys.readouterr().err
  run.report(1, loss=_Loss(1.0), variables=None, samples=1)
  assert f'1/{steps}' in capsys.readouterr().err
  run.abort()


def _report_until_refused(run, losses) -> int:
  """Reports `losses` as steps 1, 2, ...; the step at which the run stopped."""
  for step, loss in enumerate(losses, 1):
    try:
      run.report(step, loss=loss, variables=None, samples=step)
    except training.NonFiniteLossError as e:
      assert 'training loss became nan at step 2;' in str(e)
      return step
  raise AssertionError('not refused')


def test_a_computed_nan_is_caught_within_a_few_steps_whatever_eval_every(data_dir, tmp_path):
  run = _bare_run(data_dir, tmp_path, train_steps=5000, eval_every=1000)
  losses = [_Loss(np.nan if step == 2 else 1.0) for step in range(1, 1000)]
  stopped = _report_until_refused(run, losses)
  assert 2 <= stopped <= run_lib.CHECK_EVERY_STEPS
  run.abort()


def test_losses_not_yet_computed_are_not_waited_for_until_many_are_pending(data_dir, tmp_path):
  run = _bare_run(data_dir, tmp_path, train_steps=5000, eval_every=1000)
  losses = [_Loss(np.nan if step == 2 else 1.0, ready=False) for step in range(1, 1000)]
  stopped = _report_until_refused(run, losses)
  # Checked every 16 steps; none is ready, so the check waits only once more than
  # WAIT_AFTER_STEPS (128) are unchecked: at step 144 (or earlier, after a 1 s check).
  assert run_lib.WAIT_AFTER_STEPS < stopped <= run_lib.WAIT_AFTER_STEPS + 16
  run.abort()


def test_nan_at_step_2_stops_a_run_with_eval_every_1000_at_once(data_dir, tmp_path, monkeypatch):
  """SGD with a huge learning rate: the loss is NaN from step 2 on (the first bad step is
  the same as with eval_every=1, which checks every step), and the run stops long before
  its first evaluation point."""
  reported = []
  report = training.Run.report
  monkeypatch.setattr(
    training.Run,
    'report',
    lambda self, step, **kw: (reported.append(step), report(self, step, **kw)),
  )
  first_bad = []
  for eval_every in (1, 1000):
    config = smoke_config(data_dir, train_steps=2000, eval_every=eval_every)
    config.optimizer.name = 'sgd'
    config.optimizer.learning_rate = 1e12
    reported.clear()
    with pytest.raises(training.NonFiniteLossError) as error:
      training.train_and_evaluate(config, str(tmp_path / str(eval_every)), show_progress=False)
    first_bad.append(int(re.search(r'at step (\d+)', str(error.value)).group(1)))
    assert max(reported) < 200  # Stopped well before step 1000.
  assert first_bad == [2, 2]


# --- the command line: one line, exit status 2 for bad input, 1 for a failed run ----------------
def _train(*flags_, timeout=300):
  return subprocess.run(
    [sys.executable, '-m', 'experiments.train', *flags_],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def _last_line(result) -> str:
  return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
  'flags_, line',
  [
    (['--config.foo=1'], r'error: foo: unknown field\. Allowed fields: algorithm, '),
    (['--config.workerz=2'], r'error: workerz: unknown field\. Did you mean workers\?'),
    (
      ['--config.optimizer.kwargs.bar=1'],
      r'error: optimizer\.kwargs\.bar: unknown field\. Allowed optimizer\.kwargs fields: none',
    ),
    (
      ['--config.optimizer.learnin_rate=1'],
      r'error: optimizer\.learnin_rate: unknown field\. Did you mean optimizer\.learning_rate\?',
    ),
    (['--config.seed.x=1'], r'error: seed\.x: seed is a value, not a section'),
    (
      ['--config.seed=abc'],
      r"error: seed: invalid literal for int\(\) with base 10: 'abc' "
      r'\(--config\.seed=abc\)',
    ),
    (['--config.seed=-1'], r'error: seed: must be an integer in \[0, 4294967295\], got -1\.'),
    (
      ['--config.dataset=mnist1d/7k'],
      r"error: dataset: 'mnist1d/7k': mnist1d has no config "
      r"'7k'; allowed: mnist1d/50k, mnist1d/5k\.",
    ),
    (['--nosuchflag=1'], r"error: Unknown command line flag 'nosuchflag'"),
    (['extra'], r'error: unexpected arguments: extra'),
  ],
)
def test_bad_command_lines_are_one_line_with_status_2(data_dir, tmp_path, flags_, line):
  result = _train(
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={tmp_path}/run',
    f'--config.data_dir={data_dir}',
    *flags_,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert re.fullmatch(line + '.*', _last_line(result)), _last_line(result)
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
  'config, line',
  [
    (
      'experiments/configs/nope.py',
      "error: --config: no config file 'experiments/configs/nope.py'.",
    ),
    (
      'experiments/configs/default.py:smok',
      'error: --config=experiments/configs/default.py:'
      'smok: config variant \'smok\': allowed are "", '
      '"smoke", "lm", "lm_smoke" (comma-separated).',
    ),
  ],
)
def test_a_missing_config_file_or_variant_is_one_line(tmp_path, config, line):
  result = _train(f'--config={config}', f'--workdir={tmp_path}/run')
  assert result.returncode == 2 and _last_line(result) == line, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


def test_verbose_adds_the_traceback(data_dir, tmp_path):
  result = _train(
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={tmp_path}/run',
    f'--config.data_dir={data_dir}',
    '--config.eval_batch_size=0',
    '--verbose',
  )
  assert result.returncode == 2
  assert 'Traceback' in result.stderr
  assert _last_line(result) == 'error: eval_batch_size: must be an integer >= 1, got 0.'


def test_a_failed_run_is_status_1_with_its_traceback_in_the_workdir(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  result = _train(
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
    '--config.optimizer.name=sgd',
    '--config.optimizer.learning_rate=1e12',
    '--config.eval_every=1000',
    '--config.train_steps=2000',
  )
  assert result.returncode == 1, result.stderr[-2000:]
  assert _last_line(result) == (
    f'error: NonFiniteLossError: training loss became nan at step 2; lower '
    f'optimizer.learning_rate or check the data. (traceback in {workdir}/error.log)'
  )
  assert 'Traceback' not in result.stderr
  assert 'NonFiniteLossError' in (workdir / 'error.log').read_text()
  # The workdir now holds an unfinished run: a new run is refused, naming what to do.
  again = _train(
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
  )
  assert again.returncode == 2
  assert _last_line(again).startswith(f'error: workdir: {workdir} holds an unfinished run')
  assert 'pass --overwrite' in _last_line(again)
  # --overwrite replaces every file of the failed run.
  replaced = _train(
    '--config=experiments/configs/default.py:smoke',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
    '--config.train_steps=2',
    '--config.eval_every=2',
    '--overwrite',
  )
  assert replaced.returncode == 0, replaced.stderr[-2000:]
  assert sorted(os.listdir(workdir)) == ['curves.png', 'metrics.jsonl', 'summary.json']
