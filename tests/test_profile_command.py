"""`python -m experiments.profile`: the table it writes is the one a run looks up."""

import os
import subprocess
import sys

import chex
import numpy as np
import pytest

from experiments import profile as profile_command
from experiments.configs import asgd as asgd_config
from experiments.configs import ddg as ddg_config
from experiments.configs import local as local_config
from experiments.configs import lppsgd as lppsgd_config
from experiments.configs import ssgd as ssgd_config
from jaxsgd import algorithms
from jaxsgd import models
from jaxsgd import optimizers
from jaxsgd.pipeline import PlacedStages
from jaxsgd.scheduler import Placement, host, profile_lookup, profiles, task_timing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(batch_size):
  rng = np.random.default_rng(0)
  return {
    'image': rng.standard_normal((batch_size, 40, 1)).astype(np.float32),
    'label': rng.integers(0, 10, batch_size).astype(np.int32),
  }


def _stages_as_train_builds_them(shared, model, roles):
  """What `algorithms.pipelined.train_roles` builds (its split and computations)."""
  return PlacedStages(
    model,
    shared.stages,
    optimizers.make_optimizer(shared.optimizer, shared.train_steps),
    placement=Placement.create(shared.stages),
    batch_size=shared.batch_size,
    seed=shared.seed,
    aux_heads=any(r.loss == 'aux' for r in roles),
  )


@pytest.mark.parametrize('get_config', [ddg_config.get_config, local_config.get_config])
def test_the_measured_table_is_the_one_the_run_looks_up(get_config):
  config = get_config('smoke')
  config.stages = 2
  model = models.get_model(config.model.name, (40, 1), 10)
  table, batch_size = profile_command.measure_table(config, model, _batch, warmup=1, reps=2)
  assert batch_size == config.batch_size
  profile = task_timing.make_profile(
    model,
    config.batch_size,
    profile_lookup.optimizer_id(dict(config.optimizer)),
    [table],
    warmup=1,
    reps=2,
  )
  settings = algorithms.get(config.algorithm.name).validate(config, model)
  roles = profile_command.roles_of(config.algorithm.name, settings)
  stages = _stages_as_train_builds_them(settings.shared, model, roles)
  # The run looks the table up with its parsed settings' optimizer.
  assert (
    profile_lookup.pipeline_costs(
      profile, stages, roles, optimizer=profile_lookup.optimizer_id(settings.shared.optimizer)
    )
    == table.costs
  )
  assert set(table.costs) == {
    (k, kind) for k in range(2) for kind in ('forward', 'backward', 'update')
  }


def test_server_algorithms_time_the_server_update():
  config = asgd_config.get_config('smoke')
  model = models.get_model(config.model.name, (40, 1), 10)
  table, _ = profile_command.measure_table(config, model, _batch, warmup=1, reps=2)
  assert table.tasks == profile_lookup.server_tasks('asgd') != profile_lookup.server_tasks('dcasgd')
  assert table.split == ((0, model.num_layers),)
  assert set(table.costs) == {(0, 'forward'), (0, 'backward'), (0, 'update')}


def test_lppsgd_times_its_averaging_tasks_on_the_models_parameters():
  """The mean of `devices` snapshots and a keep-local merge, on the initial parameters
  the run starts from: mean(w, w) = w and merge(w, w, w) = w + (w - w) = w, exactly."""
  config = lppsgd_config.get_config('smoke')
  config.algorithm.devices = 2
  model = models.get_model(config.model.name, (40, 1), 10)
  entry = profile_command.table_calls(config, model, _batch)
  settings = algorithms.get('lppsgd').validate(config, model)
  stages = _stages_as_train_builds_them(
    settings.shared, model, profile_command.roles_of('lppsgd', settings)
  )
  params = stages.initial_variables(config.seed, profile_command.roles_of('lppsgd', settings)[0])[
    'params'
  ]
  mean, (snapshots,) = entry.calls[(0, 'average')]
  assert len(snapshots) == 2
  chex.assert_trees_all_equal(mean(snapshots), params)
  merge, args = entry.calls[(0, 'merge')]
  chex.assert_trees_all_equal(merge(*args), params)
  table, _ = profile_command.measure_table(config, model, _batch, warmup=1, reps=2)
  assert set(table.costs) == {
    (0, kind) for kind in ('forward', 'backward', 'update', 'average', 'merge')
  }


@pytest.mark.parametrize('name', ['ssgd', 'diloco'])
def test_data_parallel_algorithms_time_one_worker_step(name):
  """One worker's step at the per-worker batch: one table for every data-parallel method."""
  config = ssgd_config.get_config('smoke')
  config.algorithm.name = name
  model = models.get_model(config.model.name, (40, 1), 10)
  table, batch_size = profile_command.measure_table(config, model, _batch, warmup=1, reps=2)
  assert batch_size == config.batch_size  # per worker
  assert (table.tasks, table.split) == (profile_lookup.WORKER_STEP, ((0, model.num_layers),))
  assert set(table.costs) == {(0, 'step')} and table.costs[(0, 'step')] > 0


def test_unknown_algorithms_are_refused_naming_the_field():
  config = ddg_config.get_config('smoke')
  config.algorithm.name = 'sgd_by_hand'
  with pytest.raises(ValueError, match="algorithm.name: 'sgd_by_hand' has no task table"):
    profile_command.measure_table(config, None, None)


