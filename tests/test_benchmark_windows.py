"""The simulator benchmarks' steady state, computed by hand: the time per iteration where
every update is an iteration (ASGD, DC-ASGD, LPP-SGD: blocks of whole rounds), the
iterations left out, and the staleness of the steady state's updates."""

import json
import types

import numpy as np
import pytest

from benchmarks import schedule_error
from benchmarks import simulator_accuracy as accuracy


def _lockstep_ends(workers: int, rounds: int, round_s: float = 55.0, apart: float = 2.0):
  """`workers` workers of equal costs, each updating once a round, `apart` s after one
  another (as on the virtual clock): one round per `round_s`."""
  return [r * round_s + i * apart for r in range(rounds) for i in range(workers)]


def test_blocks_are_the_fewest_whole_rounds_of_at_least_five_updates():
  assert [accuracy.block_for(m) for m in (1, 2, 3, 4, 8, 16, 32)] == [5, 6, 6, 8, 8, 16, 32]
  # LPP-SGD's: at least an averaging period (4 rounds, the configs' `averaging_freq`).
  assert accuracy.lpp_averaging_freq() == 4
  assert [accuracy.block_for(d, 'lppsgd') for d in (1, 2, 4, 8, 16)] == [5, 8, 16, 32, 64]


def test_blocks_of_whole_rounds_measure_the_round_wherever_they_begin():
  """Two workers, a round of 55 s: 27.5 s per update. Blocks of 6 updates (3 rounds) span
  165 s each wherever they begin. Blocks of 5 span 2 rounds and a burst (112 s) or 3
  rounds less one (163 s), alternately: from the first update of a round their median is
  22.4 s (three blocks of 112 s, two of 163 s), from the second 27.5 s."""
  ends = _lockstep_ends(2, 13)
  assert accuracy.blocks_median(ends, accuracy.block_for(2)) == 27.5
  assert accuracy.blocks_median(ends[1:], accuracy.block_for(2)) == 27.5
  assert accuracy.blocks_median(ends, 5) == 112 / 5
  assert accuracy.blocks_median(ends[1:], 5) == 27.5


def test_a_parameter_servers_updates_are_measured_over_whole_rounds(tmp_path, monkeypatch):
  """ASGD M=2 on the virtual clock: each update an iteration, the two workers' 2 s apart
  in a round of 55 s (27.5 s per update). Its time per iteration is the median over
  blocks of 6 updates, 27.5 s; five blocks of 5 from a round's first update read 22.4,
  32.6, 22.4, 32.6 and 22.4 s: 22.4.
  A pipeline's (DDG) are blocks of 5 batches still."""
  ends = _lockstep_ends(2, 14)
  server = [(0, 'update', e - 1.0, e, i, 0) for i, e in enumerate(ends)]
  workers = [(1 + i % 2, 'backward', e - 3.0, e - 2.0, i, 0) for i, e in enumerate(ends)]
  names = {0: 'server (cpu:0)', 1: 'worker 0 (cpu:0)', 2: 'worker 1 (cpu:0)'}
  monkeypatch.setattr(accuracy, 'read_trace', lambda workdir: (names, server + workers))
  monkeypatch.setattr(accuracy, 'hear_delays', lambda workdir, since, until, **kw: [])
  # (warm-up 2: the window starts at the end of the third update, a round's first)
  asgd = accuracy.window_stats(str(tmp_path / 'asgd-virtual-K2'), warmup=2)
  assert asgd['per_iteration'] == 27.5
  ddg = accuracy.window_stats(str(tmp_path / 'ddg-virtual-K2'), warmup=2)
  assert ddg['per_iteration'] == 112 / 5
  assert [accuracy.in_rounds(f'{f}-emulated-K4-r0') for f in ('asgd', 'dcasgd', 'lppsgd')] == [
    True
  ] * 3
  assert not any(accuracy.in_rounds(f'{f}-virtual-K4') for f in ('pdasgd', 'ddg', 'local', 'bp'))


def test_hearing_delays_are_those_of_the_window_not_of_the_runs_end(tmp_path):
  """Three tasks (µs): before the window, in it (heard 2 ms after its end), and one that
  ended after it, heard 400 ms late as the pool closed. Only the middle one counts."""
  import json

  events = [
    {'ph': 'X', 'ts': 0.5e6, 'dur': 0.1e6, 'args': {'heard': 0.7e6}},
    {'ph': 'X', 'ts': 1.0e6, 'dur': 0.1e6, 'args': {'heard': 1.102e6}},
    {'ph': 'X', 'ts': 1.9e6, 'dur': 0.2e6, 'args': {'heard': 2.5e6}},
    {'ph': 'M', 'name': 'thread_name', 'tid': 0, 'args': {'name': 'stage 0'}},
  ]
  (tmp_path / 'trace.json').write_text(json.dumps({'traceEvents': events}))
  assert accuracy.hear_delays(str(tmp_path), 1.0, 2.0) == [pytest.approx(0.002)]
  assert len(accuracy.hear_delays(str(tmp_path), 1.0)) == 2  # no end: the run's end too


def test_the_ends_a_lane_held_are_left_out_of_the_hearing_delays_at_once(tmp_path):
  """By hand (µs): on lane 0, the first task ends at 1.1 s with the next two already
  dispatched (1.05 and 1.06 s): its lane held its end (two calls behind it), heard with
  the next at 1.302 s; the second ends at 1.3 s with one call behind it: sent at once,
  heard 2 ms later; the third, the lane's last, likewise (1 ms). Lane 1's only task: at
  once (3 ms). `sent_at_once` picks the same from `TaskRecord`s: by the task two places
  later, not the next (which would leave the second out)."""
  import json
  import types

  from jaxsgd.scheduler.lane_timing import sent_at_once

  def task(tid, start, end, heard, dispatched):
    args = {'heard': heard * 1e6, 'dispatched': dispatched * 1e6}
    return {
      'ph': 'X',
      'pid': 0,
      'tid': tid,
      'ts': start * 1e6,
      'dur': (end - start) * 1e6,
      'args': args,
    }

  events = [
    task(0, 1.0, 1.1, 1.302, 0.9),
    task(0, 1.1, 1.3, 1.302, 1.05),
    task(0, 1.3, 1.4, 1.401, 1.06),
    task(1, 1.0, 1.2, 1.203, 0.9),
  ]
  (tmp_path / 'trace.json').write_text(json.dumps({'traceEvents': events}))
  every = accuracy.hear_delays(str(tmp_path), 0.0)
  assert sorted(every) == pytest.approx([0.001, 0.002, 0.003, 0.202])
  at_once = accuracy.hear_delays(str(tmp_path), 0.0, at_once=True)
  assert sorted(at_once) == pytest.approx([0.001, 0.002, 0.003])
  records = [
    types.SimpleNamespace(
      end=e['ts'] / 1e6 + e['dur'] / 1e6, dispatched=e['args']['dispatched'] / 1e6
    )
    for e in events[:3]
  ]
  assert sent_at_once(records) == records[1:]


def test_too_few_iterations_for_a_block_give_none():
  assert accuracy.blocks_median([0.0, 1.0, 2.0], 5) is None


