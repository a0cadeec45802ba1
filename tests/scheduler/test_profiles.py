"""Cost profiles: measured once, written, read back identically; mismatches refused."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import psutil
import pytest

from jaxsgd.algorithms import ddg
from jaxsgd.algorithms import local
from jaxsgd.pipeline import sequential_roles
from jaxsgd.scheduler import (
  VirtualExecutor,
  lane_timing,
  link_timing,
  profile_lookup,
  profiles,
  task_timing,
)
from scheduler_helpers import BATCH, make_pipeline, mlp, pipeline_for, take, train

ROLES = sequential_roles(2)


@pytest.fixture(scope='module')
def profile():
  pipeline = pipeline_for(ROLES)
  table = task_timing.pipeline_table(pipeline, ROLES, take(1)[0], warmup=1, reps=3)
  return task_timing.make_profile(
    pipeline.model,
    BATCH,
    'sgd',
    [table],
    warmup=1,
    reps=3,
    dispatch={'jax_call': 1e-5, 'real': 2e-5},
  )


def _write(tmp_path, data, name='p.json'):
  path = tmp_path / name
  path.write_text(json.dumps(data))
  return str(path)


def test_measure_prices_each_task_at_the_median_of_interleaved_repetitions():
  """A fake clock: call i of the run takes `durations[i]`; calls alternate a, b. a's
  calls take 5, 3, 4 (median 4, fastest 3); b's 1, 7, 2 (median 2, fastest 1)."""
  durations = iter([5.0, 1.0, 3.0, 7.0, 4.0, 2.0])  # a1 b1 a2 b2 a3 b3
  now = itertools.count()
  ticks = []

  def clock():  # start, end, start, end, ...: end = start + the call's duration
    if len(ticks) % 2 == 0:
      ticks.append(float(next(now)) * 100)
    else:
      ticks.append(ticks[-1] + next(durations))
    return ticks[-1]

  calls = {'a': (lambda: np.zeros(1), ()), 'b': (lambda: np.ones(1), ())}
  costs, spread = task_timing.measure(calls, warmup=1, reps=3, clock=clock)
  assert costs == {'a': 4.0, 'b': 2.0}
  assert spread['a']['min'] == 3.0 and spread['b']['min'] == 1.0
  assert spread['a']['p90'] == pytest.approx(4.8) and spread['b']['p90'] == pytest.approx(6.0)


def test_several_tables_are_measured_in_the_same_rounds(monkeypatch):
  """`measure_tables`: each round times every task of every table once, so a slow spell
  prices them alike; each table keeps its own keys, split and task set, and each key the
  median of its own task's calls (a fake clock: the i-th timed call takes durations[i])."""
  order = []
  durations = iter([4.0, 1.0, 9.0, 3.0, 2.0, 8.0])  # round 1: a0 a1 b0, round 2: a0 a1 b0
  ticks = []

  def clock():  # start, end, start, end, ...: end = start + the call's duration
    ticks.append(ticks[-1] + next(durations) if len(ticks) % 2 else 100.0 * len(ticks))
    return ticks[-1]

  def task(name):
    return lambda: order.append(name) or np.zeros(1)

  monkeypatch.setitem(task_timing.CLOCKS, 'fake', clock)
  first = ({(0, 'forward'): (task('a0'), ()), (0, 'update'): (task('a1'), ())}, ((0, 2),), 'x')
  second = ({(0, 'forward'): (task('b0'), ())}, ((0, 1), (1, 2)), 'y')
  tables = task_timing.measure_tables([first, second], warmup=1, reps=2, clock='fake')
  assert order == ['a0', 'a1', 'b0'] + ['a0', 'a1', 'b0'] * 2  # warm-up, then two rounds
  assert [t.tasks for t in tables] == ['x', 'y']
  assert [t.split for t in tables] == [((0, 2),), ((0, 1), (1, 2))]
  assert tables[0].costs == {(0, 'forward'): 3.5, (0, 'update'): 1.5}
  assert tables[1].costs == {(0, 'forward'): 8.5}
  assert tables[1].spread[(0, 'forward')]['min'] == 8.0


