"""Bad input, every family: refused with one line naming the field, before anything
compiles or is written.

Each case of the table starts from a family's smoke config, changes a few fields and
asserts that `train_and_evaluate` refuses it with a message that *starts* with the
field's name (`<field>: ...`) and says what is allowed, that XLA compiled nothing
(`jax.monitoring` compile events) and that the workdir was not even created. Only
validation runs: no case trains.
"""

import math
import os
import re
import subprocess
import sys

import jax
import pytest

from experiments import suites
from jaxsgd import launch
from jaxsgd.algorithms import settings
from jaxsgd.training import files
from jaxsgd.training import limits
from jaxsgd.training import train_and_evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
  'bp': 'default',
  'ddg': 'ddg',
  'local': 'local',
  'ssgd': 'ssgd',
  'local_sgd': 'dasgd',
  'dasgd': 'dasgd',
  'diloco': 'dasgd',
  'asgd': 'asgd',
  'dcasgd': 'dcasgd',
  'lppsgd': 'lppsgd',
  'pdasgd': 'pdasgd',
}
TINY_MEMORY = 2**30  # What `limits` is told is available in the `memory` cases.

# (family, {field: value}, the field the message must start with, a regex it must contain)
CASES = [
  # --- top-level fields (every family shares them; bp here) ---
  ('bp', {'workerz': 4}, 'workerz', r'unknown field\. Did you mean workers\?'),
  ('bp', {'seed': -1}, 'seed', r'\[0, 4294967295\], got -1'),
  ('bp', {'seed': 2**70}, 'seed', r'\[0, 4294967295\]'),
  ('bp', {'seed': 'abc'}, 'seed', r'integer'),
  ('bp', {'seed': 1.5}, 'seed', r'integer'),
  ('bp', {'eval_batch_size': 0}, 'eval_batch_size', r'integer >= 1, got 0'),
  ('bp', {'eval_batch_size': -5}, 'eval_batch_size', r'integer >= 1, got -5'),
  ('bp', {'eval_every': 0}, 'eval_every', r'integer >= 1'),
  ('bp', {'eval_every': True}, 'eval_every', r'integer >= 1'),
  ('bp', {'batch_size': 0}, 'batch_size', r'positive integer, got 0'),
  (
    'bp',
    {'batch_size': 5000},
    'batch_size',
    r'larger than the mnist1d/5k training split '
    r'\(4000 examples\).*<= 4000',
  ),
  ('bp', {'train_steps': 0}, 'train_steps', r'positive integer'),
  ('bp', {'train_steps': 1.5}, 'train_steps', r'positive integer'),
  ('bp', {'clock': 'wall'}, 'clock', r'allowed: real, virtual'),
  ('bp', {'dataset': 'mnist1d/7k'}, 'dataset', r'allowed: mnist1d/50k, mnist1d/5k'),
  ('bp', {'dataset': 'imagenet_in_a_zip'}, 'dataset', r'unknown dataset.*Allowed: offline'),
  ('bp', {'dataset': 7}, 'dataset', r'a dataset name expected'),
  ('bp', {'data_dir': 3}, 'data_dir', r'a directory path'),
  ('bp', {'tensorboard': 'yes'}, 'tensorboard', r'True or False'),
  ('bp', {'model.name': 'vgg'}, 'model.name', r"unknown model 'vgg'; allowed: mlp, cnn"),
  (
    'bp',
    {'model.name': 'mlp', 'model.hidden': (0,)},
    'model.hidden',
    r'positive integers.*got \(0,\)',
  ),
  ('bp', {'model.name': 'mlp', 'model.hidden': ()}, 'model.hidden', r'non-empty'),
  (
    'bp',
    {'model.name': 'mlp', 'model.hiden': (8,)},
    'model.hiden',
    r'Did you mean model\.hidden\?',
  ),
  ('bp', {'model.channels': (32, -1)}, 'model.channels', r'positive integers'),
  ('bp', {'model.kernel': 0}, 'model.kernel', r'positive integer'),
  ('bp', {'model.name': 'resnet20'}, 'model.name', r'needs images of shape \(H, W, C\)'),
  ('bp', {'stages': 0}, 'stages', r'positive integer'),
  ('bp', {'stages': 9}, 'stages', r"model 'cnn' has only 4 layers"),
  ('bp', {'target_accuracy': 1.5}, 'target_accuracy', r'<= 1\.0'),
  ('bp', {'target_accuracy': 0.0}, 'target_accuracy', r'> 0\.0'),
  ('bp', {'workers': 4}, 'workers', r'bp does not read `workers`'),
  ('bp', {'workers': 0}, 'workers', r'positive integer'),
  ('bp', {'algorithm.name': 'sgd_plus'}, 'algorithm.name', r'allowed: bp, ddg, local'),
  ('bp', {'algorithm.foo': 1}, 'algorithm.foo', r'unknown field'),
  ('bp', {'optimizer.name': 'adamax_pro'}, 'optimizer.name', r'not an optax optimizer'),
  ('bp', {'optimizer.learning_rate': math.inf}, 'optimizer.learning_rate', r'finite'),
  ('bp', {'optimizer.learning_rate': math.nan}, 'optimizer.learning_rate', r'finite'),
  ('bp', {'optimizer.learning_rate': -0.1}, 'optimizer.learning_rate', r'> 0'),
  ('bp', {'optimizer.weight_decay': math.nan}, 'optimizer.weight_decay', r'finite'),
  ('bp', {'optimizer.weight_decay': -1.0}, 'optimizer.weight_decay', r'>= 0'),
  ('bp', {'optimizer.schedule': 'linear'}, 'optimizer.schedule', r'allowed'),
  ('bp', {'optimizer.kwargs': {'momentun': 0.9}}, 'optimizer.kwargs', r'do not fit'),
  ('bp', {'optimizer.lr': 0.1}, 'optimizer.lr', r'Did you mean optimizer\.'),
  ('bp', {'cost.link_latency': math.inf}, 'cost.link_latency', r'finite'),
  ('bp', {'cost.link_latency': -1.0}, 'cost.link_latency', r'>= 0'),
  ('bp', {'cost.link_bandwidth': math.nan}, 'cost.link_bandwidth', r'bytes/s >= 0'),
  ('bp', {'cost.straggler_std': -0.5}, 'cost.straggler_std', r'>= 0'),
  ('bp', {'cost.reps': 0}, 'cost.reps', r'positive integer'),
  ('bp', {'cost.seed': -3}, 'cost.seed', r'\[0, 4294967295\]'),
  ('bp', {'cost.bandwith_gbps': 1}, 'cost.bandwith_gbps', r'unknown field'),
  ('bp', {'cost.bandwidth_gbps': 1}, 'cost.bandwidth_gbps', r'renamed; use cost\.link_bandw'),
  (
    'bp',
    {'cost.compute.forwrd': 0.1},
    'cost.compute.forwrd',
    r'Did you mean cost\.compute\.forward\?',
  ),
  ('bp', {'placement.devices': (99,)}, 'placement.devices', r'positions in jax\.devices'),
  (
    'bp',
    {'placement.stage_to_device': (0, 1)},
    'placement.stage_to_device',
    r'2 entries for 1 stages',
  ),
  ('bp', {'placement.foo': 1}, 'placement.foo', r'unknown field'),
  (
    'ddg',
    {'clock': 'real', 'executor': 'processes', 'placement.lanes': 'stage0@moves=gpu'},
    'placement.lanes',
    r"lane 'stage0': moves must be one of auto, device, host, socket, got 'gpu'",
  ),
  (
    'ddg',
    {'clock': 'real', 'executor': 'processes', 'placement.copies': 'idle'},
    'placement.copies',
    r"one of own, auto \(or None: by the executor\) expected, got 'idle'",
  ),
  (
    'ddg',
    {
      'clock': 'real',
      'executor': 'processes',
      'placement.lanes': 'stage0@cores=0; stage1@cores=1@copies=0',
      'placement.copies': 'auto',
    },
    'placement.copies',
    r"'auto' places the copy threads by the run's load, but the placement puts those of "
    r"stage1 \(copies=\.\.\.\); use copies='own'",
  ),
  (
    'ddg',
    {'clock': 'real', 'placement.copies': 'own'},
    'placement.copies',
    r"places lane processes' copy threads; it needs executor='processes' or 'emulated' "
    r"\(got clock='real', executor='in_process'\)",
  ),
  # --- ddg ---
  (
    'ddg',
    {'algorithm.variant': 'paperr'},
    'algorithm.variant',
    r'allowed: paper, stale_graph, recompute',
  ),
  ('ddg', {'algorithm.delay': 2}, 'algorithm.delay', r'unknown field'),
  (
    'ddg',
    {'clock': 'real', 'executor': 'processes', 'cost.device': 'h100'},
    'cost.device',
    r"prices tasks on the virtual clock, or emulated tasks \(executor='emulated'\)",
  ),
  ('ddg', {'stages': 99}, 'stages', r'has only 4 layers'),
  ('ddg', {'workers': 2}, 'workers', r'ddg does not read `workers`'),
  ('ddg', {'cost.speeds': (1.0,)}, 'cost.speeds', r'1 values for 4 stages'),
  ('ddg', {'cost.device_speeds': (1.0, 1.0)}, 'cost.device_speeds', r'renamed; use cost\.speeds'),
  ('ddg', {'cost.speeds': (1.0, 1.0, 0.0, 1.0)}, 'cost.speeds', r'> 0'),
  ('ddg', {'cost.calibrate': False}, 'cost.compute.forward', r'missing'),
  (
    'ddg',
    {
      'cost.calibrate': False,
      'cost.compute.forward': (0.1, 0.1),
      'cost.compute.backward': 0.1,
      'cost.compute.update': 0.1,
    },
    'cost.compute.forward',
    r'2 values for 4 stages',
  ),
  (
    'ddg',
    {
      'cost.calibrate': False,
      'cost.compute.forward': -1.0,
      'cost.compute.backward': 0.1,
      'cost.compute.update': 0.1,
    },
    'cost.compute.forward',
    r'finite number of seconds >= 0',
  ),
  ('ddg', {'cost.calibrate': 'no'}, 'cost.calibrate', r'True or False'),
  # --- local ---
  ('local', {'algorithm.variant': 'bogus'}, 'algorithm.variant', r'allowed: greedy'),
  (
    'local',
    {'algorithm.variant': 'chunked', 'algorithm.chunks': 0},
    'algorithm.chunks',
    r'\[1, stages=4\]',
  ),
  (
    'local',
    {'algorithm.variant': 'chunked', 'algorithm.chunks': 9},
    'algorithm.chunks',
    r'\[1, stages=4\]',
  ),
  (
    'local',
    {'algorithm.variant': 'greedy', 'algorithm.chunks': 3},
    'algorithm.chunks',
    r'only the chunked variant',
  ),
  ('local', {'algorithm.chunks': 0}, 'algorithm.chunks', r'only the chunked variant'),
  ('local', {'algorithm.pipelined': 'yes'}, 'algorithm.pipelined', r'True or False'),
  ('local', {'stages': 5}, 'stages', r'has only 4 layers'),
  ('local', {'cost.failures': ((0, 1.0),)}, 'cost.failures', r'a pipeline has no workers'),
  ('ddg', {'cost.dispatch': 'real'}, 'cost.dispatch', r'renamed; use cost\.host \(a host profile'),
  ('ddg', {'cost.host': '/no/host.json'}, 'cost.host', r"'/no/host.json': no such file; measure"),
  # --- ssgd ---
  ('ssgd', {'workers': 9}, 'workers', r'9 workers need 9 devices, but 8 are visible'),
  ('ssgd', {'stages': 2}, 'stages', r'use stages=1'),
  (
    'ssgd',
    {'algorithm.global_batch_size': 30},
    'algorithm.global_batch_size',
    r'cannot be split evenly over workers=4',
  ),
  (
    'ssgd',
    {'algorithm.global_batch_size': 8000},
    'algorithm.global_batch_size',
    r'shard of 1000 examples',
  ),
  ('ssgd', {'batch_size': 1001}, 'batch_size', r'shard of 1000 examples'),
  ('ssgd', {'algorithm.data_sharding': 'x'}, 'algorithm.data_sharding', r'shard, stream'),
  ('ssgd', {'cost.speeds': (1.0,) * 4}, 'cost.speeds', r'lock-step SPMD'),
  ('dasgd', {'cost.failures': ((0, 1.0),)}, 'cost.failures', r'lock-step SPMD'),
  ('ssgd', {'algorithm.stacked': 'yes'}, 'algorithm.stacked', r'True or False'),
  # --- local_sgd ---
  ('local_sgd', {'algorithm.delay': 1}, 'algorithm.delay', r'local_sgd averages without'),
  ('local_sgd', {'algorithm.period': 0, 'algorithm.delay': 0}, 'algorithm.period', r'integer >= 1'),
  ('local_sgd', {'algorithm.periodd': 8}, 'algorithm.periodd', r'Did you mean algorithm\.period\?'),
  # --- dasgd ---
  (
    'dasgd',
    {'algorithm.delay': 4, 'algorithm.period': 4},
    'algorithm.delay',
    r'must be < algorithm\.period',
  ),
  ('dasgd', {'algorithm.delay': -1}, 'algorithm.delay', r'integer >= 0'),
  ('dasgd', {'algorithm.merge': 'avg'}, 'algorithm.merge', r'keep_local, mix'),
  ('dasgd', {'algorithm.mix': 1.5}, 'algorithm.mix', r'<= 1\.0'),
  ('dasgd', {'algorithm.mix': math.nan}, 'algorithm.mix', r'finite'),
  # --- diloco ---
  ('diloco', {'algorithm.outer.name': 'nope'}, 'algorithm.outer.name', r'not an optax'),
  ('diloco', {'algorithm.outer.learning_rate': -1.0}, 'algorithm.outer.learning_rate', '> 0'),
  ('diloco', {'algorithm.outer.lr': 1.0}, 'algorithm.outer.lr', r'unknown field'),
  # --- asgd ---
  (
    'asgd',
    {'workers': 100_000},
    'workers',
    r'100000 workers need at least .* GiB of '
    r'per-worker state.*more than the 1\.0 GiB',
  ),
  ('asgd', {'workers': 10_000_000}, 'workers', r'GiB of per-worker state'),
  ('asgd', {'clock': 'real', 'workers': 2000}, 'workers', r'2001 threads .* more than 512'),
  (
    'asgd',
    {'algorithm.staleness_lr': 'linear'},
    'algorithm.staleness_lr',
    r'allowed: none, inverse',
  ),
  ('asgd', {'stages': 2}, 'stages', r'whole-model gradients'),
  ('asgd', {'cost.speeds': (1.0, 1.0)}, 'cost.speeds', r'2 values for 4'),
  ('asgd', {'cost.speeds': (1.0, 1.0, 1.0, -1.0)}, 'cost.speeds', r'> 0'),
  ('asgd', {'cost.failures': ((9, 1.0),)}, 'cost.failures', r'worker 9 is not a worker'),
  ('asgd', {'cost.failures': ((0, -1.0),)}, 'cost.failures (seconds)', r'>= 0'),
  ('asgd', {'cost.failures': (3,)}, 'cost.failures', r'\(worker, seconds\) pairs'),
  ('asgd', {'cost.worker_speeds': (1.0,)}, 'cost.worker_speeds', r'renamed; use cost\.speeds'),
  (
    'asgd',
    {'cost.calibrate': False, 'cost.compute.forward': 0.1},
    'cost.compute.backward',
    r'missing',
  ),
  ('asgd', {'workerz': 8}, 'workerz', r'Did you mean workers\?'),
  # --- dcasgd ---
  ('dcasgd', {'algorithm.lambda0': math.inf}, 'algorithm.lambda0', r'number >= 0'),
  ('dcasgd', {'algorithm.lambda0': -1.0}, 'algorithm.lambda0', r'number >= 0'),
  ('dcasgd', {'algorithm.adaptive': 'yes'}, 'algorithm.adaptive', r'True \(DC-ASGD-a\)'),
  ('dcasgd', {'workers': 0}, 'workers', r'positive integer'),
  ('dcasgd', {'workers': 50_000}, 'workers', r'backups'),
  # --- lppsgd ---
  ('lppsgd', {'algorithm.devices': 0}, 'algorithm.devices', r'positive integer'),
  (
    'lppsgd',
    {'algorithm.workers_per_device': 0},
    'algorithm.workers_per_device',
    r'positive integer',
  ),
  ('lppsgd', {'algorithm.averaging_freq': 0}, 'algorithm.averaging_freq', r'positive'),
  ('lppsgd', {'algorithm.warmup_steps': -1}, 'algorithm.warmup_steps', r'integer >= 0'),
  ('lppsgd', {'workers': 2}, 'workers', r'lppsgd does not read `workers`'),
  (
    'lppsgd',
    {'clock': 'real', 'algorithm.devices': 100, 'algorithm.workers_per_device': 100},
    'algorithm.devices x algorithm.workers_per_device',
    r'10000 threads',
  ),
  ('lppsgd', {'stages': 2}, 'stages', r'whole-model gradients'),
  # --- pdasgd ---
  ('pdasgd', {'algorithm.n_fwd': 0}, 'algorithm.n_fwd', r'positive integer'),
  ('pdasgd', {'algorithm.n_bwd': 0}, 'algorithm.n_bwd', r'positive integer'),
  ('pdasgd', {'algorithm.updates': 'all'}, 'algorithm.updates', r'allowed: '),
  ('pdasgd', {'algorithm.max_inflight': 0}, 'algorithm.max_inflight', r'positive integer'),
  ('pdasgd', {'stages': 99}, 'stages', r'has only 4 layers'),
  ('pdasgd', {'workers': 3}, 'workers', r'pdasgd does not read `workers`'),
  (
    'pdasgd',
    {'clock': 'real', 'algorithm.n_fwd': 600},
    'algorithm.n_fwd + algorithm.n_bwd',
    r'603 threads',
  ),
]