def test_the_steady_staleness_leaves_out_each_groups_share_of_the_iterations_before_the_window(
  tmp_path,
):
  """Four iterations (one update task per batch), the window from the end of the second:
  one of four ended before it (the first), so each group keeps its updates after the
  first quarter: layer 0's [7, 1, 0, 1] keeps [1, 0, 1]; layer 1's eight keep the last six."""
  with open(tmp_path / 'staleness.npz', 'wb') as f:
    np.savez(f, **{'layer 0': [7, 1, 0, 1], 'layer 1': [6, 5, 1, 1, 0, 2, 1, 0]})
  tasks = [(0, 'update', b, b + 1.0, b, 0) for b in range(4)]  # iteration b ends at b + 1
  steady = schedule_error.steady_staleness(str(tmp_path), tasks, start=2.0, per_task=False)
  assert steady == {0: 3, 1: 5, 2: 1}
  assert schedule_error.steady_staleness(str(tmp_path / 'none'), tasks, 2.0, False) == {}


def test_emulated_rows_are_simulated_with_the_hosts_idle_figures():
  """An emulated task waits and loads no core: every `_loaded` figure of the measured
  profile is replaced by its idle one and `upkeep` by 0, the others kept
  (hand-written profile)."""
  from jaxsgd.scheduler import host as host_lib

  idle = {'dispatch': 1e-4, 'driver': 2e-5, 'driver_latency': 3e-5}
  links = {
    f'{part}_{figure}': 1e-5
    for part in ('link', 'take_in', 'export')
    for figure in ('latency', 'per_array')
  }
  links.update(link_bandwidth=1e9, take_in_bandwidth=2e9, export_bandwidth=3e9)
  loaded = {f'{name}_loaded': 10 * value for name, value in idle.items()}
  measured = host_lib.make('processes', {**idle, **loaded, **links, 'upkeep': 0.05}, cores=2)
  figures = dict(schedule_error.unloaded(measured).figures)
  assert figures == {
    **idle,
    **{f'{name}_loaded': value for name, value in idle.items()},
    **links,
    'upkeep': 0.0,
  }


def test_emulated_rows_take_the_emulated_lanes_dispatch_idle_and_loaded():
  """`emulated_host`: the idle figures (`unloaded`) with the dispatch, idle and loaded,
  replaced by an emulated lane's time between calls (hand-written profile)."""
  from jaxsgd.scheduler import host as host_lib

  figures = {name: 1e-4 for name in host_lib.FIGURES['processes']}
  figures.update(dispatch=6e-5, dispatch_loaded=2e-4, driver_loaded=5e-5)
  measured = host_lib.make('processes', figures, cores=2)
  emulated = dict(schedule_error.emulated_host(measured, 2.5e-4).figures)
  assert emulated == {
    **figures,
    'dispatch': 2.5e-4,
    'dispatch_loaded': 2.5e-4,
    'driver_loaded': 1e-4,
    'upkeep': 0.0,
  }


def test_the_rows_are_priced_with_each_figure_the_median_of_the_rounds_profiles():
  """`median_host`: three hand-written profiles, one per round; each figure of the result
  is the median of its three values (not one round's profile), and profiles of another
  executor or another host are refused."""
  from jaxsgd.scheduler import host as host_lib

  base = {name: 1e-4 for name in host_lib.FIGURES['processes']}
  rounds = [
    {**base, 'dispatch': 3e-4, 'link_latency': 2e-3, 'driver': 1e-4},
    {**base, 'dispatch': 5e-4, 'link_latency': 1e-3, 'driver': 3e-4},
    {**base, 'dispatch': 4e-4, 'link_latency': 9e-4, 'driver': 2e-4},
  ]
  hosts = [host_lib.make('processes', figures, cores=2) for figures in rounds]
  median = schedule_error.median_host(hosts)
  assert dict(median.figures) == {**base, 'dispatch': 4e-4, 'link_latency': 1e-3, 'driver': 2e-4}
  assert (median.executor, median.cores) == ('processes', 2)
  in_process = host_lib.make('in_process', {'dispatch': 1e-4}, cores=2)
  with pytest.raises(ValueError, match='one executor and host'):
    schedule_error.median_host([hosts[0], in_process])
  other_host = host_lib.make('processes', rounds[1], cores=4)
  with pytest.raises(ValueError, match='one executor and host'):
    schedule_error.median_host([hosts[0], other_host])


def test_the_rounds_profiles_spread_is_printed_per_idle_figure_infinite_bandwidth_named():
  """`_host_spread`: (largest - smallest) / median of each figure over the rounds
  (dispatch 3, 5, 4e-4: 50 %), the `_loaded` copies and `upkeep` left out, a bandwidth
  measured infinite in one round said so rather than printed as 'inf %'."""
  from jaxsgd.scheduler import host as host_lib

  base = {name: 1e-4 for name in host_lib.FIGURES['processes']}
  rounds = [
    {**base, 'dispatch': 3e-4, 'take_in_bandwidth': 1e9},
    {**base, 'dispatch': 5e-4, 'take_in_bandwidth': float('inf')},
    {**base, 'dispatch': 4e-4, 'take_in_bandwidth': 2e9},
  ]
  hosts = [host_lib.make('processes', figures, cores=2) for figures in rounds]
  line = schedule_error._host_spread(hosts)
  assert 'dispatch 50 %' in line and 'driver 0 %' in line
  assert 'take_in_bandwidth inf' in line and 'inf %' not in line
  assert '_loaded' not in line and 'upkeep' not in line


def test_a_row_leaves_out_its_warm_up_and_the_filling_then_runs_its_blocks():
  """`--warmup 8 --blocks 8`: BP leaves out 8 iterations, a pipeline or PD-ASGD also 2 per
  lane (K = 4: 16), ASGD 4 per worker (24), LPP-SGD 64 per worker (264: its averaging
  rounds reach every worker late); then 8 blocks of 5 iterations, of whole rounds for
  ASGD (M = 2: 6; M = 32: 32) and of at least an averaging period for LPP-SGD (4 rounds,
  K = 2: 8; K = 2 leaves out 8 + 128), and one more iteration."""
  import argparse

  args = argparse.Namespace(warmup=8, blocks=8)
  families = ('bp', 'ddg', 'pdasgd', 'asgd', 'lppsgd')
  assert [schedule_error.warm_up(f, 4, args) for f in families] == [8, 16, 16, 24, 264]
  assert [schedule_error.steps_of(f, 2, args) for f in families] == [49, 53, 53, 65, 201]
  assert schedule_error.steps_of('dcasgd', 32, args) == 8 + 128 + 32 * 8 + 1


def test_the_iterations_left_out_are_counted_apart_from_each_lanes_first_tasks():
  """A server's update per iteration (ending at 1, 2, ..., 40) and two workers taking turns,
  a task an iteration (20 each). Leaving out 12 iterations and each lane's first 4 tasks
  starts the window at the 13th update's end; counted as 12 tasks of every lane too, it
  began after each worker's 12th (the second's ends at 23.4), at update 24."""
  names = {0: 'server', 1: 'worker 0', 2: 'worker 1'}
  server = [(0, 'update', i + 0.5, i + 1.0, i, 0) for i in range(40)]
  workers = [(1 + i % 2, 'backward', i + 0.1, i + 0.4, None, 0) for i in range(40)]
  tasks = server + workers
  assert accuracy.window(names, tasks, 4, iterations=12)[0] == 13.0
  assert accuracy.window(names, tasks, 12)[0] == 24.0