def test_the_clocks_that_measure_are_those_a_file_may_name():
  assert tuple(task_timing.CLOCKS) == profiles.CLOCK_NAMES


def test_a_link_is_the_line_through_two_sizes_move_times():
  """Hand-computed: 1000 B in 2 ms, 5000 B in 6 ms: 4000 B in 4 ms is 1 MB/s, and 1000 B
  of it leave 1 ms of latency."""
  latency, bandwidth = link_timing.link_line((1000, 5000), (2e-3, 6e-3))
  assert bandwidth == pytest.approx(1e6) and latency == pytest.approx(1e-3)
  # A larger size not slower: no bandwidth term, all latency.
  assert link_timing.link_line((1000, 5000), (3e-3, 2e-3)) == (3e-3, np.inf)
  # A negative time counts as 0 (and the latency is at least 0).
  assert link_timing.link_line((1000, 5000), (-1e-3, 2e-3)) == (0.0, 2e6)


def test_a_moves_time_per_array_is_what_many_arrays_add_beyond_one_of_their_bytes():
  """Hand-computed: one array of 1000 B in 2 ms and of 5000 B in 6 ms (1 ms + bytes at
  1 MB/s); 11 arrays in 5 ms where one array of their bytes took 4 ms: 0.1 ms for each
  array after the first. Many arrays no slower than one: 0 per array."""
  fit = link_timing._fit((1000, 5000), 11, (2e-3, 6e-3, 5e-3, 4e-3))
  assert fit == pytest.approx((1e-3, 1e6, 1e-4))
  assert link_timing._fit((1000, 5000), 11, (2e-3, 6e-3, 3e-3, 4e-3))[2] == 0.0


def test_profile_has_every_task_of_every_stage(profile):
  (table,) = profile.tables
  assert set(table.costs) == {
    (k, kind) for k in range(2) for kind in ('forward', 'backward', 'update')
  }
  assert all(c > 0 for c in table.costs.values())
  assert all(table.spread[k]['min'] <= c <= table.spread[k]['p90'] for k, c in table.costs.items())
  assert table.tasks == profile_lookup.roles_signature(ROLES)
  assert profile.model['name'] == 'mlp' and profile.batch_size == BATCH
  assert profile.statistic == 'median' and profile.jax_version
  assert profile.clock == 'wall' and not profile.pinned


def test_round_trip_is_exact(profile, tmp_path):
  path = str(tmp_path / 'profile.json')
  profiles.save(profile, path)
  loaded = profiles.load(path)
  assert loaded == profile
  assert profiles.to_json(loaded) == profiles.to_json(profile)


def test_two_loads_give_identical_cost_models_and_simulated_runs(profile, tmp_path):
  path = str(tmp_path / 'profile.json')
  profiles.save(profile, path)
  pipeline = pipeline_for(ROLES)
  models = [
    profile_lookup.cost_model(
      profiles.load(path),
      model=pipeline.model,
      batch_size=BATCH,
      split=profile_lookup.split_of(pipeline.stages),
      tasks=profile_lookup.roles_signature(ROLES),
      link_latency=1e-4,
    )
    for _ in range(2)
  ]
  assert models[0] == models[1]
  assert models[0].compute == profile.tables[0].costs
  timelines = [train(pipeline, ROLES, 5, executor=VirtualExecutor(m))[1] for m in models]
  assert timelines[0].makespan == timelines[1].makespan > 0
  assert [(r.lane, r.start, r.end) for r in timelines[0].records] == [
    (r.lane, r.start, r.end) for r in timelines[1].records
  ]


def test_pipeline_costs_reads_what_time_tasks_would_measure(profile):
  assert (
    profile_lookup.pipeline_costs(profile, pipeline_for(ROLES), ROLES, optimizer='sgd')
    == profile.tables[0].costs
  )
  # DDG (paper form) computes what BP computes: the same table serves both.
  assert (
    profile_lookup.pipeline_costs(profile, pipeline_for(ddg.roles(2)), ddg.roles(2))
    == profile.tables[0].costs
  )