def case_id(case) -> str:
  family, fields, field, _ = case
  return f'{family}-{field}-' + '-'.join(f'{k}={v!r}'[:24] for k, v in fields.items())


def smoke_config(family: str, data_dir: str):
  config = suites.load_config(f'experiments/configs/{CONFIGS[family]}.py', 'smoke')
  config.data_dir = data_dir
  config.algorithm.name = family
  return config


def set_fields(config, fields: dict) -> None:
  """Sets dotted fields, whatever their type (a user's config file could)."""
  for dotted, value in fields.items():
    parent, _, leaf = dotted.rpartition('.')
    node = config
    for part in filter(None, parent.split('.')):
      node = node[part]
    with node.ignore_type():
      node[leaf] = value


@pytest.fixture
def compiles():
  """The XLA compilations while the test runs."""
  events = []
  listener = lambda event, *_, **__: events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  yield events
  jax.monitoring.unregister_event_duration_listener(listener)


# A compilation, or one the persistent cache served (`jaxsgd.compilation_cache`).
COMPILED = (
  '/jax/core/compile/backend_compile_duration',
  '/jax/compilation_cache/cache_retrieval_time_sec',
)


def _compiled(events):
  return [e for e in events if e in COMPILED]


@pytest.fixture(autouse=True)
def little_memory(monkeypatch):
  """The memory estimate compares with a fixed 1 GiB, so the cases do not depend on the
  machine (the defaults need far less)."""
  monkeypatch.setattr(limits, 'available_bytes', lambda: TINY_MEMORY)