def test_the_window_begins_after_each_lanes_first_task_of_each_kind():
  """As above, and worker 1 merges once, 30.1 → 30.4 (its first task of a kind: compiled
  on first use, which the virtual clock does not price): the window begins at the first
  update's end after it, 31.0, however few iterations are left out. A first task of a
  kind at a stage not run before counts too (worker 0's stage-1 backward, 20.1 → 20.4:
  from 21.0). An averaging lane's first average (31.0 → 31.5; it has no forward,
  backward or update) counts as well: from 32.0. A window that such a first task leaves
  too short is refused, naming it."""
  names = {0: 'server', 1: 'worker 0', 2: 'worker 1', 3: 'allreduce'}
  server = [(0, 'update', i + 0.5, i + 1.0, i, 0) for i in range(40)]
  workers = [(1 + i % 2, 'backward', i + 0.1, i + 0.4, None, 0) for i in range(40)]
  merge = [(2, 'merge', 30.1, 30.4, None, 0)]
  other_stage = [(1, 'backward', 20.1, 20.4, None, 1)]
  average = [(3, 'average', 31.0 + i, 31.5 + i, i, 0) for i in range(6)]
  assert accuracy.window(names, server + workers + merge, 4, iterations=12)[0] == 31.0
  assert accuracy.window(names, server + workers + merge + average, 4, iterations=12)[0] == 32.0
  assert accuracy.window(names, server + workers + average, 4, iterations=12)[0] == 32.0
  assert accuracy.window(names, server + workers + other_stage, 4, iterations=12)[0] == 21.0
  late = [(2, 'merge', 39.1, 39.4, None, 0)]
  with pytest.raises(ValueError, match=r'ended by worker 1: its first merge \(stage 0\)'):
    accuracy.window(names, server + workers + late, 4, iterations=12)


@pytest.mark.parametrize(
  'flags, named',
  [
    (['--lanes=', '--workers='], '--lanes, --workers: no row to run'),
    (['--lanes=1', '--workers='], '--lanes: K >= 2'),
    (['--lanes=2', '--workers=1'], '--workers: M >= 2 workers; got [1]'),
    (['--lanes=', '--families=bp'], '--lanes, --workers: no row to run'),
  ],
)
def test_the_schedule_error_benchmark_refuses_lanes_it_cannot_run_in_one_line(
  flags, named, monkeypatch, capsys
):
  """No lanes and no workers was a traceback (`max()` of nothing), and lanes but only
  families without workers ran the minutes of measurements for no row: one line now,
  before anything runs."""
  monkeypatch.setattr('sys.argv', ['schedule_error', *flags])
  with pytest.raises(SystemExit) as stopped:
    schedule_error.main()
  assert stopped.value.code == 2
  assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_lanes_queued_gap_is_read_where_the_next_task_was_dispatched_before_the_end(
  tmp_path,
):
  """Lane a: t1 1 → 2 s; t2 dispatched at 1.5 starts at 2.25 (queued: 0.25 s); t3
  dispatched at 3, after t2's end (2.75), starts at 3.5 (not queued: its wait was the
  driver's); t4 dispatched at 3.75 starts at 4.6, after a copy to a landed at 4.5 (it
  waited for its input: left out; a copy that landed at 1.5, before t1's end, holds up
  nothing). Lane b: t5 0.5 → 1 starts before `since` (0.9) and is left out, so t6
  (dispatched at 0.75, started 1.25) makes no gap; t7 dispatched at 2 < t6's end (2.5)
  starts at 2.6 (0.1 s; the copy from a landed at 2, before t6's end)."""
  us = lambda seconds: seconds * 1e6  # noqa: E731

  def task(lane, start, end, dispatched=None):
    args = {'stage': 0, 'batch': 0}
    if dispatched is not None:  # (a copy has none)
      args.update(heard=us(end + 0.1), dispatched=us(dispatched))
    return {'ph': 'X', 'tid': lane, 'ts': us(start), 'dur': us(end - start), 'args': args}

  names = {0: 'a', 1: 'b', 2: 'link b → a', 3: 'link a → b'}
  events = [
    {'name': 'thread_name', 'ph': 'M', 'tid': t, 'args': {'name': n}} for t, n in names.items()
  ]
  events += [
    task(0, 1.0, 2.0, 0.5),
    task(0, 2.25, 2.75, 1.5),
    task(0, 3.5, 4.0, 3.0),
    task(0, 4.6, 5.0, 3.75),
    task(1, 0.5, 1.0, 0.25),
    task(1, 1.25, 2.5, 0.75),
    task(1, 2.6, 3.0, 2.0),
    task(2, 1.0, 1.5),
    task(2, 4.0, 4.5),
    task(3, 1.5, 2.0),
  ]
  (tmp_path / 'trace.json').write_text(json.dumps({'traceEvents': events}))
  gaps = sorted(schedule_error.queued_gaps(str(tmp_path), since=0.9))
  assert gaps == pytest.approx([0.1, 0.25])


def test_a_tasks_cost_row_holds_its_lanes_cpu_time_and_the_slowdown_of_each(tmp_path, monkeypatch):
  """Four forwards of 10, 12, 14 and 40 ms (median 13 ms) whose lane used 10, 10, 11 and
  12 ms of CPU (median 10.5 ms), priced 10 ms: 1.3 slower in wall time, 1.05 in CPU (the
  rest: time its core ran something else). A lane that timed no CPU (one forward of
  20 ms) has none."""

  def slice_(tid, start_ms, wall_ms, cpu_ms=None):
    args = {'stage': 0, 'batch': 0, **({} if cpu_ms is None else {'cpu': cpu_ms * 1e3})}
    return {
      'ph': 'X',
      'tid': tid,
      'cat': 'forward',
      'ts': start_ms * 1e3,
      'dur': wall_ms * 1e3,
      'args': args,
    }

  events = [
    {'name': 'thread_name', 'tid': 0, 'args': {'name': 'worker 0 (cpu:0)'}},
    {'name': 'thread_name', 'tid': 1, 'args': {'name': 'worker 1 (cpu:0)'}},
    slice_(0, 0, 10, 10),
    slice_(0, 20, 12, 10),
    slice_(0, 40, 14, 11),
    slice_(0, 60, 40, 12),
    slice_(1, 0, 20),
  ]
  (tmp_path / 'trace.json').write_text(json.dumps({'traceEvents': events}))
  monkeypatch.setattr(accuracy, 'window', lambda *args, **kwargs: (0.0, 1.0, 0))
  rows = accuracy.task_costs(str(tmp_path), 0, {'stage 0 forward': 10.0})
  assert [(row['lane'], row['tasks']) for row in rows] == [('worker0', 4), ('worker1', 1)]
  assert rows[0]['median'] == pytest.approx(0.013) and rows[0]['cpu'] == pytest.approx(0.0105)
  assert rows[1]['cpu'] is None
  assert accuracy.slowdown(rows[:1]) == pytest.approx(1.3)
  assert accuracy.slowdown(rows[:1], 'cpu') == pytest.approx(1.05)
  # Over both lanes: the median of 1.3 and 2.0 (worker 1's 20 ms); in CPU, worker 1 has none.
  assert accuracy.slowdown(rows) == pytest.approx(1.65)
  assert accuracy.slowdown(rows, 'cpu') == pytest.approx(1.05)
  # The replays' prices: each kind's mean duration (the five tasks), or mean CPU time (the
  # four the lanes timed: the cpu-replayed run's).
  assert accuracy.task_figures(str(tmp_path), 0) == {(0, 'forward'): pytest.approx(0.0192)}
  assert accuracy.task_figures(str(tmp_path), 0, 'cpu') == {(0, 'forward'): pytest.approx(0.01075)}