@pytest.mark.parametrize(
  'case, field',
  [
    ('batch', 'batch_size is 16 in the profile but 32'),
    ('model', 'model.num_params'),
    ('split', 'no table for split=[[0, 1], [1, 2], [2, 3]]'),
    ('recompute', "tasks='none:dy:none:recompute"),
    ('aux', "tasks='aux"),
    ('optimizer', "optimizer is 'sgd' in the profile but 'adam'"),
  ],
)
def test_mismatches_are_refused(profile, case, field):
  if case == 'optimizer':
    with pytest.raises(profiles.ProfileError, match=field):
      profile_lookup.pipeline_costs(profile, pipeline_for(ROLES), ROLES, optimizer='adam')
    return
  if case == 'batch':
    pipeline, roles = make_pipeline(mlp(), ROLES), ROLES
    with pytest.raises(profiles.ProfileError, match=field):
      profile_lookup.costs_for(
        profile,
        model=pipeline.model,
        batch_size=32,
        split=profile_lookup.split_of(pipeline.stages),
        tasks=profile_lookup.roles_signature(roles),
      )
    return
  if case == 'model':
    pipeline, roles = make_pipeline(mlp(hidden=(16, 8)), ROLES), ROLES
  elif case == 'split':
    roles = sequential_roles(3)
    pipeline = make_pipeline(mlp(), roles)
  elif case == 'recompute':
    roles = ddg.roles(2, 'recompute')
    pipeline = pipeline_for(roles)
  else:
    roles = local.roles(2)
    pipeline = pipeline_for(roles)
  with pytest.raises(profiles.ProfileError, match=field.replace('[', r'\[')):
    profile_lookup.pipeline_costs(profile, pipeline, roles)


@pytest.mark.parametrize(
  'edit, message',
  [
    (lambda d: d.pop('batch_size'), 'missing field.*batch_size'),
    (lambda d: d.update(batch_size=0), '"batch_size" must be a positive integer'),
    (lambda d: d.update(format='other/2'), '"format" must be'),
    (lambda d: d.update(extra=1), r'unknown field\(s\) extra'),
    (lambda d: d['model'].pop('num_params'), '"model" must have exactly the keys'),
    (
      lambda d: d['tables'][0]['costs'].update({'0/forward': -1.0}),
      r'"tables\[0\].costs.0/forward" must be a finite number of seconds >= 0',
    ),
    (lambda d: d['tables'][0]['costs'].update({'x/forward': 1.0}), 'cost key'),
    (
      lambda d: d['tables'][0]['spread']['0/forward'].update(min=float('nan')),
      r'"tables\[0\].spread.0/forward.min" must be a finite number of seconds >= 0, got nan',
    ),
    (
      lambda d: d['tables'][0]['spread'].update({'0/forward': 0.1}),
      r'"tables\[0\].spread" must give each task an object of seconds',
    ),
    (
      lambda d: d['tables'][0].update(spread=[0.1]),
      r'"tables\[0\].spread" must give each task an object of seconds',
    ),
    (lambda d: d['tables'][0].update(split=[[2, 1]]), r'"tables\[0\].split"'),
    (lambda d: d['dispatch'].update(real='fast'), '"dispatch.real"'),
    (lambda d: d.update(tables=[]), '"tables" must be a non-empty list'),
    (lambda d: d.update(clock='sundial'), '"clock" must be one of wall, cpu'),
    (lambda d: d.update(pinned='yes'), '"pinned" must be true or false'),
    (lambda d: d.update(busy_cores=-1), '"busy_cores" must be an integer >= 0, got -1'),
  ],
)
def test_bad_files_name_the_field(profile, tmp_path, edit, message):
  data = profiles.to_json(profile)
  edit(data)
  with pytest.raises(profiles.ProfileError, match=message):
    profiles.load(_write(tmp_path, data))