def test_the_table_covers_every_family_and_enough_cases():
  assert len(CASES) >= 90
  assert {family for family, *_ in CASES} == set(CONFIGS)


@pytest.mark.parametrize('case', CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_refused_naming_the_field(case, data_dir, tmp_path, compiles):
  family, fields, field, pattern = case
  config = smoke_config(family, data_dir)
  set_fields(config, fields)
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError) as error:
    train_and_evaluate(config, str(workdir), show_progress=False)
  message = str(error.value)
  assert message.startswith(f'{field}: '), message
  assert re.search(pattern, message), message
  assert '\n' not in message
  assert not _compiled(compiles)
  assert not workdir.exists()  # Not even created: nothing written.
  assert not list(tmp_path.iterdir())


def test_a_batch_larger_than_the_data_is_refused_before_the_model_is_built(
  data_dir, tmp_path, monkeypatch
):
  from jaxsgd.training import loop  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(loop, 'build_model', lambda *_: pytest.fail('model built'))
  config = smoke_config('asgd', data_dir)
  config.batch_size = 4001
  with pytest.raises(ValueError, match=r'^batch_size: 4001 is larger than the mnist1d/5k'):
    train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)


def test_the_default_configs_pass_the_limits(data_dir, tmp_path, monkeypatch):
  """The limits do not refuse what the smoke configs run (with the machine's memory)."""
  monkeypatch.undo()
  from jaxsgd import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxsgd.training import loop  # pylint: disable=g-import-not-at-top
  from jaxsgd import algorithms  # pylint: disable=g-import-not-at-top

  for family in CONFIGS:
    config = smoke_config(family, data_dir)
    dataset = data_lib.load(config.dataset, data_dir)
    model = loop.build_model(config, dataset)
    settings = algorithms.get(family).validate(config, model)
    limits.check(family, settings, model, dataset)


