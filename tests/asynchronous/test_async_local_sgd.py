"""`async_local_sgd`: a virtual-clock run, one worker equal to sequential AdamW, bad input."""

import json

import numpy as np
import pytest

from experiments.configs import async_local_sgd
from jaxsgd import training

EXPLICIT = {'forward': 1e-3, 'backward': 2e-3, 'update': 2e-4}


def config(data_dir, **overrides):
  c = async_local_sgd.get_config('smoke')
  c.data_dir = data_dir
  c.cost.calibrate = False
  c.cost.compute.update(EXPLICIT)
  for field, value in overrides.items():
    parent, _, leaf = field.rpartition('.')
    (c[parent] if parent else c)[leaf] = value
  return c


def records(workdir):
  return [json.loads(line) for line in open(workdir / 'metrics.jsonl')]


def test_virtual_run_learns_with_stale_pushes(data_dir, tmp_path):
  c = config(data_dir, workers=3, train_steps=16, eval_every=8, **{'algorithm.inner_steps': 2})
  summary = training.train_and_evaluate(c, str(tmp_path), show_progress=False)
  got = records(tmp_path)
  assert [r['step'] for r in got] == [8, 16]
  assert got[-1]['test_loss'] < got[0]['test_loss'] < np.log(10)
  # Each server update is one worker's H = 2 batches.
  assert got[-1]['samples'] == 16 * 2 * c.batch_size
  # Equal-speed workers: after the first round every push is M − 1 = 2 updates stale.
  assert max(map(int, summary['staleness_histogram'])) == 2
  assert summary['inner_steps'] == 2 and summary['workers'] == 3


def test_one_worker_without_outer_momentum_is_sequential_adamw(data_dir, tmp_path):
  # M = 1, ε = 1, β = 0, N = 1: θ ← θ − (θ − θ_local) = θ_local, the worker's AdamW state
  # carried over: 10 pushes of H = 2 steps are `bp` for 20 steps on the same batches,
  # up to the rounding of θ − (θ − θ_local).
  ours = config(
    data_dir,
    workers=1,
    train_steps=10,
    eval_every=10,
    **{
      'algorithm.inner_steps': 2,
      'algorithm.outer_learning_rate': 1.0,
      'algorithm.outer_momentum': 0.0,
    },
  )
  training.train_and_evaluate(ours, str(tmp_path / 'ours'), show_progress=False)
  bp = async_local_sgd.get_config('smoke')
  bp.data_dir, bp.algorithm, bp.clock = data_dir, {'name': 'bp'}, 'real'
  bp.train_steps, bp.eval_every, bp.workers = 20, 20, 1
  training.train_and_evaluate(bp, str(tmp_path / 'bp'), show_progress=False)
  a, b = records(tmp_path / 'ours')[-1], records(tmp_path / 'bp')[-1]
  assert a['samples'] == b['samples']
  np.testing.assert_allclose(a['test_loss'], b['test_loss'], rtol=1e-5)


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('algorithm.inner_steps', 0, 'algorithm.inner_steps: must be a positive integer'),
    ('algorithm.outer_momentum', 1.0, 'algorithm.outer_momentum: must be >= 0.0'),
    ('algorithm.momentum_every', -1, 'algorithm.momentum_every: must be an integer >= 0'),
    ('algorithm.outer_lr', 0.5, 'algorithm.outer_lr: unknown field. Allowed: inner_steps'),
  ],
)
def test_bad_input_names_the_field(field, value, message, data_dir, tmp_path):
  with pytest.raises(ValueError, match=message):
    training.train_and_evaluate(config(data_dir, **{field: value}), str(tmp_path))