def test_whole_model_worker_signature_is_one_sequential_stage():
  assert profile_lookup.WHOLE_MODEL_WORKER == profile_lookup.roles_signature(sequential_roles(1))
  assert profile_lookup.server_tasks('dcasgd') == 'head:-:none+server:dcasgd'


def test_optimizer_id_ignores_rates_but_not_the_computation():
  assert (
    profile_lookup.optimizer_id(
      {'name': 'adam', 'learning_rate': 3e-3, 'weight_decay': 0.0, 'kwargs': {}}
    )
    == 'adam'
  )
  assert (
    profile_lookup.optimizer_id(
      {'name': 'sgd', 'learning_rate': 0.1, 'weight_decay': 5e-4, 'kwargs': {'momentum': 0.9}}
    )
    == 'sgd(momentum)+weight_decay'
  )


def test_unreadable_files_are_refused(tmp_path):
  with pytest.raises(profiles.ProfileError, match='cannot read'):
    profiles.load(str(tmp_path / 'absent.json'))
  path = tmp_path / 'bad.json'
  path.write_text('{"format": ')
  with pytest.raises(profiles.ProfileError, match='is not JSON'):
    profiles.load(str(path))


def test_merge_adds_and_replaces_tables(profile):
  other = profiles.Table(((0, 2), (2, 3)), 'other', {'forward': 1.0})
  newer = dataclasses.replace(profile.tables[0], costs={'forward': 2.0})
  merged = profiles.merge(profile, dataclasses.replace(profile, tables=(other,)))
  assert merged.tables == (profile.tables[0], other)
  merged = profiles.merge(merged, dataclasses.replace(profile, tables=(newer,)))
  assert merged.tables == (other, newer)
  with pytest.raises(profiles.ProfileError, match='another batch_size'):
    profiles.merge(profile, dataclasses.replace(profile, batch_size=BATCH + 1))
  with pytest.raises(profiles.ProfileError, match='another clock'):
    profiles.merge(profile, dataclasses.replace(profile, clock='cpu'))
  with pytest.raises(profiles.ProfileError, match=r'another busy_cores \(0 there, 1 here\)'):
    profiles.merge(profile, dataclasses.replace(profile, busy_cores=1))


def test_busy_cores_are_kept_and_a_file_written_before_them_had_none(profile, tmp_path):
  busy = dataclasses.replace(profile, busy_cores=3)
  assert profiles.load(_write(tmp_path, profiles.to_json(busy))).busy_cores == 3
  older = profiles.to_json(profile)
  del older['busy_cores']  # a file written before the field
  assert profiles.load(_write(tmp_path, older)) == profile and profile.busy_cores == 0


def test_a_file_of_fastest_calls_is_priced_at_the_median_it_kept(profile, tmp_path):
  """A file written when a cost was a task's fastest call (`"statistic": "min"`) loads as
  one measured now: each cost its kept median, the fastest call in `spread`; one that
  kept no median for a task is refused, naming the table and the task."""
  data = profiles.to_json(profile)
  data['statistic'] = 'min'
  data['tables'][0]['costs'] = {'0/forward': 1.0, '0/update': 0.2}
  data['tables'][0]['spread'] = {
    '0/forward': {'median': 1.1, 'p90': 1.5},
    '0/update': {'median': 0.25, 'p90': 0.4},
  }
  loaded = profiles.load(_write(tmp_path, data))
  assert loaded.statistic == profiles.STATISTIC == 'median'
  (table,) = loaded.tables
  assert table.costs == {(0, 'forward'): 1.1, (0, 'update'): 0.25}
  assert table.spread == {
    (0, 'forward'): {'min': 1.0, 'p90': 1.5},
    (0, 'update'): {'min': 0.2, 'p90': 0.4},
  }
  assert profiles.load(_write(tmp_path, profiles.to_json(loaded), 'again.json')) == loaded
  other = profiles.Table(((0, 2), (2, 3)), 'other', {'forward': 1.0})
  merged = profiles.merge(loaded, dataclasses.replace(profile, tables=(other,)))
  assert merged.tables == (table, other)  # measured alike now: kept beside a new table
  data['tables'][0]['spread']['0/update']['median'] = 'x'
  with pytest.raises(profiles.ProfileError, match=r'spread.0/update.median" must be a finite'):
    profiles.load(_write(tmp_path, data))
  del data['tables'][0]['spread']['0/update']['median']
  with pytest.raises(
    profiles.ProfileError, match=r'"tables\[0\].spread" has no median for 0/update'
  ):
    profiles.load(_write(tmp_path, data))


