"""The experiment: the smoke config trains end to end; bad configs are refused early."""

import json
import os
import subprocess
import sys

import pytest

from experiments.configs import default
from jaxsgd import training

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
  assert summary['time_to_target']['step'] in (20, 40, 60)
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


def test_command_line_binary_with_overrides(data_dir, tmp_path):
  """`python -m experiments.train` with `:smoke` and `--config.field=` overrides."""
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.train',
      '--config=experiments/configs/default.py:smoke',
      f'--workdir={tmp_path}',
      '--config.dataset=digits',
      '--config.train_steps=30',
      '--config.eval_every=30',
      f'--config.data_dir={data_dir}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'final test accuracy' in result.stdout
  record = json.loads(open(tmp_path / 'metrics.jsonl').read().splitlines()[-1])
  assert record['step'] == 30
  assert json.load(open(tmp_path / 'summary.json'))['config']['dataset'] == 'digits'


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