def test_the_drift_line_compares_each_task_of_the_two_profiles_by_hand():
  """Tasks priced at the start and again at the end: +10 %, -20 %, 0 %, then +6 %; a
  task in one profile only, or priced 0, and a table of another split are left out;
  tables are paired by split and task set, whatever their order."""
  from types import SimpleNamespace

  def table(split, costs):
    return SimpleNamespace(split=split, tasks='t', costs=costs)

  first = SimpleNamespace(
    tables=(table(((0, 2),), {'f': 0.010, 'b': 0.020, 'x': 0.0}), table(((0, 1),), {'f': 1.0}))
  )
  second = SimpleNamespace(
    tables=(
      table(((0, 1),), {'f': 1.0}),
      table(((0, 2),), {'f': 0.011, 'b': 0.016, 'x': 5.0, 'y': 1.0}),
      table(((0, 3),), {'f': 9.0}),
    )
  )
  assert accuracy.drift_line(first, second) == (
    'task costs at the end against the start (3 tasks, the profile measured again): '
    'median change 10.0 % either way, largest -20.0 %, mean -3.3 %'
  )
  first.tables[1].costs['u'], second.tables[0].costs['u'] = 2.0, 2.12
  assert '(4 tasks, the profile measured again): median change 8.0 % either way, largest ' in (
    accuracy.drift_line(first, second)
  )
  assert 'mean -1.0 %' in accuracy.drift_line(first, second)
  assert 'no task in both' in accuracy.drift_line(SimpleNamespace(tables=()), second)


def test_the_hosts_cores_busy_are_split_by_kind_with_the_machines_stolen_and_others_apart():
  """Two samples 2 s apart (the trace's 0 at t0 = 100): the driver used 0.4 s of CPU, of
  which its thread 0.2; two lanes 1.0 and 0.6 s; Ray 0.2 s. The machine's processes used
  3.0 s in all, so 0.8 s were others' (3.0 - 2.2); its hypervisor took 0.5 s. The lanes
  took 200 and 40 minor page faults, the first was preempted 40 times."""
  sampler = object.__new__(schedule_error.CpuSampler)  # (no psutil, no executor patched)
  sampler.t0 = 100.0

  def sample(t, driver, thread, lane_a, lane_b, ray, stolen, machine, faults, preempted):
    return (
      100.0 + t,
      {
        1: ('driver', driver),
        2: ('lanes', lane_a),
        3: ('lanes', lane_b),
        4: ('ray', ray),
        'driver thread': ('driver thread', thread),
        'stolen': ('stolen', stolen),
        'machine': ('machine', machine),
        ('faults', 2): ('faults', faults[0]),
        ('faults', 3): ('faults', faults[1]),
        ('preempted', 2): ('preempted', preempted),
      },
    )

  sampler.samples = [
    sample(1.0, 5.0, 4.0, 10.0, 20.0, 3.0, 50.0, 700.0, (100, 0), 10),
    sample(3.0, 5.4, 4.2, 11.0, 20.6, 3.2, 50.5, 703.0, (300, 40), 50),
  ]
  busy = sampler.busy(0.0, 5.0)
  expected = {
    'all': 1.1,  # (0.4 + 1.0 + 0.6 + 0.2) / 2
    'driver': 0.2,
    'lanes': 0.8,
    'ray': 0.1,
    'busiest lane': 0.5,
    'driver thread': 0.1,
    'stolen': 0.25,
    'others': 0.4,
    'faults': 120.0,  # ((300 - 100) + 40) / 2 per second, the lanes' (not cores)
    'preempted': 20.0,  # (50 - 10) / 2
  }
  assert busy.keys() == expected.keys()
  for kind, cores in expected.items():
    assert busy[kind] == pytest.approx(cores), kind
  assert sampler.busy(2.5, 5.0) is None  # one sample inside: no rate


def test_rows_whose_run_lost_cores_to_the_hypervisor_are_named_with_the_others_largest_error():
  def row(family, lanes, error, stolen):
    cpu = None if stolen is None else {'stolen': stolen}
    return {'family': family, 'lanes': lanes, 'error': error, 'emulated': {'cpu': cpu}}

  done = [
    row('asgd', 16, 11.3, 0.14),
    row('asgd', 32, 3.9, 0.01),
    row('dcasgd', 32, 14.4, 0.22),
    row('dcasgd', 16, 1.1, 0.02),  # (at the threshold: not named)
    row('bp', 2, 2.0, None),  # (no samples: none stolen seen)
  ]
  assert schedule_error._stolen_line(done) == (
    'compared runs that lost more than 0.02 cores to the hypervisor: ASGD M=16 (0.14 cores, '
    '11.3 %), DC-ASGD M=32 (0.22 cores, 14.4 %); largest error of the other rows: 3.9 %'
  )
  assert schedule_error._stolen_line(done[1:2]) == (
    'no compared run lost more than 0.02 cores to the hypervisor'
  )


def test_each_runs_pace_is_correlated_with_its_copies_and_what_could_slow_them_by_hand():
  """Each run relative to its row's median (time per iteration, copy), pooled over the
  rows; a run without a figure is left out of that pair (by hand: r = 0.04 / √(0.028 ×
  0.08) = 0.845 against the copies, 0.024 / √(0.028 × 0.032) = 0.802 against the steal,
  0.036 / √(0.028 × 0.052) = 0.944 against other processes' cores)."""

  def row(paces, copies, stolen, others):
    # Page faults and preemptions as the steal and the others scaled (r is scale-free).
    runs = [
      {'per_iteration': p, 'copy_ms': c, 'stolen': s, 'others': o}
      | {'faults': None if s is None else 1e3 * s, 'preempted': None if o is None else 50 * o}
      for p, c, s, o in zip(paces, copies, stolen, others)
    ]
    return {'family': 'asgd', 'lanes': 16, 'each_run': runs}

  rows = [
    row([1.0, 1.1, 0.9], [2.0, 2.4, 1.6], [0.0, 0.1, 0.0], [0.1, 0.3, 0.0]),
    row([2.0, 2.0, 2.2], [1.0, None, 1.0], [None, 0.0, 0.2], [None, 0.1, 0.2]),
  ]
  assert schedule_error.run_correlations(rows) == (
    "a run's time per iteration over its row's median, Pearson's r against its copy over "
    "the row's median copy: 0.85 (5 runs); against the cores stolen: 0.80 (5 runs); "
    "against other processes' cores: 0.94 (5 runs); against page faults per second: 0.80 "
    '(5 runs); against involuntary context switches per second: 0.94 (5 runs)'
  )
  few = [row([1.0, 1.1], [2.0, 2.4], [0.0, 0.0], [0.1, 0.2])]
  assert schedule_error.run_correlations(few) == (
    "a run's time per iteration over its row's median, Pearson's r against its copy over "
    "the row's median copy: - (2 runs); against the cores stolen: - (2 runs); against other "
    "processes' cores: - (2 runs); against page faults per second: - (2 runs); against "
    'involuntary context switches per second: - (2 runs)'
  )


