"""The asynchronous algorithms as experiments: smoke runs on both clocks, bp equivalence,
determinism, failure injection and bad input."""

import importlib
import json

import jax
import numpy as np
import pytest

from experiments.configs import default
from jaxsgd import training
from jaxsgd.algorithms import clocks
from jaxsgd.algorithms.settings import shared_settings

NAMES = ('asgd', 'dcasgd', 'lppsgd', 'pdasgd')
EXPLICIT = {
  'calibrate': False,
  'straggler_std': 0.3,
  'compute': {'forward': 1e-3, 'backward': 2e-3, 'update': 2e-4},
}


def smoke(name, data_dir, **overrides):
  config = importlib.import_module(f'experiments.configs.{name}').get_config('smoke')
  config.data_dir = data_dir
  for field, value in overrides.items():
    parent, _, leaf = field.rpartition('.')
    (config[parent] if parent else config)[leaf] = value
  return config


def explicit_costs(config, **cost):
  config.cost.update({k: v for k, v in {**EXPLICIT, **cost}.items() if k != 'compute'})
  config.cost.compute.update(EXPLICIT['compute'])
  return config


def records(workdir):
  return [json.loads(line) for line in open(workdir / 'metrics.jsonl')]


@pytest.mark.parametrize('clock', ['virtual', 'real'])
@pytest.mark.parametrize('name', NAMES)
def test_smoke_config_learns_and_writes_its_files(name, clock, data_dir, tmp_path):
  summary = training.train_and_evaluate(
    smoke(name, data_dir, clock=clock), str(tmp_path), show_progress=False
  )
  got = records(tmp_path)
  assert [r['step'] for r in got] == [20, 40, 60]
  # Learning: the training loss of the last 20 steps falls below that of the first 20,
  # and so does the test loss (1,000 examples). (LPP-SGD on the real clock once failed
  # both: its replicas on devices 1-2 were compiling while device 0's took every step;
  # `clocks.warm_up` now compiles first.)
  assert got[-1]['train_loss'] < got[0]['train_loss'] and got[-1]['test_loss'] < 2.3
  assert got[-1]['test_loss'] < got[0]['test_loss']
  assert ('sim_time' in got[-1]) == (clock == 'virtual') and summary['clock'] == clock
  assert 'staleness_mean' in got[-1] and summary['mean_staleness'] >= 0
  assert sum(summary['staleness_histogram'].values()) >= 60
  assert summary['failed_workers'] == []
  for file in ('trace.json', 'staleness.png', 'summary.json', 'curves.png'):
    assert (tmp_path / file).exists(), file
  with np.load(tmp_path / 'staleness.npz') as every:  # the histogram's data, update by update
    counts = np.bincount(np.concatenate([every[name] for name in every.files]))
  assert {v: int(n) for v, n in enumerate(counts) if n} == summary['staleness_histogram']
  if clock == 'virtual':
    assert summary['backward_forward_ratio'] > 0 and got[-1]['sim_time'] > got[0]['sim_time']


def test_warm_up_compiles_each_task_where_its_arguments_are_and_where_its_kind_runs():
  square, cube = jax.jit(lambda x: x * x), jax.jit(lambda x: x * x * x)
  x = jax.device_put(np.arange(3.0), jax.devices()[0])
  tasks = clocks.Tasks(
    calls=lambda: {(0, 'forward'): (square, (x,)), (0, 'update'): (cube, (x,))},
    model=None,
    batch_size=1,
    split=(),
    name='',
  )
  assert square._cache_size() == cube._cache_size() == 0
  d = jax.devices()
  clocks.warm_up(tasks, {'forward': [d[1], d[2], d[1]], 'backward': [d[3]]})
  assert square._cache_size() == 3  # devices 0 (the sample's), 1 and 2: one program each
  assert cube._cache_size() == 1  # device 0 only: no update runs elsewhere


@pytest.mark.parametrize('name', NAMES)
def test_the_real_clock_compiles_before_it_starts_where_each_task_kind_runs(
  name, data_dir, tmp_path, monkeypatch
):
  """Unwarmed, LPP-SGD's replicas on devices 1 and 2 once took none of 60 steps: their
  lanes were compiling while device 0's workers took every step."""
  warmed, warm_up = [], clocks.warm_up

  def recording(tasks, devices):
    warmed.append(devices)
    warm_up(tasks, devices)

  monkeypatch.setattr(clocks, 'warm_up', recording)
  config = smoke(name, data_dir, clock='real', train_steps=4, eval_every=4)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  shared, a = shared_settings(config), config.algorithm
  if name == 'lppsgd':  # each replica's device runs all three kinds
    replicas = clocks.lane_devices(shared, a.devices)
    expected = dict.fromkeys(('forward', 'backward', 'update'), replicas)
  elif name == 'pdasgd':  # the shared model, then the forward and the backward workers
    lanes = clocks.lane_devices(shared, 1 + a.n_fwd + a.n_bwd)
    expected = {
      'forward': lanes[1 : 1 + a.n_fwd],
      'backward': lanes[1 + a.n_fwd :],
      'update': lanes[:1],
    }
  else:  # the server, then the workers
    lanes = clocks.lane_devices(shared, 1 + config.workers)
    expected = {'forward': lanes[1:], 'backward': lanes[1:], 'update': lanes[:1]}
  assert warmed == [expected]
  assert len({device for devices in expected.values() for device in devices}) > 1