def test_memory_estimate_hand_computed(data_dir):
  """asgd, 4 workers, MLP 40-64-64-64-10 (11,594 parameters, 46,376 bytes), SGD (a step
  count), 4,000 training examples: 4 streams of 2 x 8 x 4000 bytes, 4 workers of (3
  copies of the weights + overhead), 1 server copy of the weights and SGD's state."""
  from jaxsgd import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxsgd.training import loop  # pylint: disable=g-import-not-at-top
  from jaxsgd import algorithms  # pylint: disable=g-import-not-at-top

  config = smoke_config('asgd', data_dir)
  config.optimizer.name = 'sgd'
  config.optimizer.schedule = 'constant'
  dataset = data_lib.load(config.dataset, data_dir)
  model = loop.build_model(config, dataset)
  settings = algorithms.get('asgd').validate(config, model)
  params = 4 * (40 * 64 + 64 + 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10)
  assert params == 46_376
  # Variables = parameters (no batch statistics); SGD's state is its int32 step count.
  assert limits.model_bytes(model, settings.shared) == (params, params, 4)
  fp, total = limits.estimate('asgd', settings, model, dataset.num_train)
  assert (fp.workers, fp.streams, fp.replicas, fp.threads) == (4, 4, 1, 0)
  assert total == (4 * 2 * 8 * 4000 + 4 * (3 * params + 256 * 1024) + params + 4)
  # DC-ASGD also keeps a backup of each worker's weights on the server.
  config.algorithm = suites.load_config('experiments/configs/dcasgd.py', 'smoke').algorithm
  dc = algorithms.get('dcasgd').validate(config, model)
  assert limits.estimate('dcasgd', dc, model, dataset.num_train)[1] == total + 4 * params


