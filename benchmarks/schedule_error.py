r"""The simulator's schedule and executor error: emulated tasks against the virtual clock.

    python -m benchmarks.schedule_error                # every family, K = 2..16: ~45 min
    python -m benchmarks.schedule_error --families=ddg,asgd --lanes=2,4 --workers=
                                                       # ~3 min; --no-variants: part 1 only

Every scheduler family (staged BP, DDG, local, ASGD, DC-ASGD, PD-ASGD, LPP-SGD) runs
with K = 2, 4, 8 and 16 lanes (`--lanes`; ASGD and DC-ASGD also with M = 32 workers,
`--workers`) two ways, with the same costs (`cost.compute`: every task of every stage
costs `--forward`, `--backward`, `--update` seconds; `cost.calibrate=False`), emulated
`--repeats` times (3; interleaved, every row once per round) and virtual once. Every
task's price carries this machine's spread (`cost.straggler_std` = `--spread`, by default
measured at the start: `lane_timing.measure_task_spread`, a computing task's σ on one
lane), each lane drawing the same prices on both sides: with none, identical lanes run
in step on the virtual clock for the whole run, which lanes in processes never do
(docs/simulator.md, stragglers):

  emulated   `clock='real', executor='emulated'`: every lane an OS process, placed on
             no core in particular (`placement.lanes` without cores: K lanes on a
             machine with fewer cores is fine, an emulated task only waits), each task
             waiting exactly its price while every message moves a payload of its real
             size between the lane processes (`scheduler/process.py`, emulated tasks);
  virtual    `clock='virtual'` with the process executor's host profile (`cost.host`,
             `experiments.profile.measure_host('processes')`) measured before each
             round, each figure the median of the rounds' (`median_host`):
             its schedule (running ahead), its dispatch per task (an emulated lane's
             time between queued calls, `emulated_host`), its driver (CPU per
             event, each message's way), its moves between lane processes and copies
             made by the sending lane, and the same `placement.lanes` (every lane its
             own hardware): what `simulator_accuracy` predicts the process executor
             with — its idle figures for every row (`unloaded`: an emulated task
             waits, loading no core; the `_loaded` ones are for lanes computing on
             every core).

The two differ only where the virtual clock's model of the schedule and of the process
executor's host (driver, Ray, copies) misses what the executor does: the tasks take
the same time on both. The emulated runs of one row differ too, by several percent for
the asynchronous families on a small machine (the order in which the driver hears of
ends moves with the host's noise, and the schedule with it): a row's error is taken
against its median run, and the table gives every run and their spread — the floor
below which an error cannot be told from the measurement's noise. Per run: time per
iteration, `simulator_accuracy`'s definition
(an iteration is one applied update of the whole model; the median over blocks of 5
iterations of the steady state, after `--warmup` iterations and the workers or the
pipeline filling: `warm_up`; LPP-SGD's averaging reaching every worker), and for the
asynchronous families the staleness histograms of the steady state's applied updates
and of every one, compared by total variation distance (TVD: half the L1 distance of
the two normalized histograms).

Part 2 (`--variants`, on by default) runs the virtual clock again with the host profile
changed one figure at a time, to say what the error is made of (diagnostics: read off
the emulated run, never the prediction): no driver (its figures 0), the driver's latency
heard in the emulated run (its median from a task's end to the driver hearing of it, over
the ends whose lane's next task was dispatched after them — a lane holds the end of a
task run ahead while two calls are queued behind it —, less the CPU per event), the run's copies (every copy costing the median copy of the
emulated run: link latency, free bandwidth) and the run's host (both of the last two).

Part 3 says where the emulated runs' time went: the copies (median duration in each
run's trace), the time from a copy's end to the start of the task that reads it (where
its lane waited for it), a lane's time between two queued calls (from a task's end to
the start of its next, which the driver had sent before that end: the traces'
`dispatched`), against the dispatch the virtual runs price, the driver (median time from
a task's end to the driver hearing of it; its CPU per event), the busiest compute lane's
utilization, and the host's CPU over the steady state (the cores busy: the driver, the
lane processes and Ray's own, sampled every 0.5 s; every process of the Ray cluster this
benchmark starts descends from it). Then every emulated run of a row with copies: its
median copy, the cores the hypervisor and other processes took, its page faults and
preemptions, and how a run's pace follows each (Pearson's r over the runs, each relative
to its row's median: `run_correlations`).

The emulated runs' waits are checked too: each compute task's duration in the trace
less its price (median and largest over the steady state), i.e. the wait's accuracy
under the run's load (a first call of a task kind in a lane traces its function, so
the warm-up is left out). And whether an emulated lane costs its executor what a
computing one does: at the start, the round trip of a task waited for (dispatch to the
driver hearing of its end, less the task) on one lane, for a trivial task, a task of
matrix products (~25-45 ms), and emulated tasks of those durations (`round_trips`).

Values a task reads from another lane without a `Send` (PD-ASGD's layers and residuals,
LPP-SGD's snapshots and means: handles passed to a task) are moved as part of that
task's call and have no copy of their own in the emulated run's trace; the virtual
clock prices each as a copy.
"""

import argparse
import collections
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np

from jaxsgd.errors import Preempted

from benchmarks import simulator_accuracy as accuracy

FAMILIES = accuracy.FAMILIES
ASYNCHRONOUS = accuracy.ASYNCHRONOUS
WORKER_FAMILIES = ('asgd', 'dcasgd')  # also run with `--workers` (M) lanes
# The emulated dispatch's lane (`placement.lanes`): on no core, as the rows' lanes are.
EMULATED_LANE_SPEC = 'lane'
VARIANTS = ('no driver', 'heard driver', "run's copies", "run's host")


def label(name: str, lanes: int) -> str:
  """A family with K lanes (M workers), as in the tables."""
  return accuracy.labels(lanes)[name]


def warm_up(name: str, lanes: int, args) -> int:
  """Iterations left out of a run's steady state (beside each lane's first `--warmup`
  tasks and its first of each kind, `accuracy.window`): `--warmup`, then the pipeline
  or the workers filling (K stages fill in ~K iterations; M workers each push every ~M
  server updates). Both sides leave them out: the lanes compile each task on first use,
  which the virtual clock does not price, and what queued meanwhile drains in these
  iterations (PD-ASGD 1:15's emulated updates were staler than 3 until its 27th
  iteration of 81, none on the virtual clock; from the 41st on, each layer's were at
  most one update apart). LPP-SGD leaves out 64 K: its steady state begins once every
  worker has merged an averaging round (`accuracy.window`: each lane's first task of
  each kind), a round takes every replica's snapshot, and the lanes' staggered first
  compiles delay it (16 emulated workers on 2 cores began 1.8-4.8 s into a run, the
  first mean came at 5.5 s and the merges, each in its replica's turn, until 6.8 s: the
  last at iteration 356, 501 and past 521 of three runs; on the virtual clock at 96)."""
  if name == 'bp':
    return args.warmup
  if name == 'lppsgd':
    return args.warmup + 64 * lanes
  return args.warmup + (4 if name in accuracy.IN_ROUNDS else 2) * lanes