def test_the_other_processes_are_named_by_the_cores_they_used_over_the_run():
  """Snapshots 4 s apart: pids 1 and 2 are the run's (sampled), the others not: a kernel
  thread (3: 0.8 s -> 0.2 cores), two processes of one name (4, 5: 0.3 + 0.1 s -> 0.1),
  one started during the run (6, from 0: 0.2 s -> 0.05) and one nearly idle (7: 0.01 s,
  0.0025 cores, under the 0.005 shown)."""
  sampler = object.__new__(schedule_error.CpuSampler)
  sampler.samples = [(0.0, {1: ('driver', 1.0), 2: ('lanes', 2.0), 'stolen': ('stolen', 0.0)})]
  first = {1: ('python', 1.0), 2: ('ray::Lane', 2.0), 3: ('kdamond.0', 10.0)}
  first |= {4: ('job', 5.0), 5: ('job', 1.0), 7: ('idle', 3.0)}
  last = {1: ('python', 9.0), 2: ('ray::Lane', 9.0), 3: ('kdamond.0', 10.8)}
  last |= {4: ('job', 5.3), 5: ('job', 1.1), 6: ('late', 0.2), 7: ('idle', 3.01)}
  sampler._first, sampler._last = (100.0, first), (104.0, last)  # pylint: disable=protected-access
  named = sampler.others_by_name()
  assert [name for name, _ in named] == ['kdamond.0', 'job', 'late']
  assert [cores for _, cores in named] == pytest.approx([0.2, 0.1, 0.05])
  each = [{'others_by_name': named}, {'others_by_name': [('job', 0.3)]}]
  assert schedule_error._busiest_others({'each_run': each}) == 'job 0.40, kdamond.0 0.20'
  assert schedule_error._busiest_others({'each_run': [{}]}) == '-'


def test_the_busiest_lane_and_its_own_cpu_are_counted_inside_the_window_by_hand():
  """`real_speedup`'s window: from the end of batch 0's update (10 s) to batch 2's (30 s),
  2 iterations. A task counts the part of it inside, its CPU in proportion: stage 1's
  backwards 5 of [5, 15] (CPU 8 -> 4) and all of [15, 29] (CPU 14): 19 s busy, 18 s CPU,
  more than stage 0's 12 s (its updates' 2 + 2, its forward's 8; CPU 1 + 2 + 6); a link
  lane's 20 s counts for no lane. A task whose CPU is unknown makes the lane's unknown."""
  from benchmarks import real_speedup
  from jaxsgd.scheduler.timeline import TaskRecord, Timeline

  def task(lane, kind, start, end, cpu, batch=None):
    return TaskRecord(lane, kind, start, end, batch=batch, cpu=cpu)

  records = [
    task(0, 'update', 8, 10, 2, batch=0),
    task(0, 'update', 18, 20, 1, batch=1),
    task(0, 'update', 28, 30, 2, batch=2),
    task(0, 'forward', 10, 18, 6),
    task(1, 'backward', 5, 15, 8),
    task(1, 'backward', 15, 29, 14),
    task(2, 'move', 10, 30, 20),
  ]
  timeline = Timeline(['stage 0', 'stage 1', 'link 0->1'], records, 'real')
  assert real_speedup.per_iteration(timeline, 1) == 10.0
  assert real_speedup.busiest_lane(timeline, 1) == (9.5, 9.0)
  records[4] = task(1, 'backward', 5, 15, None)
  busy, cpu = real_speedup.busiest_lane(timeline, 1)
  assert busy == 9.5 and np.isnan(cpu)


def test_a_lanes_gaps_are_the_parts_between_its_tasks_inside_the_window_by_hand(capsys):
  """The window from batch 0's update (10 s) to batch 2's (30 s), 2 iterations.
  Round 1: stage 0's update 18-20 and update 28-30 leave 8 s between them; its other tasks
  follow one another at once (no gap), and the 4 s before its update 8-10 lie outside.
  Stage 1's backward 5-8 and backward 12-29 leave 4 s, of which 2 (10-12) lie inside; a
  forward 13-14 inside that backward leaves no gap, and the forward 29.5-30 follows the
  backward's end (29), not the forward's (14): 0.5 s. A link lane's 9 s between its moves
  are no lane's. Stage 0's 12 s busy and 8 s of gaps fill the window.
  Round 2: stage 0's gaps 2 s (update 8-10 -> forward 12-18) and 6 s (update 20 ->
  update 26); stage 1's one task leaves none. A gap is dry where its next task was sent
  after it began: round 1's 8 s (sent at 25) and round 2's 2 s (at 11), not round 2's 6 s
  (at 19) nor stage 1's 2 s (at 6); unknown where the record has no dispatch time.
  `print_gaps` pools the rounds (4 iterations): stage 0 update -> update 8 and 6 s,
  median 7, (8 + 6) / 4 = 3.5 s per iteration, 8 / 4 = 2 dry; update -> forward 2 s, 0.5,
  all dry; stage 1's 2 and 0.5 s, 0.5 and 0.125, none dry and '-'."""
  from benchmarks import real_speedup
  from jaxsgd.scheduler.timeline import TaskRecord, Timeline

  lanes = ['stage 0 (cpu:0)', 'stage 1 (cpu:0)', 'link 0->1']
  first = Timeline(
    lanes,
    [
      TaskRecord(0, 'forward', 2, 4),
      TaskRecord(0, 'update', 8, 10, batch=0),
      TaskRecord(0, 'forward', 10, 18),
      TaskRecord(0, 'update', 18, 20, batch=1),
      TaskRecord(0, 'update', 28, 30, batch=2, dispatched=25),
      TaskRecord(1, 'backward', 5, 8),
      TaskRecord(1, 'backward', 12, 29, dispatched=6),
      TaskRecord(1, 'forward', 13, 14),
      TaskRecord(1, 'forward', 29.5, 30),
      TaskRecord(2, 'move', 10, 11),
      TaskRecord(2, 'move', 20, 21),
    ],
    'real',
  )
  second = Timeline(
    lanes,
    [
      TaskRecord(0, 'update', 26, 30, batch=2, dispatched=19),  # (out of order: sorted)
      TaskRecord(0, 'update', 8, 10, batch=0),
      TaskRecord(0, 'forward', 12, 18, dispatched=11),
      TaskRecord(0, 'update', 18, 20, batch=1),
      TaskRecord(1, 'backward', 11, 29),
    ],
    'real',
  )
  gaps, iterations = real_speedup.lane_gaps(first, 1)
  assert iterations == 2
  assert gaps == {
    'stage 0 (cpu:0)': {('update', 'update'): [(8.0, True)]},
    'stage 1 (cpu:0)': {
      ('backward', 'backward'): [(2.0, False)],
      ('backward', 'forward'): [(0.5, None)],
    },
  }
  assert real_speedup.lane_times(first, 1)[0][0] + 8.0 == 20.0
  assert real_speedup.lane_gaps(second, 1) == (
    {
      'stage 0 (cpu:0)': {
        ('update', 'forward'): [(2.0, True)],
        ('update', 'update'): [(6.0, False)],
      }
    },
    2,
  )
  real_speedup.print_gaps({'ddg K=2': {1: first, 2: second}}, 1)
  rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
  assert rows == [
    ['ddg', 'K=2', 'stage', '0', 'update', '->', 'forward', '1', '2000.00', '500.00', '500.00'],
    ['ddg', 'K=2', 'stage', '0', 'update', '->', 'update', '2', '7000.00', '3500.00', '2000.00'],
    ['ddg', 'K=2', 'stage', '1', 'backward', '->', 'backward', '1', '2000.00', '500.00', '0.00'],
    ['ddg', 'K=2', 'stage', '1', 'backward', '->', 'forward', '1', '500.00', '125.00', '-'],
  ]