# --- the workdir ---------------------------------------------------------------------------
def _finished_run(workdir, config):
  os.makedirs(workdir)
  files.write_json(os.path.join(workdir, 'summary.json'), {'config': config.to_dict()})
  files.atomic_write(os.path.join(workdir, 'metrics.jsonl'), '{"step": 1}\n')


@pytest.mark.parametrize('same', [True, False])
def test_a_workdir_holding_a_finished_run_is_refused(data_dir, tmp_path, compiles, same):
  config = smoke_config('bp', data_dir)
  earlier = smoke_config('bp', data_dir)
  if not same:
    earlier.seed = 7
  workdir = str(tmp_path / 'run')
  _finished_run(workdir, earlier)
  before = sorted(os.listdir(workdir))
  what = 'this same config' if same else r'a different config \(algorithm bp, .* seed 7'
  with pytest.raises(
    ValueError,
    match=rf'^workdir: {workdir} holds the finished results of '
    rf'a run of {what}.*choose a new workdir, delete '
    rf'this one, or pass --overwrite',
  ):
    train_and_evaluate(config, workdir, show_progress=False)
  assert sorted(os.listdir(workdir)) == before  # Untouched; the lock file is gone again.
  assert not _compiled(compiles)


def test_an_unfinished_run_is_refused(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'metrics.jsonl').write_text('{"step": 20}\n')
  (workdir / 'notes.txt').write_text('mine')
  with pytest.raises(ValueError, match=r'^workdir: .* holds an unfinished run'):
    train_and_evaluate(smoke_config('bp', data_dir), str(workdir), show_progress=False)
  assert sorted(os.listdir(workdir)) == ['metrics.jsonl', 'notes.txt']