def steps_of(name: str, lanes: int, args) -> int:
  """Iterations of a run: `warm_up`'s, then `--blocks` blocks (an ASGD, DC-ASGD or LPP-SGD
  iteration is one worker's update, and their blocks are the fewest whole rounds of K
  updates that make at least 5, for LPP-SGD at least an averaging period:
  `accuracy.block_for`)."""
  block = accuracy.block_for(lanes, name) if name in accuracy.IN_ROUNDS else accuracy.BLOCK
  return warm_up(name, lanes, args) + block * args.blocks + 1


def placed_lanes(name: str, lanes: int) -> str:
  """`placement.lanes` of family `name` with K lanes, none pinned to a core."""
  from benchmarks import common as bench_common

  return '; '.join(bench_common.unplaced_lanes(name, lanes))


def host_file(base, root: str, tag: str, **figures) -> str:
  """The host profile `base` with `figures` changed (the loaded ones alike), as a file in
  `root`: what a virtual run of this benchmark reads as `cost.host`."""
  from jaxsgd.scheduler import host as host_lib

  have = dict(base.figures)
  loaded = {f'{name}_loaded': value for name, value in figures.items()}
  changed = {**figures, **{name: v for name, v in loaded.items() if name in have}}
  path = os.path.join(root, f'host-{tag}.json')
  host_lib.save(with_figures(base, changed), path)
  return path


def unloaded(host):
  """`host` with each `_loaded` figure replaced by its idle one, and no `upkeep`, for
  every row: an emulated task waits and takes no core, so K emulated lanes on fewer cores
  do not load the host (the loaded figures describe lanes computing on every core, which
  the virtual clock applies wherever a run has as many lanes as the profile has cores)."""
  figures = dict(host.figures)
  idle = {n: figures[n.removesuffix('_loaded')] for n in figures if n.endswith('_loaded')}
  return with_figures(host, {**idle, 'upkeep': 0.0})


def with_figures(host, changed: dict):
  """The host profile `host` (`HostProfile`) with the figures in `changed` replaced."""
  from jaxsgd.scheduler import host as host_lib

  return host_lib.make(host.executor, {**dict(host.figures), **changed}, cores=host.cores)


def config_of(name: str, lanes: int, args, side: str, host: str | None = None):
  """The config of family `name` with `lanes` lanes for `side` ('emulated' or 'virtual';
  `host`: the virtual clock's host profile file)."""
  shape = argparse.Namespace(
    hidden=args.hidden, depth=args.depth, batch=args.batch, lanes=lanes, steps=1
  )
  config = accuracy.family_config(name, shape, 'tables')
  config.train_steps = config.eval_every = steps_of(name, lanes, args)
  config.placement.lanes = placed_lanes(name, lanes)
  config.cost.calibrate = False
  config.cost.compute = {'forward': args.forward, 'backward': args.backward, 'update': args.update}
  config.cost.straggler_std = args.spread  # each lane's draws the same on both sides
  if side == 'emulated':
    config.clock, config.executor = 'real', 'emulated'
    return config
  config.clock, config.executor = 'virtual', 'in_process'
  config.cost.host = host
  return config


def total_variation(p: dict, q: dict) -> float:
  """Half the L1 distance of two histograms `{value: count}`, each normalized."""
  keys = set(p) | set(q)
  np_, nq = sum(p.values()), sum(q.values())
  if not np_ or not nq:
    return float('nan')
  return 0.5 * sum(abs(p.get(k, 0) / np_ - q.get(k, 0) / nq) for k in keys)


def wait_error(workdir: str, warmup: int, prices: dict, iterations: int) -> list[float]:
  """Seconds each compute task of the steady state (after `iterations`, `warm_up`) lasted
  beyond its price (`prices`: the summary's `cost_model_ms`, 'stage k kind' -> ms)."""
  names, tasks = accuracy.read_trace(workdir)
  start, _, _ = accuracy.window(names, tasks, warmup, accuracy._per_task(workdir), iterations)
  over = []
  for lane, kind, begin, end, _, stage in tasks:
    price = prices.get(f'stage {stage} {kind}')
    if begin >= start and price is not None and not names[lane].startswith('link '):
      over.append(end - begin - price / 1e3)
  return over


def run(
  config, workdir: str, warmup: int, sampler: 'CpuSampler | None' = None, *, iterations: int
) -> dict:
  """Trains `config` into `workdir`: its steady-state statistics (`accuracy.window_stats`,
  after `iterations`, `warm_up`, each lane's first `warmup` tasks and its first of each
  kind; blocks of whole rounds where every update is an iteration, `accuracy.IN_ROUNDS`)
  and staleness histogram (with `sampler`, the host's CPU over the steady state:
  `CpuSampler.busy`)."""
  from jaxsgd import training

  if sampler is not None:
    sampler.begin()
  try:
    summary = training.train_and_evaluate(config, workdir, show_progress=False, overwrite=True)
  finally:
    if sampler is not None:
      sampler.end()
  stats = accuracy.steady_stats(workdir, warmup, iterations)
  stats['staleness'] = {int(k): v for k, v in summary.get('staleness_histogram', {}).items()}
  stats['prices'] = summary.get('cost_model_ms', {})
  names, tasks = accuracy.read_trace(workdir)
  start, stop = stats['steady']
  stats['staleness_steady'] = steady_staleness(workdir, tasks, start, accuracy._per_task(workdir))
  steady = [t for t in tasks if t[2] >= start]
  copies = [e - b for lane, _, b, e, _, _ in steady if names[lane].startswith('link ')]
  stats['copy_ms'] = _median_ms(copies)
  stats['reader_ms'] = _median_ms(reader_gaps(names, steady))
  stats['queued_gap_ms'] = _median_ms(queued_gaps(workdir, start))
  # the driver's events: a task dispatched and its end heard; a copy dispatched
  stats['events'] = sum(1 if names[t[0]].startswith('link ') else 2 for t in steady)
  stats['window'] = stop - start
  if sampler is not None:
    stats['cpu'] = sampler.busy(start, stop)
    stats['others_by_name'] = sampler.others_by_name()
  return stats


def steady_staleness(workdir: str, tasks, start: float, per_task: bool) -> dict[int, int]:
  """The staleness histogram of the steady state's updates (`staleness.npz`): of each group
  (a layer, a worker), the updates after the share of the run's iterations that ended
  before the window began (`accuracy.window`). A lane compiles each task on first use, so
  on lanes the first iterations run slower than priced and their updates are staler (a
  PD-ASGD 1:7 forward worker computed its first batches while the backward workers were
  still compiling: staleness up to 7 on every layer, against at most 3 in the steady
  state); the virtual clock prices no compiling."""
  path = os.path.join(workdir, 'staleness.npz')
  if not os.path.exists(path):
    return {}
  ends = accuracy.iteration_ends(tasks, per_task)
  before = sum(end < start for end in ends) / len(ends)
  with np.load(path) as every:
    kept = [every[name][round(before * len(every[name])) :] for name in every.files]
  values, counts = np.unique(np.concatenate(kept or [np.zeros(0, np.int64)]), return_counts=True)
  return {int(v): int(n) for v, n in zip(values, counts)}