def _undrained_pipeline(stages: int, steps: int, iteration: float = 10.0):
  """A DDG-shaped run's updates: stage k applies batch b's gradient in iteration
  b + (K-1-k), at its end (`iteration` s each, stage k's `k` s before stage K-1's); it
  applies the first `steps - (K-1-k)` batches' only (the run does not drain)."""
  from jaxsgd.scheduler.timeline import TaskRecord

  return [
    TaskRecord(k, 'update', end - 1.0, end, stage=k, batch=b)
    for k in range(stages)
    for b in range(steps - (stages - 1 - k))
    for end in [iteration * (b + stages - 1 - k + 1) - k]
  ]


def test_a_pipeline_that_does_not_drain_is_timed_over_the_batches_every_stage_updated():
  """K=3, 6 batches of 10 s: every stage updated batches 0-3, the last on stage 0 (ends
  30, 40, 50, 60); batches 4 and 5 only stages 1-2 and 2 (ends 59 and 58, in stage 0's
  last iteration). From batch 0's end (warm-up 1) to batch 3's: 3 iterations of 10 s;
  to batch 5's, as before, 28 s over 5 iterations (5.6 s: a speed-up 1.8x too high). The
  simulator benchmark's iteration ends leave them out too; a warm-up past batch 3 leaves
  no iteration, refused."""
  from benchmarks import real_speedup
  from jaxsgd.scheduler.timeline import Timeline

  records = _undrained_pipeline(3, 6)
  timeline = Timeline(['stage 0', 'stage 1', 'stage 2'], records, 'real')
  assert real_speedup.steady_window(timeline, 1) == (30.0, 60.0, 3)
  assert real_speedup.per_iteration(timeline, 1) == 10.0
  assert real_speedup.busiest_lane(timeline, 1)[0] == 1.0  # three 1 s updates per lane
  tasks = [(r.lane, r.kind, r.start, r.end, r.batch, r.stage) for r in records]
  assert accuracy.iteration_ends(tasks) == [30.0, 40.0, 50.0, 60.0]
  with pytest.raises(ValueError, match='no iteration after the warm-up'):
    real_speedup.steady_window(timeline, 4)


def test_saved_traces_are_measured_again_with_their_rounds_paired_by_hand(tmp_path, capsys):
  """`real_speedup --retime`: BP's rounds of 25 and 20 s per iteration against the
  undrained K=3 pipeline's 10 and 5 s (its second round at twice the pace): speed-ups
  2.5 and 4, median 3.25; BP's own 1.0."""
  from benchmarks import real_speedup
  from jaxsgd.scheduler.timeline import TaskRecord, Timeline

  def write(case, round_, records, lanes):
    timeline = Timeline([f'stage {k}' for k in range(lanes)], records, 'real')
    timeline.write_chrome_trace(str(tmp_path / f'{case}-round{round_}.json'))

  for round_, pace in ((1, 1.0), (2, 0.5)):
    bp = [TaskRecord(0, 'update', t - 1, t, 0, b) for b, t in enumerate([0, 25, 50, 75])]
    if round_ == 2:
      bp = [r._replace(start=r.start * 0.8, end=r.end * 0.8) for r in bp]
    write(real_speedup.BP_TRACE, round_, bp, 1)
    pipeline = _undrained_pipeline(3, 6, iteration=10.0 * pace)
    write('ddg-K-3-cores-0-1-2', round_, pipeline, 3)
  real_speedup.retime(str(tmp_path), 1)
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == 'ddg real speed-up (retimed from ddg-K-3-cores-0-1-2): 3.25'
  cases = lines[
    : lines.index("between two tasks of a lane, in the steady window (its rounds' gaps pooled):")
  ]
  (ddg,) = [line.split() for line in cases if line.lstrip().startswith('ddg-K-3')]
  assert ddg[1:3] == ['7500.0', '3.25'] and ddg[-2:] == ['10000.0', '5000.0']  # ms
  # Its stage 0's gaps between updates: 9 s thrice (window 30-60), then 4 s thrice (15-30).
  gaps = lines[len(cases) + 1 :]
  row = 'ddg-K-3-cores-0-1-2 stage 0 update -> update 6 6500.00 6500.00 -'.split()
  assert row in [line.split() for line in gaps]


def test_each_rounds_trace_is_written_under_its_cases_file_name_and_named_back(tmp_path):
  """`--traces`: round n of a case is `<case in a file name's letters>-round<n>.json`, a
  trace of the last run, and `cases.json` maps each file name back to its case, kept
  across calls."""
  from benchmarks import real_speedup
  from jaxsgd.scheduler.timeline import TaskRecord, Timeline

  timeline = Timeline(['stage 0'], [TaskRecord(0, 'update', 0.5, 1.0, 0, 0)], 'real')
  real_speedup.LAST_RUN['timeline'] = timeline
  real_speedup.write_trace(str(tmp_path), 'bp (1 lane, core 0)', 1)
  real_speedup.write_trace(str(tmp_path), 'ddg K=2 (cores 0, 1)', 2)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    'bp-1-lane-core-0-round1.json',
    'cases.json',
    'ddg-K-2-cores-0-1-round2.json',
  ]
  with open(tmp_path / 'cases.json') as f:
    assert json.load(f) == {
      real_speedup.BP_TRACE: 'bp (1 lane, core 0)',
      'ddg-K-2-cores-0-1': 'ddg K=2 (cores 0, 1)',
    }
  with open(tmp_path / 'ddg-K-2-cores-0-1-round2.json') as f:
    assert Timeline.from_chrome_trace(json.load(f)) == timeline


def test_update_ends_keep_the_batches_updated_on_as_many_lanes_as_any():
  """Two lanes: batch 1 on one lane only is left out, whichever lane; the last end of
  each batch kept; no updates, no batches."""
  from benchmarks.common import update_ends

  updates = [(0, 0, 5.0), (1, 0, 7.0), (1, 1, 9.0), (0, 2, 11.0), (1, 2, 10.0)]
  assert update_ends(updates) == {0: 7.0, 2: 11.0}
  assert update_ends([(0, 0, 1.0), (0, 1, 2.0)]) == {0: 1.0, 1: 2.0}
  assert update_ends([]) == {}


def test_an_intervals_overlap_with_a_window_is_the_part_inside_it():
  """[begin, end] against the window [10, 30]: inside, across either edge, around it,
  outside it, and touching it at a point."""
  from benchmarks.common import overlap

  cases = [((12, 18), 6), ((5, 15), 5), ((25, 40), 5), ((0, 50), 20), ((31, 40), 0), ((5, 10), 0)]
  assert [overlap(begin, end, 10, 30) for (begin, end), _ in cases] == [s for _, s in cases]