def test_one_asgd_worker_reproduces_fused_bp(data_dir, tmp_path):
  """Worker 0 of 1 reads bp's batch stream; the server applies each push at once."""

  def config(name, **overrides):
    c = default.get_config('smoke') if name == 'bp' else smoke(name, data_dir)
    c.data_dir, c.train_steps, c.eval_every = data_dir, 30, 30
    c.model = smoke('asgd', data_dir).model
    c.update(overrides)
    return c

  bp = training.train_and_evaluate(config('bp'), str(tmp_path / 'bp'), show_progress=False)
  asgd = training.train_and_evaluate(
    config('asgd', workers=1), str(tmp_path / 'asgd'), show_progress=False
  )
  for key in ('train_loss', 'test_loss', 'test_accuracy'):
    assert asgd['final'][key] == bp['final'][key], key
  assert asgd['staleness_histogram'] == {0: 30}


def test_virtual_runs_are_bit_identical_run_to_run(data_dir, tmp_path):
  config = explicit_costs(
    smoke(
      'pdasgd',
      data_dir,
      train_steps=20,
      eval_every=10,
      **{'algorithm.n_fwd': 2, 'algorithm.n_bwd': 3},
    )
  )
  summaries = [
    training.train_and_evaluate(config, str(tmp_path / run), show_progress=False)
    for run in ('a', 'b')
  ]
  drop_wall = lambda rs: [{k: v for k, v in r.items() if k != 'wall_time'} for r in rs]
  assert drop_wall(records(tmp_path / 'a')) == drop_wall(records(tmp_path / 'b'))
  assert summaries[0]['staleness'] == summaries[1]['staleness']
  assert summaries[0]['backward_forward_ratio'] == 2.0  # The given costs.


def test_failure_injection_from_the_config(data_dir, tmp_path):
  config = explicit_costs(
    smoke('asgd', data_dir), failures=((2, 0.02),), speeds=(1.0, 1.0, 0.5, 1.0)
  )
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  [failed] = summary['failed_workers']
  assert failed['worker'] == 'worker 2' and failed['last_push'] < 0.02
  assert summary['final']['step'] == 60 and summary['final']['sim_time'] > 0.02
  assert summary['pushes_per_worker']['worker 2'] < summary['pushes_per_worker']['worker 0']


@pytest.mark.parametrize(
  'name,overrides,message',
  [
    ('asgd', {'workers': 0}, r'workers: must be a positive integer, got 0'),
    (
      'asgd',
      {'algorithm.staleness_lr': 'linear'},
      r"algorithm.staleness_lr: 'linear'; allowed: none, inverse, inverse_sqrt",
    ),
    (
      'asgd',
      {'cost.speeds': (1.0, 0.0, 1.0, 1.0)},
      r'cost.speeds: must be > 0, got 0.0 for lane 1',
    ),
    ('asgd', {'cost.speeds': (1.0, 2.0)}, r'cost.speeds: 2 values for 4 workers'),
    (
      'asgd',
      {'cost.failures': ((7, 1.0),)},
      r'cost.failures: worker 7 is not a worker in \[0, 4\)',
    ),
    ('asgd', {'stages': 2}, r'stages: asgd computes whole-model gradients on each worker'),
    ('dcasgd', {'algorithm.lambda0': -1.0}, r'algorithm.lambda0: must be a number >= 0'),
    (
      'dcasgd',
      {'algorithm': {'name': 'dcasgd', 'adaptive': 'yes'}},
      r"algorithm.adaptive: True \(DC-ASGD-a\) or False \(DC-ASGD-c\), got 'yes'",
    ),
    ('lppsgd', {'algorithm.averaging_freq': 0}, r'algorithm.averaging_freq: must be a positive'),
    ('lppsgd', {'algorithm.devices': 0}, r'algorithm.devices: must be a positive integer'),
    (
      'lppsgd',
      {'algorithm.workers_per_device': -1},
      r'algorithm.workers_per_device: must be a positive integer',
    ),
    ('pdasgd', {'algorithm.n_fwd': 0}, r'algorithm.n_fwd: must be a positive integer, got 0'),
    ('pdasgd', {'algorithm.n_bwd': 0}, r'algorithm.n_bwd: must be a positive integer, got 0'),
    (
      'pdasgd',
      {'algorithm.updates': 'eager'},
      r"algorithm.updates: 'eager'; allowed: layer, block",
    ),
    ('pdasgd', {'stages': 9}, r"stages: 9 stages asked for, but model 'mlp' has only 4 layers"),
    (
      'pdasgd',
      {'cost.speeds': (1.0, -2.0, 1.0)},
      r'cost.speeds: must be > 0, got -2.0 for lane 1',
    ),
  ],
)
def test_bad_input_is_refused_before_anything_compiles(
  name, overrides, message, data_dir, tmp_path
):
  with pytest.raises(ValueError, match=message):
    training.train_and_evaluate(
      smoke(name, data_dir, **overrides), str(tmp_path), show_progress=False
    )
  assert not (tmp_path / 'metrics.jsonl').exists()


def test_a_nan_loss_stops_the_run_naming_the_worker(data_dir, tmp_path):
  config = smoke('asgd', data_dir, **{'optimizer.name': 'sgd', 'optimizer.learning_rate': 1e12})
  with pytest.raises(
    training.NonFiniteLossError,
    match=r'training loss became (nan|inf) at step \d+ at stage/worker worker \d',
  ):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