def test_a_workdir_that_is_a_file_is_refused(data_dir, tmp_path):
  path = tmp_path / 'file'
  path.write_text('x')
  with pytest.raises(ValueError, match=r'^workdir: .* exists and is not a directory'):
    train_and_evaluate(smoke_config('bp', data_dir), str(path), show_progress=False)


def test_a_locked_workdir_is_refused_before_loading_data(tmp_path, compiles, monkeypatch):
  from jaxsgd import data as data_lib  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(data_lib, 'load', lambda *a, **k: pytest.fail('data loaded'))
  workdir = str(tmp_path / 'run')
  config = smoke_config('bp', str(tmp_path / 'no_data'))
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys, time\nfrom jaxsgd.training import files\n'
      'files.WorkdirLock(sys.argv[1]).acquire()\nprint("locked", flush=True)\n'
      'time.sleep(120)',
      workdir,
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'locked'
    with pytest.raises(
      files.WorkdirLockedError,
      match=rf'workdir {workdir} is in use by another run \(pid {holder.pid}',
    ):
      train_and_evaluate(config, workdir, show_progress=False)
  finally:
    holder.kill()
    holder.wait()
  assert not _compiled(compiles)
  assert not os.path.exists(os.path.join(tmp_path, 'no_data'))


def test_a_refused_overwrite_keeps_the_earlier_run(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  _finished_run(str(workdir), smoke_config('asgd', data_dir))
  config = smoke_config('bp', data_dir)
  config.seed = -1
  with pytest.raises(ValueError, match=r'^seed: '):
    train_and_evaluate(config, str(workdir), show_progress=False, overwrite=True)
  assert sorted(os.listdir(workdir)) == ['metrics.jsonl', 'summary.json']


def test_overwrite_replaces_every_file_of_the_earlier_run(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  _finished_run(str(workdir), smoke_config('asgd', data_dir))
  for name in ('trace.json', 'staleness.png', 'curves.png', 'error.log'):
    (workdir / name).write_text('stale')
  (workdir / 'notes.txt').write_text('mine')
  config = smoke_config('bp', data_dir)
  config.train_steps = config.eval_every = 2
  train_and_evaluate(config, str(workdir), show_progress=False, overwrite=True)
  assert sorted(os.listdir(workdir)) == ['curves.png', 'metrics.jsonl', 'notes.txt', 'summary.json']
  assert files.read_json(str(workdir / 'summary.json'))['config']['algorithm']['name'] == 'bp'


# --- the launcher ---------------------------------------------------------------------------
@pytest.mark.parametrize(
  'args, flag',
  [
    (['--processes', '0'], '--processes'),
    (['--processes', '2', '--devices_per_process', '0'], '--devices_per_process'),
    (['--processes', '2', '--num_processes', '2', '--first_process_id', '1'], '--first_process_id'),
    (['--processes', '1', '--num_processes', '2', '--first_process_id', '1'], '--coordinator'),
    (['--processes', 'two'], '--processes'),
  ],
)
def test_launcher_bad_arguments_name_the_flag(args, flag, capsys, compiles):
  with pytest.raises(SystemExit) as error:
    launch.parse_args(args + ['--', '--config=x.py'])
  assert error.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert flag in last and last.startswith('python -m jaxsgd.launch: error: ')
  assert not _compiled(compiles)


def test_launcher_needs_a_command():
  with pytest.raises(SystemExit, match=r'the "--" is required'):
    launch.parse_args(['--processes', '2'])
  with pytest.raises(SystemExit):
    launch.parse_args(['--processes', '2', '--'])


def test_launched_bad_config_is_one_line_with_status_2(data_dir, tmp_path):
  """A child refusing its config exits 2; the launcher reports the child's line."""
  workdir = tmp_path / 'run'
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'jaxsgd.launch',
      '--processes',
      '1',
      '--',
      '--config=experiments/configs/asgd.py:smoke',
      f'--workdir={workdir}',
      f'--config.data_dir={data_dir}',
      '--config.seed=-1',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert '[p0] error: seed: must be an integer in [0, 4294967295], got -1.' in result.stdout
  assert result.stderr.strip().splitlines()[-1].rstrip('.') == (
    'jaxsgd.launch: process 0 failed (exit status 2): seed: must be an integer in '
    '[0, 4294967295], got -1'
  )
  assert 'Traceback' not in result.stdout + result.stderr
  assert not workdir.exists()


@pytest.mark.parametrize(
  'running, refused',
  [
    ([], r'none is running \(start one: ray start --head\)'),
    (['10.0.0.1:6379', '10.0.0.2:6379'], r'2 are \(10\.0\.0\.1:6379, 10\.0\.0\.2:6379\); name one'),
  ],
  ids=['none', 'two'],
)
def test_cluster_address_auto_needs_one_cluster_running_here(
  running, refused, data_dir, tmp_path, monkeypatch
):
  """`cluster_address='auto'` joins the Ray cluster running on this machine, found as Ray
  finds it (its GCS processes); none, or several, is one line before anything starts."""
  from ray._private import services

  monkeypatch.setattr(services, 'find_gcs_addresses', lambda: running)
  config = smoke_config('asgd', data_dir)
  set_fields(config, {'clock': 'real', 'executor': 'processes', 'cluster_address': 'auto'})
  with pytest.raises(ValueError, match=rf'^cluster_address: .*{refused}') as error:
    train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  assert '\n' not in str(error.value)
  assert not (tmp_path / 'run').exists()
  monkeypatch.setattr(services, 'find_gcs_addresses', lambda: ['10.0.0.3:6379'])
  assert settings.local_cluster_address() == '10.0.0.3:6379'
