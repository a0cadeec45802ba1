"""Re-pricing a profile from a run's trace (`repricing.reprice_from_trace`, `experiments.reprice`)."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import profile as profile_command
from experiments.configs import ddg as ddg_config
from jaxsgd import models
from jaxsgd.scheduler import profile_lookup, profiles, repricing, task_timing
from jaxsgd.training import train_and_evaluate
from scheduler_helpers import profile_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_trace(path, lanes, tasks):
  """A trace.json as `Timeline.write_chrome_trace` writes it: `lanes` {tid: name},
  `tasks` [(tid, kind, stage, start s, duration s)]."""
  events = [
    {'name': 'thread_name', 'ph': 'M', 'tid': t, 'args': {'name': n}} for t, n in lanes.items()
  ]
  events += [
    {
      'ph': 'X',
      'tid': t,
      'cat': kind,
      'ts': 1e6 * start,
      'dur': 1e6 * dur,
      'args': {'stage': stage, 'batch': 0},
    }
    for t, kind, stage, start, dur in tasks
  ]
  with open(path, 'w') as f:
    json.dump({'traceEvents': events}, f)


def _profile(costs, tables=1):
  table = profiles.Table(((0, 2), (2, 4)), 'roles', dict(costs))
  extra = tuple(profiles.Table(((0, 4),), f'other{i}', dict(costs)) for i in range(tables - 1))
  return profile_of(
    model={'name': 'm', 'input_shape': [4], 'num_classes': 2, 'num_layers': 4, 'num_params': 1},
    batch_size=8,
    date='2026-11-26',
    clock='cpu',
    pinned=True,
    reps=3,
    dispatch={'real': 1e-5},
    tables=(table, *extra),
  )


def test_a_trace_gives_each_compute_task_kind_its_durations_after_each_lanes_first(tmp_path):
  path = str(tmp_path / 'trace.json')
  _write_trace(
    path,
    {0: 'stage 0 (cpu:0)', 1: 'stage 1 (cpu:0)', 2: 'link stage 0 (cpu:0) → stage 1 (cpu:0)'},
    [  # not in time order: the first of a lane is its earliest
      (0, 'forward', 0, 13.0, 0.375),
      (0, 'backward', 0, 10.0, 0.5),
      (2, 'transfer', None, 11.5, 0.25),  # a link's copy: never a task cost
      (1, 'forward', 1, 12.0, 0.25),
      (0, 'forward', 0, 0.0, 9.0),  # lane 0's first
      (0, 'forward', 0, 11.0, 0.125),
      (1, 'forward', 1, 0.5, 8.0),  # lane 1's first
    ],
  )
  assert repricing.trace_durations(path, skip=1) == {
    (0, 'backward'): [0.5],
    (0, 'forward'): [0.125, 0.375],
    (1, 'forward'): [0.25],
  }
  assert repricing.trace_durations(path, skip=0) == {
    (0, 'backward'): [0.5],
    (0, 'forward'): [9.0, 0.125, 0.375],
    (1, 'forward'): [8.0, 0.25],
  }
  assert repricing.trace_durations(path, skip=3) == {(0, 'forward'): [0.375]}


def test_repricing_takes_each_tasks_mean_and_keeps_what_the_run_did_not_time():
  measured = _profile(
    {
      (0, 'forward'): 1.0,
      (0, 'backward'): 2.0,
      (1, 'forward'): 3.0,
      (0, 'update'): 5.0,
      'update': 4.0,
    }
  )
  kept = {(0, 'backward'): {'min': 1.5, 'p90': 2.5}}  # an untimed task's measured spread
  measured = dataclasses.replace(
    measured, tables=(dataclasses.replace(measured.tables[0], spread=kept),)
  )
  durations = {
    (0, 'forward'): [0.125, 0.25, 1.0],  # mean 0.4583.. (median 0.25); p90 0.25 + 0.8 * 0.75
    (0, 'update'): [0.5, 0.75],  # its own key: not pooled into 'update'; p90 0.5 + 0.9 * 0.25
    (1, 'update'): [0.125, 0.375, 0.25, 1.0],  # mean 0.4375; p90 0.375 + 0.7 * 0.625
  }
  repriced = repricing.reprice_from_trace(measured, durations)
  (table,) = repriced.tables
  # (0, 'backward') and (1, 'forward') were not timed: kept.
  assert table.costs == {
    (0, 'forward'): 1.375 / 3,
    (0, 'backward'): 2.0,
    (1, 'forward'): 3.0,
    (0, 'update'): 0.625,
    'update': 0.4375,
  }
  assert table.spread == {  # a timed task's fastest and 90th percentile; an untimed one's kept
    (0, 'forward'): {'min': 0.125, 'p90': pytest.approx(0.85, abs=1e-15)},
    (0, 'update'): {'min': 0.5, 'p90': pytest.approx(0.725, abs=1e-15)},
    'update': {'min': 0.125, 'p90': pytest.approx(0.8125, abs=1e-15)},
    (0, 'backward'): {'min': 1.5, 'p90': 2.5},
  }
  assert (table.split, table.tasks) == (measured.tables[0].split, measured.tables[0].tasks)
  assert repriced.dispatch == measured.dispatch and repriced.model == measured.model
  assert repriced.statistic == repricing.REPRICED != measured.statistic
  with pytest.raises(profiles.ProfileError, match='another statistic'):
    profiles.merge(measured, repriced)  # never mixed with measured tables


def test_repricing_refuses_a_profile_of_several_tables_or_a_run_of_other_tasks():
  with pytest.raises(profiles.ProfileError, match='needs a profile of one table'):
    repricing.reprice_from_trace(_profile({(0, 'forward'): 1.0}, tables=2), {(0, 'forward'): [1.0]})
  with pytest.raises(profiles.ProfileError, match='timed none of the profile'):
    repricing.reprice_from_trace(_profile({(0, 'forward'): 1.0}), {(5, 'forward'): [1.0]})
  with pytest.raises(profiles.ProfileError, match='not a trace.json'):
    repricing.trace_durations('/nonexistent/trace.json', 0)
  with pytest.raises(profiles.ProfileError, match='skip'):
    repricing.trace_durations('/nonexistent/trace.json', -1)


def test_a_malformed_trace_is_refused_in_one_line(tmp_path):
  path = tmp_path / 'trace.json'
  path.write_text(json.dumps({'traceEvents': [{'ph': 'X', 'cat': 'forward', 'ts': 0, 'dur': 1}]}))
  with pytest.raises(profiles.ProfileError, match='not a trace.json of a run'):
    repricing.trace_durations(str(path), 0)


def test_a_profile_repriced_from_a_virtual_run_gives_back_that_runs_costs(tmp_path):
  # The virtual clock's trace is exact: re-pricing any profile of the config from a
  # virtual run on costs A gives back A, task for task.
  config = ddg_config.get_config('smoke')
  config.stages, config.train_steps, config.eval_every = 2, 12, 12
  model = models.get_model(config.model.name, (40, 1), 10)
  rng = np.random.default_rng(0)

  def batch(size):
    return {
      'image': rng.standard_normal((size, 40, 1)).astype(np.float32),
      'label': rng.integers(0, 10, size).astype(np.int32),
    }

  table, batch_size = profile_command.measure_table(config, model, batch, warmup=1, reps=2)
  measured = task_timing.make_profile(
    model,
    batch_size,
    profile_lookup.optimizer_id(dict(config.optimizer)),
    [table],
    warmup=1,
    reps=2,
  )
  costs_a = {key: 1e-3 * (i + 1) for i, key in enumerate(sorted(table.costs, key=str))}
  profile_a = dataclasses.replace(measured, tables=(dataclasses.replace(table, costs=costs_a),))
  profiles.save(profile_a, str(tmp_path / 'a.json'))
  config.clock, config.cost.profile = 'virtual', str(tmp_path / 'a.json')
  train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)

  durations = repricing.trace_durations(str(tmp_path / 'run' / 'trace.json'), skip=0)
  repriced = repricing.reprice_from_trace(measured, durations)
  assert set(durations) == set(costs_a)
  assert repriced.tables[0].costs == pytest.approx(costs_a, rel=1e-9)


def _pilot(run, **config):
  os.makedirs(run, exist_ok=True)
  config = {
    'clock': 'real',
    'executor': 'processes',
    'model': {'name': 'm'},
    'batch_size': 8,
    'algorithm': {'name': 'ddg'},
    **config,
  }
  with open(os.path.join(run, 'summary.json'), 'w') as f:
    json.dump({'config': config}, f)
  _write_trace(
    os.path.join(run, 'trace.json'),
    {0: 'stage 0 (cpu:0)'},
    [(0, 'forward', 0, float(i), 0.5) for i in range(8)],
  )


def _reprice_command(tmp_path, run, out='c.json'):
  command = [
    sys.executable,
    '-m',
    'experiments.reprice',
    f'--profile={tmp_path / "p.json"}',
    f'--run={run}',
    f'--out={tmp_path / out}',
    '--skip=2',
  ]
  return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


def test_the_command_writes_the_repriced_profile_and_never_overwrites(tmp_path):
  profiles.save(_profile({(0, 'forward'): 1.0, (1, 'forward'): 3.0}), str(tmp_path / 'p.json'))
  _pilot(str(tmp_path / 'run'))
  done = _reprice_command(tmp_path, tmp_path / 'run')
  assert done.returncode == 0, done.stderr
  assert '(kept)' in done.stdout  # stage 1's forward: not in the run
  written = profiles.load(str(tmp_path / 'c.json')).tables[0].costs
  assert written == {(0, 'forward'): 0.5, (1, 'forward'): 3.0}
  again = _reprice_command(tmp_path, tmp_path / 'run')
  assert again.returncode != 0 and again.stderr.strip().splitlines()[-1].startswith('--out:')


def test_the_old_command_name_is_refused_naming_the_new_one():
  done = subprocess.run(
    [sys.executable, '-m', 'experiments.calibrate', '--profile=p.json'],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert done.returncode != 0
  (line,) = done.stderr.strip().splitlines()
  assert line.startswith('experiments.calibrate is now experiments.reprice')


@pytest.mark.parametrize(
  'config, message',
  [
    ({'clock': 'virtual'}, "--run: a run on the 'virtual' clock"),
    ({'batch_size': 16}, "--run: model 'm', batch 16; the profile is of model 'm', batch 8."),
    ({'model': {'name': 'cnn'}}, "--run: model 'cnn', batch 8"),
    ({'algorithm': {'name': 'lppsgd', 'workers_per_device': 2}}, '--run: LPP-SGD with'),
    ({'executor': 'emulated'}, "--run: a run with executor='emulated': its tasks waited"),
  ],
)
def test_a_run_that_is_no_pilot_for_the_profile_is_refused(tmp_path, config, message):
  # (`experiments.reprice` prints these as its one line.)
  _pilot(str(tmp_path / 'run'), **config)
  with pytest.raises(profiles.ProfileError) as refused:
    repricing.check_pilot(
      repricing.pilot_config(str(tmp_path / 'run')), _profile({(0, 'forward'): 1.0})
    )
  assert str(refused.value).startswith(message) and '\n' not in str(refused.value)