def test_a_lanes_time_between_calls_is_split_inside_the_window_by_hand():
  """`lane_overheads`' split of one lane's time over the window [10, 30], its calls
  (sent, entered, started, ended) given in any order: the first busy 10-14 (it entered
  before the window: not counted); the second, sent at 12 while the first ran, a queued
  hand-over 14-15, imports 15-16, busy 16-20; the third, sent at 23 after the second
  ended, the driver's 20-23, a hand-over 23-24, imports 24-24.5, busy 24.5-30 of 35.
  The parts add up to the window's 20 s; only the queued hand-over is a `queued` one."""
  from benchmarks import lane_overheads

  calls = [(23, 24, 24.5, 35), (0, 5, 6, 14), (12, 15, 16, 20)]
  assert lane_overheads.between_calls(calls, 10, 30) == {
    'busy': 13.5,
    'imports': 1.5,
    'driver': 3.0,
    'hand-overs': 2.0,
    'calls': 2,
    'queued': [1],
  }
  with pytest.raises(ValueError, match='entered the lane at 13 before the last ended at 14'):
    lane_overheads.between_calls([(0, 5, 6, 14), (12, 13, 16, 20)])


def test_a_lane_process_cpu_is_split_into_its_task_thread_copy_threads_and_named_threads():
  """`lane_threads.split_threads` by hand: between the two readings thread 11 used 0.09 s
  (the most: the task thread), Python's threads 12 and 14 (the process's own name) 0.01
  and 0.005 (copies), Ray's `worker.io` 0.002; thread 13 used nothing (left out), and
  thread 15, new, 0.001 (copies: counted from zero). A lane of code that names none of
  its threads: its copy threads are all `copies: other`."""
  from benchmarks import lane_threads

  name = 'ray::LaneRuntim'  # the OS name: the process's, cut to 15 characters
  before = {11: (name, 1.0), 12: (name, 0.5), 13: (name, 0.2), 14: (name, 0.1)}
  before[16] = ('worker.io', 0.3)
  after = {11: (name, 1.09), 12: (name, 0.51), 13: (name, 0.2), 14: (name, 0.105)}
  after.update({15: (name, 0.001), 16: ('worker.io', 0.302)})
  parts = lane_threads.split_threads(before, after, 'ray::LaneRuntime')
  assert parts.keys() == {'task thread', 'copy threads', 'copies: other', 'worker.io'}
  assert parts['task thread'] == pytest.approx(0.09)
  assert parts['copy threads'] == pytest.approx(0.016)
  assert parts['copies: other'] == pytest.approx(0.016)
  assert parts['worker.io'] == pytest.approx(0.002)
  assert lane_threads.split_threads(before, before, 'ray::LaneRuntime') == {}


def test_a_lane_process_cpu_is_split_by_the_names_the_lane_gives_its_threads():
  """`lane_threads.split_threads` by hand, on a lane that names its threads for the OS
  (`runtime.THREAD_NAMES`): the task thread is the calls thread (0.03 s) and the thread
  with the process's name that computes the tasks (XLA's: 0.4), and the main thread
  (0.001); the export thread (0.05), both lane readers (0.004 and 0.002) and the driver
  reader (0.001) are copy threads, each under its role; XLA's pool thread by its name."""
  from benchmarks import lane_threads
  from jaxsgd.scheduler.lanes import runtime

  names = runtime.THREAD_NAMES
  threads = {  # thread id: (its OS name, CPU seconds at the first reading, used since)
    1: (names['calls'], 2.0, 0.03),
    2: (names['exports'], 1.0, 0.05),
    3: (names['lane reader'], 0.1, 0.004),
    4: (names['lane reader'], 0.2, 0.002),
    5: (names['driver reader'], 0.3, 0.001),
    6: ('tf_XLAEigen', 0.4, 0.002),
    7: ('jaxsgd::LaneRun', 5.0, 0.4),
    8: ('jaxsgd::LaneRun', 0.5, 0.001),
  }
  before = {tid: (name, at) for tid, (name, at, _) in threads.items()}
  after = {tid: (name, at + used) for tid, (name, at, used) in threads.items()}
  parts = lane_threads.split_threads(before, after, 'jaxsgd::LaneRuntime')
  assert parts.keys() == {
    'task thread',
    'copy threads',
    'copies: exports',
    'copies: lane reader',
    'copies: driver reader',
    'tf_XLAEigen',
  }
  assert parts['task thread'] == pytest.approx(0.431)
  assert parts['copy threads'] == pytest.approx(0.057)
  assert parts['copies: exports'] == pytest.approx(0.05)
  assert parts['copies: lane reader'] == pytest.approx(0.006)
  assert parts['copies: driver reader'] == pytest.approx(0.001)
  assert parts['tf_XLAEigen'] == pytest.approx(0.002)


def test_real_speedup_places_a_lanes_copy_threads_apart_and_refuses_bad_copies(capsys):
  import argparse

  from benchmarks import real_speedup

  placement = real_speedup.lane_placement(2, ('ddg', 'pdasgd'), copies={'backwardworker0': '0'})
  assert placement['backwardworker0'].copy_cores == (0,)
  together = real_speedup.lane_placement(2, ('ddg', 'pdasgd'))  # its tasks' cores unchanged
  assert placement['backwardworker0'].cores == together['backwardworker0'].cores
  assert together['backwardworker0'].copy_cores is None
  assert {lane.name for lane in placement.lanes if lane.copy_cores} == {'backwardworker0'}
  with pytest.raises(ValueError, match=r'--copies: no lane worker9 in these cases; their lanes:'):
    real_speedup.lane_placement(2, ('ddg',), copies={'worker9': '0'})
  parser = argparse.ArgumentParser()
  assert real_speedup.copies_or_error(parser, 'stage1:0; ') == {'stage1': '0'}
  placed, copies = real_speedup.placement_or_error(parser, 2, ('ddg',), 'auto', 'stage1:0')
  assert copies == {'stage1': '0'} and placed['stage1'].copy_cores == (0,)
  assert placed['stage0'].copy_cores is None and placed['stage1'].moves == 'auto'
  with pytest.raises(SystemExit):
    real_speedup.copies_or_error(parser, 'stage1:9999')
  assert '--copies: lane:cores entries separated by ";"' in capsys.readouterr().err
  # `--copies=auto` and `own` (real_speedup's, not lane_threads'): none apart at start
  for word in ('auto', 'own'):
    placed, copies = real_speedup.placement_or_error(parser, 2, ('ddg',), 'auto', word, True)
    assert copies == {} and all(lane.copy_cores is None for lane in placed.lanes)
  with pytest.raises(SystemExit):
    real_speedup.placement_or_error(parser, 2, ('ddg',), 'auto', 'auto')
  assert "; got 'auto'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    real_speedup.copies_or_error(parser, 'stage1', words=True)
  assert ", or auto, own or run; got 'stage1'" in capsys.readouterr().err