def test_the_command_writes_a_profile_and_refuses_to_mix_models(data_dir, tmp_path):
  out = str(tmp_path / 'suite.json')

  def command(config_file, *extra):
    return subprocess.run(
      [
        sys.executable,
        '-m',
        'experiments.profile',
        f'--config={config_file}',
        f'--config.data_dir={data_dir}',
        f'--out={out}',
        '--reps=2',
        '--warmup=1',
        *extra,
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )

  done = command('experiments/configs/ddg.py:smoke', '--config.stages=2')
  assert done.returncode == 0, done.stderr[-2000:]
  assert f'wrote {out}: 1 table(s), model cnn, batch 32' in done.stdout
  profile = profiles.load(out)
  assert profile.model['name'] == 'cnn' and profile.batch_size == 32
  assert {'jax_call', 'real', 'real_threads'} == set(profile.dispatch)
  assert profile.clock == 'wall' and not profile.pinned  # The defaults.
  refused = command('experiments/configs/asgd.py:smoke')  # The MLP: another model.
  assert refused.returncode != 0
  assert (
    refused.stderr.strip()
    .splitlines()[-1]
    .startswith('cost.profile: cannot add to a profile of another model')
  )
  assert profiles.load(out) == profile  # Left as it was.


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs a core beside the pinned one')
def test_the_command_measures_with_busy_cores_and_says_so_in_the_profile(data_dir, tmp_path):
  out = str(tmp_path / 'busy.json')
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.profile',
      '--config=experiments/configs/ddg.py:smoke',
      f'--config.data_dir={data_dir}',
      '--config.stages=2',
      f'--out={out}',
      '--reps=2',
      '--warmup=1',
      f'--pin_core={min(os.sched_getaffinity(0))}',
      '--busy_cores=1',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  profile = profiles.load(out)
  assert profile.pinned and profile.busy_cores == 1


def test_busy_cores_are_those_beside_the_pinned_one_and_bad_counts_are_refused(monkeypatch):
  monkeypatch.setattr(profile_command.os, 'sched_getaffinity', lambda _: {0, 1, 2, 5})
  assert profile_command.busy_neighbour_cores(0, -1) == []
  assert profile_command.busy_neighbour_cores(2, 1) == [0, 2]
  assert profile_command.busy_neighbour_cores(3, 0) == [1, 2, 5]
  with pytest.raises(
    SystemExit,
    match=r'^--busy_cores: 4 cores asked for beside core 0; this process may use 3 others \(1, 2, 5\)\.$',
  ):
    profile_command.busy_neighbour_cores(4, 0)
  with pytest.raises(
    SystemExit, match=r'^--busy_cores: .* \(which it needs\), got --busy_cores=1 --pin_core=-1\.$'
  ):
    profile_command.busy_neighbour_cores(1, -1)


def test_the_command_writes_an_in_process_host_profile(tmp_path):
  """`--host=in_process`: a host profile (`cost.host`) of the in-process executor, its
  dispatch per task measured here; --config with --host is refused."""
  out = tmp_path / 'host.json'

  def command(*extra):
    return subprocess.run(
      [sys.executable, '-m', 'experiments.profile', '--host=in_process', f'--out={out}', *extra],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )

  done = command()
  assert done.returncode == 0, done.stderr[-2000:]
  assert f'wrote {out}: host profile of in_process' in done.stdout
  profile = host.load(str(out))
  assert profile.executor == 'in_process' and profile.cores == len(os.sched_getaffinity(0))
  assert set(dict(profile.figures)) == {'dispatch'} and profile.figure('dispatch') > 0
  refused = command('--config=experiments/configs/ddg.py:smoke', '--replace')
  assert refused.returncode != 0
  assert refused.stderr.strip().splitlines()[-1] == (
    '--host: measures an executor, not a config; drop --config/--suite.'
  )
  assert command().stderr.strip().splitlines()[-1] == (
    f'--out: {str(out)!r} exists; --replace overwrites it.'
  )
  assert command('--host_repeats=0', '--replace').stderr.strip().splitlines()[-1] == (
    '--host_repeats: chains per measurement, at least 1; got 0.'
  )


def test_suite_profiles_every_method_with_measured_costs():
  labels = [label for label, _ in profile_command.suite_configs('ddg')]
  assert labels == ['BP (staged, K=4)', 'DDG K=2', 'DDG K=3', 'DDG K=4']
  # pdasgd: SSGD prices its step from the profile too (a worker step at batch 128).
  configs = dict(profile_command.suite_configs('pdasgd'))
  assert configs['SSGD M=3'].algorithm.name == 'ssgd' and configs['SSGD M=3'].batch_size == 128
  with pytest.raises(SystemExit, match='no method of dasgd takes its costs from a profile'):
    profile_command.suite_configs('dasgd')  # Every dasgd method gives its step's seconds.
  with pytest.raises(SystemExit, match="--suite: 'nope' is not a suite"):
    profile_command.suite_configs('nope')


def test_configs_one_profile_cannot_hold_are_refused_before_anything_is_timed(
  data_dir, monkeypatch
):
  """Two configs of another model each (DDG's CNN, ASGD's MLP) in one command: refused in
  one line naming the second, before a task is timed."""
  from absl import flags

  parsed = flags.FLAGS.is_parsed()
  if not parsed:  # the command's flags (--warmup, --reps, ...) at their defaults
    flags.FLAGS(['profile', '--out=unused.json'])
  timed = []
  monkeypatch.setattr(profile_command, 'measure_tables', lambda *a, **k: timed.append(a))
  configs = []
  for label, get_config in (('ddg', ddg_config.get_config), ('asgd', asgd_config.get_config)):
    config = get_config('smoke')
    config.data_dir = data_dir
    configs.append((label, config))
  refused = '^asgd: cost.profile: cannot add to a profile of another model'
  try:
    with pytest.raises(SystemExit, match=refused):
      profile_command._measure(configs)  # pylint: disable=protected-access
  finally:
    if not parsed:
      flags.FLAGS.unparse_flags()
  assert timed == []