def test_dispatch_overhead_is_measured_for_each_executor():
  overhead = lane_timing.measure_dispatch(tasks=20, rounds=2)
  assert set(overhead) == {'jax_call', 'real', 'real_threads'}
  assert overhead['jax_call'] > 0
  assert all(np.isfinite(v) and v >= 0 for v in overhead.values())


def test_the_gap_between_calls_is_the_median_over_calls_queued_behind_another():
  """Hand-made stamps of one lane's calls (sent, started, ended; s): the 2nd and 4th were
  sent before the call ahead ended (gaps 0.2 and 0.4), the 3rd after (its 5.0 wait for
  the driver is not the lane's), the 5th before (0.9): the median of 0.2, 0.4, 0.9."""
  stamps = [(0.0, 0.1, 10.0), (5.0, 10.2, 20.0), (25.0, 25.0, 30.0), (29.0, 30.4, 40.0)]
  stamps.append((39.0, 40.9, 50.0))
  calls = [types.SimpleNamespace(sent=a, started=b, ended=c) for a, b, c in stamps]
  assert lane_timing.queued_gap(calls) == pytest.approx(0.4)
  with pytest.raises(RuntimeError, match='no call was sent before'):
    lane_timing.queued_gap([calls[1], calls[2]])


def test_a_tasks_spread_is_the_sigma_of_its_log_durations():
  """Durations T·e^(−0.02), T, T·e^(+0.02): logs ln T − 0.02, ln T, ln T + 0.02, whose
  standard deviation is 0.02·√(2/3) whatever T; one duration has none."""
  durations = [0.04 * np.exp(-0.02), 0.04, 0.04 * np.exp(0.02)]
  assert lane_timing.log_spread(durations) == pytest.approx(0.02 * np.sqrt(2 / 3), rel=1e-9)
  assert lane_timing.log_spread([0.5] * 4) == 0.0
  with pytest.raises(ValueError, match='two or more positive durations'):
    lane_timing.log_spread([0.04])
  with pytest.raises(ValueError, match='two or more positive durations'):
    lane_timing.log_spread([0.04, 0.0])


def _core() -> int:
  return sorted(os.sched_getaffinity(0))[-1]


def test_busy_neighbours_compute_on_their_cores_and_end_with_the_context():
  core = _core()
  with task_timing.BusyNeighbours([core, core]) as busy:
    processes = [psutil.Process(p.pid) for p in busy.processes]
    assert [p.cpu_affinity() for p in processes] == [[core], [core]]
    before = [p.cpu_times().user for p in processes]
    time.sleep(0.5)
    assert all(p.cpu_times().user > b for p, b in zip(processes, before))  # computing
  assert busy.processes == []
  assert [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_busy_neighbours_end_when_the_measuring_process_is_killed(tmp_path):
  script = (
    'import sys, time\n'
    'from jaxsgd.scheduler import task_timing\n'
    f'with task_timing.BusyNeighbours([{_core()}]) as busy:\n'
    '  print(busy.processes[0].pid, flush=True)\n'
    '  time.sleep(600)\n'
  )
  parent = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True)
  neighbour = psutil.Process(int(parent.stdout.readline()))
  parent.kill()  # no __exit__: the neighbour sees its parent gone
  parent.wait()
  parent.stdout.close()
  _, alive = psutil.wait_procs([neighbour], timeout=20)  # generous: a safety bound only
  for process in alive:  # (a failure leaves nothing behind either)
    process.kill()
  assert alive == []