def reader_gaps(names: dict, tasks) -> list[float]:
  """Seconds from a copy's end to the start of the next task on its receiving lane, for
  each copy that landed while that lane was idle (after the lane's previous task ended):
  what reading a moved value costs beyond the copy (taking it in; and the task's call
  reaching the lane, if the driver had not sent it yet)."""
  lanes = {}
  for lane, _, begin, end, _, _ in tasks:
    if not names[lane].startswith('link '):
      lanes.setdefault(names[lane], []).append((begin, end))
  gaps = []
  for lane, _, _, end, _, _ in tasks:
    receiver = _receiver_of(names[lane])
    if receiver is None:
      continue
    runs = sorted(lanes.get(receiver, ()))
    before = [e for b, e in runs if b < end]
    after = [b for b, _ in runs if b >= end]
    if after and (not before or max(before) <= end):
      gaps.append(after[0] - end)
  return gaps


def queued_gaps(workdir: str, since: float) -> list[float]:
  """Seconds from a compute task's end to its lane's next start, where the driver had
  dispatched that next task before the end (`TaskRecord.dispatched`, in the trace) and no
  copy to the lane landed in between (the task waited for no value sent to it): the
  lane's own time between two queued calls, in the run — what the host profile's
  `dispatch` prices. Tasks starting before `since` left out."""
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
  lanes, landed = {}, {}  # lane name -> its tasks; -> when copies to it ended (µs)
  for e in events:
    if e.get('ph') != 'X':
      continue
    name = names.get(e['tid'], '')
    receiver = _receiver_of(name)
    if receiver is not None:
      landed.setdefault(receiver, []).append(e['ts'] + e['dur'])
    elif 'dispatched' in e['args'] and e['ts'] / 1e6 >= since:
      lanes.setdefault(name, []).append(e)
  gaps = []
  for name, tasks in lanes.items():
    tasks.sort(key=lambda e: e['ts'])
    arrivals = landed.get(name, ())
    for a, b in zip(tasks, tasks[1:]):
      end = a['ts'] + a['dur']
      waited = any(end < t <= b['ts'] for t in arrivals)
      if b['args']['dispatched'] < end and not waited:
        gaps.append((b['ts'] - end) / 1e6)
  return gaps


def _receiver_of(lane_name: str) -> str | None:
  """The lane a link lane (`Cluster.link`: 'link <sender> → <receiver>') copies to; None
  for any other lane."""
  if not lane_name.startswith('link ') or ' → ' not in lane_name:
    return None
  return lane_name.split(' → ', 1)[1]


def _median_ms(seconds: list) -> float | None:
  return 1e3 * float(np.median(seconds)) if seconds else None