def test_real_speedup_by_load_moves_only_the_copies_whose_place_changes_and_says_why():
  """`--copies=auto`: before each case, `place_copies` moves the copy threads of the
  lanes whose place differs from the case's (a lane it does not name: back to its own
  cores), and no other; `describe_loads` prints each lane's tasks + copies a step."""
  from benchmarks import real_speedup

  class Pool:
    placement = types.SimpleNamespace(names=('stage0', 'stage1', 'sharedmodel'))
    calls = []

    def place_copies(self, lane, cores):
      self.calls.append((lane, cores))

  pool, now = Pool(), {}
  real_speedup.place_copies(pool, {'stage1': (0,)}, now)
  real_speedup.place_copies(pool, {'stage1': (0,)}, now)  # (in place already)
  assert pool.calls == [('stage1', (0,))] and now['stage1'] == (0,)
  real_speedup.place_copies(pool, {'sharedmodel': (1,)}, now)
  assert pool.calls[1:] == [('stage1', None), ('sharedmodel', (1,))]
  loads = {'stage1': (0.0912, 0.012), 'stage0': (0.0575, 0.0148)}
  cores = {'stage0': (0,), 'stage1': (1,)}
  assert real_speedup.describe_loads(loads, cores, {'stage1': (0,)}) == (
    'stage0 on 0: 57.5 + 14.8 ms, stage1 on 1: 91.2 + 12.0 ms; copies of stage1 to 0'
  )
  assert real_speedup.describe_loads(loads, cores, {}).endswith('; each lane keeps its copies')


def test_the_drivers_cpu_is_split_by_role_and_one_more_task_is_a_difference_by_hand():
  """driver_cpu: the main thread by its id, the lanes' readers and the writer by the
  names they give themselves, the rest as `other`; a thread new since the first reading
  counts from zero. One more task: (long - short) / (300 - 60 tasks)."""
  from benchmarks import driver_cpu
  from jaxsgd.scheduler.lanes import wire

  before = {
    10: ('python', 1.0),
    11: (wire.REPLIES_THREAD, 0.5),
    12: (wire.REPLIES_THREAD, 0.25),
    13: (wire.WRITER_THREAD, 0.125),
    14: ('worker.io', 2.0),
  }
  after = {
    10: ('python', 1.5),
    11: (wire.REPLIES_THREAD, 0.75),
    12: (wire.REPLIES_THREAD, 0.25),
    13: (wire.WRITER_THREAD, 0.25),
    14: ('worker.io', 2.0625),
    15: (wire.REPLIES_THREAD, 0.125),  # started between the readings
    16: ('python', 0.03125),  # an unnamed thread: not the main one, whatever its name
  }
  assert driver_cpu.driver_roles(before, after, main_tid=10) == {
    'main': 0.5,
    'replies': 0.25 + 0.125,
    'writer': 0.125,
    'other': 0.0625 + 0.03125,
  }
  short = {'main': 0.75, 'replies': 0.5}
  long = {'main': 3.75, 'replies': 2.0}
  assert driver_cpu.per_task(short, long, (60, 300)) == {'main': 3.0 / 240, 'replies': 1.5 / 240}
  with pytest.raises(ValueError, match='more tasks'):
    driver_cpu.per_task(short, long, (300, 300))


def test_a_threads_cpu_is_read_from_schedstat_else_from_stat_ticks(tmp_path):
  """`common.thread_seconds`: `schedstat`'s nanoseconds where the system keeps them; all
  zero (the scheduler's statistics off) or missing, `stat`'s user and system ticks."""
  from benchmarks import common

  ticks = common._TICKS
  # `stat`: pid (comm) then fields; utime and stime are the 12th and 13th after the comm.
  stat = '7 (a thread) S ' + ' '.join(['0'] * 10) + f' {3 * ticks} {ticks} ' + '0 ' * 5
  (tmp_path / 'stat').write_text(stat)
  (tmp_path / 'schedstat').write_text('1500000000 20 3\n')
  assert common.thread_seconds(str(tmp_path)) == 1.5
  (tmp_path / 'schedstat').write_text('0 0 0\n')
  assert common.thread_seconds(str(tmp_path)) == 4.0
  (tmp_path / 'schedstat').unlink()
  assert common.thread_seconds(str(tmp_path)) == 4.0


@pytest.mark.parametrize(
  'flags, says',
  [
    (['--leaves', '1,x'], '--leaves: comma-separated whole numbers expected'),
    (['--leaves', '4,4'], '--leaves: different counts, each at least 1 array'),
    (['--leaves', '0'], '--leaves: different counts, each at least 1 array'),
    (['--tasks', '24'], '--tasks: at least 25'),
    (['--busy_tasks', '5'], '--busy_tasks: at least 25'),
    (['--rounds', '0'], '--rounds: at least 1'),
  ],
)
def test_driver_cpu_refuses_bad_flags_in_one_line(flags, says, capsys):
  from benchmarks import driver_cpu

  with pytest.raises(SystemExit):
    driver_cpu.parse_args(flags)
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert says in error


def test_driver_cpu_leaves_the_lanes_hyperthreads_alone_and_needs_a_core_besides(
  tmp_path, monkeypatch, capsys
):
  """The lane takes the last core; the driver and the busy processes every core that is
  not it or its hyperthread (`thread_siblings_list`: '2,6' or '0-1'); none left, one line."""
  from benchmarks import driver_cpu

  for core, text in {0: '0-1', 1: '0-1', 2: '2,6', 3: '3', 6: '2,6'}.items():
    (tmp_path / f'{core}').write_text(text + '\n')
  monkeypatch.setattr(driver_cpu, 'TOPOLOGY', str(tmp_path / '{core}'))
  assert driver_cpu.siblings(6) == {2, 6} and driver_cpu.siblings(0) == {0, 1}
  assert driver_cpu.siblings(5) == {5}  # (no topology: the core alone)
  monkeypatch.setattr(driver_cpu.os, 'sched_getaffinity', lambda pid: {0, 2, 3, 6})
  args = driver_cpu.parse_args([])
  assert (args.lane_core, args.busy, args.driver_core) == (6, [0, 3], 0)
  monkeypatch.setattr(driver_cpu.os, 'sched_getaffinity', lambda pid: {0, 1})
  with pytest.raises(SystemExit):
    driver_cpu.parse_args([])
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert "a core for the driver that is not the lane's or its hyperthread needed" in error


def test_this_processs_threads_are_read_from_their_own_cpu_clocks():
  """`common.thread_cpu_seconds('self')`: every thread of this process at its own CPU
  clock, whichever thread reads it: a thread that spun and now waits reads what it read
  itself, and the reading thread between its `time.thread_time` before and after the
  call (read from `stat`'s 10-ms ticks instead, both fail)."""
  import threading
  import time

  from benchmarks import common

  spun, done = {}, threading.Event()

  def spin():
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:
      pass
    spun['tid'], spun['seconds'] = threading.get_native_id(), time.thread_time()
    done.wait()

  thread = threading.Thread(target=spin)
  thread.start()
  while 'seconds' not in spun:
    time.sleep(0.01)
  start = time.perf_counter()
  while time.perf_counter() - start < 0.02:  # (this thread runs as it reads)
    pass
  before = time.thread_time()
  read = common.thread_cpu_seconds()
  after = time.thread_time()  # (reading every thread's /proc takes this thread's CPU too)
  done.set()
  thread.join()
  assert 0 <= read[spun['tid']][1] - spun['seconds'] < 1e-3  # (then it began to wait)
  assert before <= read[threading.get_native_id()][1] <= after