class CpuSampler:
  """The CPU seconds of this process and of every process descending from it (the lane
  processes and Ray's own, the cluster being started here), sampled every `period`
  seconds while a run is on, with the time the run's process executor began (its
  trace's 0: `ProcessExecutor.begin`, wrapped)."""

  def __init__(self, period: float = 0.5):
    import psutil

    from jaxsgd.scheduler import process

    self.psutil, self.period, self.kinds = psutil, period, {}
    self.samples: list[tuple[float, dict]] = []
    self.t0 = None
    begin = process.ProcessExecutor.begin

    def noted_begin(executor, begin=begin):
      begin(executor)
      self.t0 = executor._t0  # pylint: disable=protected-access

    process.ProcessExecutor.begin = noted_begin

  def begin(self) -> None:
    import threading

    self.samples, self.t0, self._stop = [], None, threading.Event()
    self._first = (time.time(), self._every_process())
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()

  def end(self) -> None:
    self._stop.set()
    self._thread.join()
    self._last = (time.time(), self._every_process())

  def _every_process(self) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) of every process on the machine, kernel threads too."""
    found = {}
    for process in self.psutil.process_iter(['name', 'cpu_times']):
      times = process.info['cpu_times']
      if times is not None:
        found[process.pid] = (process.info['name'] or '?', times.user + times.system)
    return found

  def others_by_name(self, top: int = 3) -> list[tuple[str, float]]:
    """The processes that were not the run's (nor this one's) using most CPU from `begin`
    to `end`, cores by name, busiest first: who the `others` of `busy` were (those are
    over the steady state, these over the whole run)."""
    (t1, first), (t2, last) = self._first, self._last
    own = {pid for _, cpu in self.samples for pid in cpu if isinstance(pid, int)}
    by_name = collections.Counter()
    for pid, (name, seconds) in last.items():
      if pid not in own and pid != os.getpid():
        by_name[name] += (seconds - first.get(pid, (name, 0.0))[1]) / (t2 - t1)
    return [(name, cores) for name, cores in by_name.most_common(top) if cores >= 0.005]

  def _sample(self) -> None:
    import threading

    me = self.psutil.Process()
    main = threading.main_thread().native_id  # the driver thread: the executor's loop
    while not self._stop.is_set():
      cpu = {}
      for process in [me, *me.children(recursive=True)]:
        try:
          times = process.cpu_times()
          cpu[process.pid] = (self._kind(process), times.user + times.system)
          cpu[('faults', process.pid)] = ('faults', _minor_faults(process.pid))
          cpu[('preempted', process.pid)] = ('preempted', process.num_ctx_switches().involuntary)
        except (self.psutil.Error, OSError):
          pass
      # The driver thread alone, as the host profile's `driver` is measured
      # (`lane_timing._driver_figures`: `time.thread_time`); the driver process's CPU
      # also counts Ray's threads in it and this sampler.
      thread = next((t for t in me.threads() if t.id == main), None)
      if thread is not None:
        cpu['driver thread'] = ('driver thread', thread.user_time + thread.system_time)
      # The whole machine's: what its hypervisor took from its cores (a VM's `steal`), and
      # every process's CPU, of which the run's own is the rest above.
      machine = self.psutil.cpu_times()
      cpu['stolen'] = ('stolen', getattr(machine, 'steal', 0.0))
      cpu['machine'] = (
        'machine',
        sum(machine)
        - machine.idle
        - getattr(machine, 'iowait', 0.0)
        - getattr(machine, 'steal', 0.0)
        - getattr(machine, 'guest', 0.0)
        - getattr(machine, 'guest_nice', 0.0),
      )
      self.samples.append((time.time(), cpu))
      self._stop.wait(self.period)

  def _kind(self, process) -> str:
    """'driver' (this process), 'lanes' (a Ray worker process, `default_worker.py` until it
    titles itself `ray::...`: every one is a lane here, or an idle worker about to be
    one) or 'ray' (GCS, raylet, monitors, Ray's agents)."""
    kind = self.kinds.get(process.pid)
    if kind is None:
      if process.pid == os.getpid():
        kind = 'driver'
      else:
        title = ' '.join(process.cmdline())
        worker = 'default_worker.py' in title or title.startswith('ray::')  # (its title, later)
        kind = 'lanes' if worker and 'Agent' not in title else 'ray'
      self.kinds[process.pid] = kind
    return kind

  def busy(self, start: float, stop: float) -> dict | None:
    """Cores busy from `start` to `stop` (seconds of the run's trace), in all, by kind of
    process ('driver', 'lanes', 'ray') and the busiest lane process's, and per second the
    run's processes' minor page faults ('faults') and involuntary context switches
    ('preempted': a process made to give up its core); None without samples then."""
    if self.t0 is None:
      return None
    inside = [(t - self.t0, cpu) for t, cpu in self.samples if start <= t - self.t0 <= stop]
    if len(inside) < 2:
      return None
    (t1, first), (t2, last) = inside[0], inside[-1]
    busy = {'all': 0.0, 'driver': 0.0, 'lanes': 0.0, 'ray': 0.0, 'busiest lane': 0.0}
    apart = ('driver thread', 'stolen', 'machine', 'faults', 'preempted')  # (not in 'all')
    busy |= {kind: 0.0 for kind in apart}
    for pid, (kind, seconds) in last.items():
      used = (seconds - first.get(pid, (kind, 0.0))[1]) / (t2 - t1)
      busy[kind] += used
      busy['all'] += used if kind not in apart else 0.0
      if kind == 'lanes':
        busy['busiest lane'] = max(busy['busiest lane'], used)
    busy['others'] = max(busy.pop('machine') - busy['all'], 0.0)  # processes not the run's
    return busy


def _minor_faults(pid: int) -> int:
  """The minor page faults process `pid` has taken (Linux's /proc/PID/stat, field 10: a
  page touched for the first time, or taken back from the kernel)."""
  with open(f'/proc/{pid}/stat', 'rb') as stat:
    return int(stat.read().rsplit(b')', 1)[1].split()[7])


def round_trips(pool, reps: int = 40) -> dict:
  """Seconds from the driver sending a task to lane `lane` of `pool` to its hearing
  of the task's end, less the task's own duration, median of `reps` tasks waited for one
  at a time: a trivial task (a 4-byte add), a task of ~25-45 ms of matrix products
  (`lane_timing.dispatch_tasks`' 'busy'), and emulated tasks of those two durations.
  Whether an emulated lane costs its executor what a computing lane does, and what a
  task's round trip costs beside the trivial one the driver's figures are measured on."""
  from jaxsgd.scheduler import lane_timing
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  def chain(name: str, seconds):
    task = Task(TaskRecipe.of(lane_timing.dispatch_tasks), name)
    y, durations, overheads = np.zeros((), np.float32), [], []
    for rep in range(reps + 3):  # the first 3: compiling, warming
      sent = time.perf_counter()
      pending = pool.start('lane', task, (y,), **({} if seconds is None else {'seconds': seconds}))
      pool.wait_any([pending])
      wall, y = time.perf_counter() - sent, pending.result()
      if rep >= 3:
        durations.append(pending.ended - pending.started)
        overheads.append(wall - durations[-1])
    return float(np.median(durations)), float(np.median(overheads))

  trivial, trivial_over = chain('add_one', None)
  busy, busy_over = chain('busy', None)
  return {
    'trivial': (trivial, trivial_over),
    'busy': (busy, busy_over),
    'emulated trivial': chain('add_one', trivial),
    'emulated busy': chain('busy', busy),
  }


def emulated_host(host, dispatch: float):
  """The host profile of the emulated rows' virtual runs: `host`'s idle figures
  (`unloaded`) with `dispatch` — an emulated lane's time between two queued calls
  (`lane_timing.measure_call_gap` with emulated tasks) — as the dispatch, idle and loaded.
  A lane that slept through its task can take longer between calls than one that
  computed (the host profile's `dispatch`): the emulated rows are compared with the
  executor that runs them."""
  return with_figures(unloaded(host), {'dispatch': dispatch, 'dispatch_loaded': dispatch})


def measure_round_host(args):
  """The host profile the virtual runs would price the rows with, measured now, and the
  profile as measured (`experiments.profile.measure_host('processes')`): the first is the
  second's idle figures with an emulated lane's dispatch (`emulated_host`) — on a lane
  placed as the rows' are (on no core in particular), after emulated tasks of `--forward`
  seconds, the median of 9 chains of 40. Pinned, a lane's queued calls come closer and
  spread less than the rows' do (benchmarks/results/schedule_error.md)."""
  from experiments import profile as profile_command
  from jaxsgd.scheduler import lane_timing
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool

  measured = profile_command.measure_host('processes')
  placement = LanePlacement.parse(EMULATED_LANE_SPEC)
  with LanePool(placement, verbose=False) as pool:
    dispatch = lane_timing.measure_call_gap(
      pool, placement.names[0], seconds=args.forward, repeats=9
    )
  return emulated_host(measured, dispatch), measured


def median_host(hosts: list):
  """One host profile from several measurements of it (`HostProfile`s of one executor and
  host): each figure the median of its measurements. On a shared machine a host's
  figures can move from one measurement to the next, minutes apart, by more than the
  error this benchmark looks for, while the emulated rows run alike
  (benchmarks/results/schedule_error.md): the rows, whose emulated runs are spread over
  every round, are priced with figures measured over the rounds alike."""
  kinds = {(host.executor, host.cores) for host in hosts}
  if len(kinds) != 1:  # (a profile of one executor has all of its figures: `host.make`)
    raise ValueError(f'median_host: profiles of one executor and host; got {sorted(kinds)}')
  names = [name for name, _ in hosts[0].figures]
  median = {name: float(np.median([host.figure(name) for host in hosts])) for name in names}
  return with_figures(hosts[0], median)


# The figures a round's line shows; each round's others are in the JSON (`--out`), and the
# spread of every figure over the rounds on the line after the rounds.
ROUND_FIGURES = ('dispatch', 'driver', 'driver_latency', 'link_latency', 'link_per_array')


def _host_line(host, measured) -> str:
  shown = ', '.join(f'{name} {1e6 * host.figure(name):.0f} µs' for name in ROUND_FIGURES)
  return f"{shown} (a computed task's dispatch: {1e6 * measured.figure('dispatch'):.0f} µs)"


def _host_spread(hosts: list) -> str:
  """Each figure's spread over the measurements, (largest - smallest) / median: the idle
  figures the rows are priced with (the `_loaded` copies and `upkeep` left out), 'inf'
  where a bandwidth was measured infinite (a move no slower for more bytes)."""
  spreads = []
  for name, _ in hosts[0].figures:
    if name.endswith('_loaded') or name == 'upkeep':
      continue
    values = [host.figure(name) for host in hosts]
    middle = float(np.median(values))
    if all(np.isfinite(values)) and middle > 0:
      spreads.append(f'{name} {100 * (max(values) - min(values)) / middle:.0f} %')
    elif middle > 0:
      spreads.append(f'{name} inf')
  return 'spread (largest - smallest) / median: ' + ', '.join(spreads)


def new_row(name: str, lanes: int, args) -> dict:
  """A row of the tables: family `name` with `lanes` lanes, its emulated runs to come."""
  return {'family': name, 'lanes': lanes, 'steps': steps_of(name, lanes, args), 'runs': []}


def emulate(row: dict, repeat: int, args, root: str, sampler: 'CpuSampler') -> None:
  """The row's emulated run number `repeat` (its statistics appended to `row['runs']`);
  a run that fails marks the row skipped (the other rows go on)."""
  name, lanes = row['family'], row['lanes']
  workdir = os.path.join(root, f'{name}-emulated-K{lanes}-r{repeat}')
  try:
    started = time.time()
    stats = run(
      config_of(name, lanes, args, 'emulated'),
      workdir,
      args.warmup,
      sampler,
      iterations=warm_up(name, lanes, args),
    )
    stats['seconds'], stats['workdir'] = time.time() - started, workdir
  except Preempted:  # SIGTERM: the benchmark stops, not only this row
    raise
  except Exception as error:  # noqa: BLE001 - reported in the table; the other rows go on
    row['skipped'] = f'{type(error).__name__}: {" ".join(str(error).split())[:200]}'
    del row['runs']  # (a skipped row keeps no statistics: not in the tables, nor the JSON)
    return
  row['runs'].append(stats)


def model_row(row: dict, args, host, root: str) -> dict:
  """The row's virtual runs (`host`: the measured host profile, `HostProfile`), against the
  median of its emulated runs: the run of median time per iteration (an emulated run of
  an asynchronous family on a small machine moves by several percent from one run to the
  next, its schedule with it: the virtual clock, deterministic, is compared with the
  middle run — of an even number, the slower of the two in the middle, as
  `simulator_accuracy.measured_runs` takes it — and the table says how far apart the
  runs were, in the order they ran)."""
  name, lanes, tag = row['family'], row['lanes'], f'K{row["lanes"]}'
  runs = row.pop('runs')
  emulated = sorted(runs, key=lambda stats: stats['per_iteration'])[len(runs) // 2]
  row['emulated_runs'] = [stats['per_iteration'] for stats in runs]
  row['each_run'] = [_each_run(stats) for stats in runs]
  row['emulated_seconds'] = emulated['seconds']
  try:
    left_out = warm_up(name, lanes, args)
    row['wait'] = wait_error(emulated['workdir'], args.warmup, emulated['prices'], left_out)
    virtual = run(
      config_of(name, lanes, args, 'virtual', host_file(host, root, 'measured')),
      os.path.join(root, f'{name}-virtual-{tag}'),
      args.warmup,
      iterations=left_out,
    )
  except Preempted:  # SIGTERM: the benchmark stops, not only this row
    raise
  except Exception as error:  # noqa: BLE001 - reported in the table; the other rows go on
    row['skipped'] = f'{type(error).__name__}: {" ".join(str(error).split())[:200]}'
    return row
  row['emulated'], row['virtual'] = _kept(emulated), _kept(virtual)
  if not args.variants:
    return row
  at_once = emulated['hear_delays_at_once']  # (a held end's delay is not a message's way)
  heard = float(np.median(at_once)) if at_once else 0.0
  driver = host.figure('driver')
  latency = max(heard - driver, 0.0)
  copy = host.figure('link_latency') if emulated['copy_ms'] is None else emulated['copy_ms'] / 1e3
  copies = {'link_latency': copy, 'link_bandwidth': float('inf')}
  settings = {
    'no driver': {'driver': 0.0, 'driver_latency': 0.0},
    'heard driver': {'driver_latency': latency},
    "run's copies": copies,
    "run's host": {'driver_latency': latency, **copies},
  }
  row['variants'] = {}
  for variant, figures in settings.items():
    slug = variant.replace(' ', '_').replace("'", '')
    workdir = os.path.join(root, f'{name}-virtual-{tag}-{slug}')
    try:
      config = config_of(
        name, lanes, args, 'virtual', host_file(host, root, f'{tag}-{slug}', **figures)
      )
      stats = run(config, workdir, args.warmup, iterations=warm_up(name, lanes, args))
      row['variants'][variant] = _kept(stats)
    except Preempted:  # SIGTERM: the benchmark stops, not only this row
      raise
    except Exception as error:  # noqa: BLE001
      row['variants'][variant] = {'skipped': f'{type(error).__name__}: {error}'[:200]}
  return row


def _each_run(stats: dict) -> dict:
  """What Part 3 prints of every emulated run of a row, in the order they ran: its time
  per iteration, its median copy, the cores the hypervisor took and those other processes
  used over its steady state, and the busiest of those processes over the whole run."""
  cpu = stats.get('cpu') or {}
  return {
    'per_iteration': stats['per_iteration'],
    'copy_ms': stats.get('copy_ms'),
    'stolen': cpu.get('stolen'),
    'others': cpu.get('others'),
    'faults': cpu.get('faults'),
    'preempted': cpu.get('preempted'),
    'others_by_name': stats.get('others_by_name', []),
  }


def _kept(stats: dict) -> dict:
  """What the tables and the saved results keep of a run's statistics."""
  return {
    key: stats.get(key)
    for key in (
      'per_iteration',
      'mean_per_iteration',
      'iterations',
      'staleness',
      'staleness_steady',
      'utilization',
      'copy_ms',
      'reader_ms',
      'queued_gap_ms',
      'cpu',
      'events',
      'window',
    )
  } | {
    'hear_ms': 1e3 * float(np.median(stats['hear_delays'])) if stats['hear_delays'] else None,
    'send_ms': 1e3 * float(np.median(stats['send_delays'])) if stats['send_delays'] else None,
  }


def error(row: dict, side: dict) -> float:
  measured = row['emulated']['per_iteration']
  return 100 * abs(side['per_iteration'] - measured) / measured


def print_tables(rows: list[dict], args, host) -> None:
  """The three parts' tables (module docstring), then the last lines."""
  done = [row for row in rows if 'skipped' not in row]
  _print_schedule_error(rows, done)
  if args.variants and done:
    _print_variants(done)
  if done:
    _print_where_time_went(done, host)
  _print_last_lines(done)


def _print_schedule_error(rows: list[dict], done: list[dict]) -> None:
  """Part 1: time per iteration, emulated against virtual; sets each row's error and TVD."""
  done = [row for row in rows if 'skipped' not in row]
  print()
  print('Part 1: emulated tasks (lane processes) against the virtual clock, same costs')
  header = (
    'family',
    'K',
    'steps',
    'emulated s/it',
    'virtual s/it',
    'error %',
    'TVD',
    'steady TVD',
    'emulated runs s/it (spread %)',
    'heard ms (emu/virt)',
    'wait over price µs (median/max)',
    'emulated run s',
  )
  table = []
  for row in done:
    e, v = row['emulated'], row['virtual']
    tvd = total_variation(e['staleness'], v['staleness'])
    steady = total_variation(e.get('staleness_steady', {}), v.get('staleness_steady', {}))
    row['error'], row['tvd'], row['steady_tvd'] = error(row, v), tvd, steady
    asynchronous = row['family'] in ASYNCHRONOUS
    wait = row['wait']
    table.append(
      (
        label(row['family'], row['lanes']),
        row['lanes'],
        row['steps'],
        f'{e["per_iteration"]:.4f}',
        f'{v["per_iteration"]:.4f}',
        f'{row["error"]:.1f}',
        f'{tvd:.3f}' if asynchronous else '-',
        f'{steady:.3f}' if asynchronous else '-',
        f'{_runs(row["emulated_runs"])} ({spread(row["emulated_runs"]):.1f})',
        f'{_ms(e["hear_ms"])}/{_ms(v["hear_ms"])}',
        f'{1e6 * np.median(wait):.0f}/{1e6 * max(wait):.0f}' if wait else '-',
        f'{row["emulated_seconds"]:.0f}',
      )
    )
  _print(header, table)
  for row in rows:
    if 'skipped' in row:
      print(f'  {label(row["family"], row["lanes"])}: not run: {row["skipped"]}')
  print(
    's/it: seconds per iteration, median over blocks of 5 iterations of the steady state '
    '(ASGD, DC-ASGD, LPP-SGD: of whole rounds of K updates, at least 5, for LPP-SGD at least an averaging period); error: '
    '|virtual - emulated| / emulated; TVD: total variation distance of the staleness '
    "histograms of every update (asynchronous families), steady TVD: of the steady state's "
    "updates; emulated runs: each emulated run's s/it, in the order run (the row takes the "
    'median run), spread: (slowest - fastest) / median; heard: a '
    "task's end to the driver hearing of it, median; wait over price: a compute task of "
    'the emulated run, its duration less its price (steady state)'
  )
  spreads = [spread(row['emulated_runs']) for row in done if len(row['emulated_runs']) > 1]
  if spreads:
    print(
      f'emulated runs of one row, spread: median {np.median(spreads):.1f} %, largest '
      f'{max(spreads):.1f} % (the noise of the measurement the error is taken against)'
    )
  staleness = [r for r in done if r['family'] in ASYNCHRONOUS]
  if staleness:
    print('staleness histograms {staleness: updates}, emulated | virtual:')
    for row in staleness:
      print(
        f'  {label(row["family"], row["lanes"])}: {_histogram(row["emulated"]["staleness"])} | '
        f'{_histogram(row["virtual"]["staleness"])}'
      )


def spread(runs: list[float]) -> float:
  """How far apart a row's emulated runs were: (slowest - fastest) / median, in %."""
  return 100 * (max(runs) - min(runs)) / float(np.median(runs))


def _runs(runs: list[float]) -> str:
  return ' '.join(f'{x:.4f}' for x in runs)


def _print_variants(done: list[dict]) -> None:
  """Part 2: the virtual clock with one host figure changed at a time."""
  print()
  print('Part 2: the virtual clock with one setting changed, error % against the emulated run')
  header = ('family', 'K', 'model', *VARIANTS)
  table = []
  for row in done:
    cells = []
    for variant in VARIANTS:
      stats = row['variants'].get(variant, {})
      cells.append(
        f'{error(row, stats):.1f} ({stats["per_iteration"]:.4f})'
        if 'per_iteration' in stats
        else '-'
      )
    table.append((label(row['family'], row['lanes']), row['lanes'], f'{row["error"]:.1f}', *cells))
  _print(header, table)
  print(
    'the host profile with: no driver: driver = driver_latency = 0; heard driver: '
    "driver_latency = the emulated run's median hear delay over the ends whose lane's next "
    "task was dispatched after them, less driver; run's copies: "
    "link_latency = the emulated run's median copy, link_bandwidth free; run's host: "
    'both; in parentheses: the virtual s/it'
  )


def _print_where_time_went(done: list[dict], host) -> None:
  """Part 3: copies, the driver and the host's CPU in the emulated runs."""
  print()
  print("Part 3: where the emulated runs' time went (emulated / virtual)")
  header = (
    'family',
    'K',
    'copy ms',
    'copy end -> reader ms',
    'queued gap µs (emulated / priced)',
    'heard ms',
    'busiest lane utilization',
    'host cores busy (driver, lanes, Ray)',
    'busiest lane process cores',
    'driver CPU µs/event',
    'cores stolen, others',
  )
  table = []
  for row in done:
    e, v = row['emulated'], row['virtual']
    cpu = e.get('cpu')
    per_event = (  # the driver thread's, as `cost.driver` is measured
      cpu and e['events'] and 1e6 * cpu['driver thread'] * e['window'] / e['events']
    )
    table.append(
      (
        label(row['family'], row['lanes']),
        row['lanes'],
        f'{_ms(e["copy_ms"])} / {_ms(v["copy_ms"])}',
        f'{_ms(e["reader_ms"])} / {_ms(v["reader_ms"])}',
        f'{_us(e.get("queued_gap_ms"))} / {1e6 * host.figure("dispatch"):.0f}',
        f'{_ms(e["hear_ms"])} / {_ms(v["hear_ms"])}',
        f'{_busiest(e)} / {_busiest(v)}',
        f'{cpu["all"]:.2f} ({cpu["driver"]:.2f}, {cpu["lanes"]:.2f}, {cpu["ray"]:.2f})'
        if cpu
        else '-',
        f'{cpu["busiest lane"]:.2f}' if cpu else '-',
        f'{per_event:.0f} / {1e6 * host.figure("driver"):.0f}' if per_event else '-',
        f'{cpu.get("stolen", 0.0):.2f}, {cpu.get("others", 0.0):.2f}' if cpu else '-',
      )
    )
  _print(header, table)
  print(
    'copy: a copy between lanes, median (virtual: as priced); copy end -> reader: from a '
    "copy's end to the start of the next task on its receiving lane, where that lane was "
    "idle (median); queued gap: a lane's time from a task's end to its next start, where "
    'the driver had dispatched that task before the end (median), against the dispatch it '
    "is priced at; heard: a task's end to the driver hearing of it, median (a lane holds "
    'the end of a task run ahead while two calls are queued behind it); host cores '
    'busy: CPU seconds per second of all processes of the emulated run over its steady '
    f'state, of {os.cpu_count()} cores (a lane process near 1 is bound by its CPU, or '
    "by Python's lock); driver CPU per event: the driver thread's CPU over the steady "
    'state / (2 per compute task + 1 per copy), against cost.driver (measured alike); '
    "cores stolen: the machine's CPU time its hypervisor ran elsewhere (a VM's steal), "
    "others: every process's CPU but the run's, both per second of the steady state"
  )
  _print_each_run(done)


def _print_each_run(done: list[dict]) -> None:
  """Every emulated run of the rows with copies, and what moves with a run's time: its
  copies, the hypervisor's steal or other processes' CPU (`run_correlations`)."""
  rows = [row for row in done if any(run['copy_ms'] is not None for run in row['each_run'])]
  if not rows:
    return
  print(
    'each emulated run, in the order run: s/it (median copy ms, cores stolen, cores of other '
    "processes, the run's minor page faults and involuntary context switches per second); "
    'the busiest other processes over the runs'
  )
  for row in rows:
    runs = ' | '.join(
      f'{run["per_iteration"]:.4f} ({_ms(run["copy_ms"])}, {_cores(run["stolen"])}, '
      f'{_cores(run.get("others"))}, {_rate(run.get("faults"))}, {_rate(run.get("preempted"))})'
      for run in row['each_run']
    )
    print(f'  {label(row["family"], row["lanes"])}: {runs}; {_busiest_others(row)}')
  print(run_correlations(rows))


def _cores(value: float | None) -> str:
  return '-' if value is None else f'{value:.2f}'


def _rate(value: float | None) -> str:
  return '-' if value is None else f'{value:.0f}'


def _busiest_others(row: dict) -> str:
  """The other processes that used most CPU over a row's runs, cores summed over the runs
  by name (`CpuSampler.others_by_name`): a kernel's memory threads, a neighbour's job."""
  by_name = collections.Counter()
  for run in row['each_run']:
    for name, cores in run.get('others_by_name') or ():
      by_name[name] += cores
  return ', '.join(f'{name} {cores:.2f}' for name, cores in by_name.most_common(2)) or '-'


def run_correlations(rows: list[dict]) -> str:
  """Across the emulated runs of `rows`, each run's time per iteration over its row's
  median, against its median copy over the row's median copy, and against what else could
  set its pace: the cores the hypervisor took, the cores other processes used, the run's
  page faults and involuntary context switches per second (`CpuSampler.busy`). Pearson's
  r of each pair (runs with both figures). A run slower than its row by what its copies
  took longer says the copies set the run's pace; what moves with them, why."""

  def relative(row: dict, key: str) -> list:
    values = [run.get(key) for run in row['each_run']]
    known = [value for value in values if value is not None]
    middle = float(np.median(known)) if known else None
    return [None if v is None or not middle else v / middle for v in values]

  def pooled(key: str) -> list:
    return [run.get(key) for row in rows for run in row['each_run']]

  def pearson(xs: list, ys: list) -> str:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
      return f'- ({len(pairs)} runs)'
    return f'{np.corrcoef(np.array(pairs).T)[0, 1]:.2f} ({len(pairs)} runs)'

  pace = [x for row in rows for x in relative(row, 'per_iteration')]
  copy = [x for row in rows for x in relative(row, 'copy_ms')]
  against = [
    ('the cores stolen', 'stolen'),
    ("other processes' cores", 'others'),
    ('page faults per second', 'faults'),
    ('involuntary context switches per second', 'preempted'),
  ]
  return (
    "a run's time per iteration over its row's median, Pearson's r against its copy over "
    f"the row's median copy: {pearson(pace, copy)}"
    + ''.join(f'; against {name}: {pearson(pace, pooled(key))}' for name, key in against)
  )


def _print_last_lines(done: list[dict]) -> None:
  """The summary lines, the benchmark's figure last."""
  if not done:
    print('simulator schedule error, emulated tasks, K=2..16: n/a (no run)')
    print('simulator max error across families: n/a (no family ran)')
    return
  errors = [row['error'] for row in done]
  worst = max(done, key=lambda row: row['error'])

  def finite(key):  # (NaN where a run has no histogram: `max` would keep or drop it by order)
    values = [row[key] for row in done if row['family'] in ASYNCHRONOUS]
    return [value for value in values if np.isfinite(value)]

  tvds, steady = finite('tvd'), finite('steady_tvd')
  print(
    f'median error {np.median(errors):.1f} % over {len(done)} rows; largest: '
    f'{label(worst["family"], worst["lanes"])}; largest TVD over the steady state '
    + (
      f"{max(steady):.3f} (over every update, the lanes' first compiles included: {max(tvds):.3f})"
      if tvds and steady
      else '-'
    )
    + '; goal: max <= 5 %, median <= 2 %, TVD <= 0.1'
  )
  print(_stolen_line(done))
  by_family = {}
  for row in done:
    by_family[row['family']] = max(by_family.get(row['family'], 0.0), row['error'])
  print(
    'largest error per family: '
    + ', '.join(f'{name} {value:.1f} %' for name, value in by_family.items())
  )
  lanes = sorted({row['lanes'] for row in done})
  print(f'simulator schedule error, emulated tasks, K={lanes[0]}..{lanes[-1]}: {max(errors):.1f}%')
  print(f'simulator max error across families: {max(by_family.values()):.1f}%')


STOLEN = 0.02  # cores: a compared run that lost more to the hypervisor is named


def _stolen_line(done: list[dict]) -> str:
  """The rows whose compared emulated run lost more than `STOLEN` cores to the machine's
  hypervisor (a VM's `steal`: its host ran something else), and the largest error of the
  others: such a run measured a neighbour's load as well as the executor. Every row still
  counts in the last two lines."""

  def stolen(row: dict) -> float:
    return (row['emulated'].get('cpu') or {}).get('stolen', 0.0)

  named = [row for row in done if stolen(row) > STOLEN]
  if not named:
    return f'no compared run lost more than {STOLEN} cores to the hypervisor'
  rest = [row['error'] for row in done if stolen(row) <= STOLEN]
  return (
    f'compared runs that lost more than {STOLEN} cores to the hypervisor: '
    + ', '.join(
      f'{label(row["family"], row["lanes"])} ({stolen(row):.2f} cores, {row["error"]:.1f} %)'
      for row in named
    )
    + (f'; largest error of the other rows: {max(rest):.1f} %' if rest else '')
  )


def _print(header, rows) -> None:
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _busiest(stats: dict) -> str:
  utilization = stats.get('utilization') or {}
  return f'{max(utilization.values()):.2f}' if utilization else '-'


def _ms(value) -> str:
  return '-' if value is None else f'{value:.2f}'


def _us(milliseconds) -> str:
  return '-' if milliseconds is None else f'{1e3 * milliseconds:.0f}'


def _histogram(histogram: dict) -> str:
  return '{' + ', '.join(f'{k}: {v}' for k, v in sorted(histogram.items())) + '}'


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--families', default=','.join(FAMILIES))
  parser.add_argument('--lanes', default='2,4,8,16', help='K: stages, workers or replicas')
  parser.add_argument(
    '--workers', default='32', help='more M for ASGD and DC-ASGD (empty: none beyond --lanes)'
  )
  parser.add_argument('--forward', type=float, default=0.015, help='s per forward task')
  parser.add_argument('--backward', type=float, default=0.030, help='s per backward task')
  parser.add_argument('--update', type=float, default=0.010, help='s per update task')
  parser.add_argument(
    '--spread',
    type=float,
    default=None,
    help="cost.straggler_std of every row (default: a computing lane's, measured at the start)",
  )
  parser.add_argument('--hidden', type=int, default=128, help='width of the MLP')
  parser.add_argument('--depth', type=int, default=16, help='hidden layers (K stages: K-1)')
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--warmup', type=int, default=8, help='iterations left out')
  parser.add_argument('--blocks', type=int, default=8, help='blocks of 5 iterations measured')
  parser.add_argument(
    '--repeats', type=int, default=3, help='emulated runs of each row (interleaved); the median'
  )
  parser.add_argument(
    '--variants',
    action=argparse.BooleanOptionalAction,
    default=True,
    help='part 2: the virtual clock with one setting changed at a time',
  )
  parser.add_argument('--out', default=None, help='also write the results as JSON here')
  args = parser.parse_args()
  families = [f for f in args.families.split(',') if f]
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown:
    parser.error(f'--families: unknown {unknown}; allowed: {", ".join(FAMILIES)}')
  if args.spread is not None and not 0 <= args.spread < 1:
    parser.error(f'--spread: σ of the per-task log-normal noise, in [0, 1); got {args.spread}')
  if args.repeats < 1:
    parser.error(f'--repeats: emulated runs per row, at least 1; got {args.repeats}')
  lanes = [int(k) for k in args.lanes.split(',') if k]
  workers = [int(m) for m in args.workers.split(',') if m]
  if any(k < 2 for k in lanes) or args.depth + 1 < max(lanes, default=0):
    parser.error(f'--lanes: K >= 2 and K stages need --depth >= K - 1; got {lanes}, {args.depth}')
  if any(m < 2 for m in workers):
    parser.error(f'--workers: M >= 2 workers; got {workers}')
  runs = [(name, k) for k in lanes for name in families]
  runs += [(name, m) for m in workers for name in families if name in WORKER_FAMILIES]
  if not runs:
    parser.error(
      f'--lanes, --workers: no row to run (--workers is for {", ".join(WORKER_FAMILIES)} '
      f'only); got --lanes={args.lanes!r}, --workers={args.workers!r}, --families={args.families}'
    )
  started = time.time()
  print(
    f'machine: {os.cpu_count()} CPU cores, no GPU; {datetime.datetime.now():%Y-%m-%d %H:%M}; '
    f'python -m benchmarks.schedule_error {shlex.join(sys.argv[1:])}'
  )
  print(
    f'MLP 40-{args.hidden}x{args.depth}-10 on MNIST-1D, batch {args.batch}, SGD; cost.compute: '
    f'forward {1e3 * args.forward:g} ms, backward {1e3 * args.backward:g} ms, update '
    f"{1e3 * args.update:g} ms per task (LPP-SGD's mean and merge: an update each); "
    f'load average {"/".join(f"{x:.1f}" for x in os.getloadavg())} at start',
    flush=True,
  )
  root = tempfile.mkdtemp(prefix='schedule-error-')
  os.environ.update(  # the driver's programs (virtual runs, evaluation) compiled once
    JAX_COMPILATION_CACHE_DIR=os.path.join(root, 'jax_cache'),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )
  import jax

  from jaxsgd.scheduler import lane_timing
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster

  cluster.connect(None)  # one Ray cluster for every run (each run starts its own lanes)
  sampler = CpuSampler()
  rows, hosts, measurements = [], [], []  # per round: the rows' profile; as measured
  try:
    with LanePool(LanePlacement.parse('lane@cores=0'), verbose=False) as pool:
      trips = round_trips(pool)
      spread = 'given'
      if args.spread is None:
        args.spread = lane_timing.measure_task_spread(pool, 'lane')
        spread = (
          "measured: the σ of a computing task's log-duration on one lane, median of 3 chains of 40"
        )
    print(
      f'task spread: cost.straggler_std = {args.spread:.4f} on both sides ({spread}), each '
      "lane's draws the same",
      flush=True,
    )
    print(
      'a task waited for, from its dispatch to the driver hearing of its end, less the '
      'task, ms (median of 40): '
      + '; '.join(
        f'{what} {1e3 * seconds:.2f} ms task: {1e3 * over:.2f}'
        for what, (seconds, over) in trips.items()
      ),
      flush=True,
    )
    rows = [new_row(name, k, args) for name, k in runs]
    for repeat in range(args.repeats):  # interleaved: every row once per round
      round_host, measured = measure_round_host(args)
      hosts.append(round_host)
      measurements.append(measured)
      line = _host_line(round_host, measured)
      print(f'  host profile before round {repeat + 1}: {line}', flush=True)
      for row in rows:
        if 'skipped' not in row:
          emulate(row, repeat, args, root, sampler)
      print(
        f'  round {repeat + 1} of {args.repeats} emulated; load {os.getloadavg()[0]:.1f}',
        flush=True,
      )
    host = median_host(hosts)
    figures = ', '.join(f'{name} {value:.3g}' for name, value in host.figures)
    print(
      "virtual clock: cost.host = the process executor's host profile, each figure the "
      f'median of its {len(hosts)} measurements, one before each round ({host.cores} cores; '
      'its idle figures for every row, since an emulated task loads no core; its dispatch '
      f"an emulated lane's): {figures}",
      flush=True,
    )
    print(f'host profile over the rounds: {_host_spread(hosts)}', flush=True)
    for row in rows:
      if 'skipped' not in row:
        model_row(row, args, host, root)
      if args.out:
        with open(args.out, 'w') as f:
          rounds = [dict(h.figures) for h in measurements]
          json.dump({'host': dict(host.figures), 'measured': rounds, 'rows': rows}, f)
      print(f'  {label(row["family"], row["lanes"])}: {_one_line(row)}', flush=True)
  finally:
    cluster.shutdown()
  print(
    f'load average {"/".join(f"{x:.1f}" for x in os.getloadavg())} at end; jax '
    f'{jax.__version__}; {time.time() - started:.0f} s; runs in {root}'
  )
  print_tables(rows, args, host)


def _one_line(row: dict) -> str:
  if 'skipped' in row:
    return f'not run: {row["skipped"]}'
  e, v = row['emulated']['per_iteration'], row['virtual']['per_iteration']
  return f'emulated {1e3 * e:.2f} ms/it, virtual {1e3 * v:.2f} ms/it ({100 * abs(v - e) / e:.1f} %)'


if __name__ == '__main__':
  main()
