r"""Where each core's time goes in one of `real_speedup`'s cases, thread by thread.

    python -m benchmarks.lane_threads                  # PD-ASGD 1:1, ~1 min on 2 cores
    python -m benchmarks.lane_threads --family=ddg --rounds=5
    python -m benchmarks.lane_threads --moves=socket   # values over the sockets (`LaneSpec.moves`)
    python -m benchmarks.lane_threads --copies=backwardworker0:0   # its copy threads on core 0

Runs one case of `benchmarks.real_speedup` (the same model, lanes and pinning: K=2) on a
Ray cluster of its own, twice to compile, then `--rounds` times, reading before and after
each round the CPU seconds of every thread of every lane process (`/proc/PID/task`), of
the driver (this process) and of Ray's daemons, and each core's busy time (`/proc/stat`).
Per round and iteration (`--steps` iterations a round, its first batches and the lanes'
hand-over included, so a little above `real_speedup`'s steady state), the table prints,
median over rounds:
  lane threads  per lane process: its task thread (the threads that run its tasks:
                the calls thread, which runs them in order, and XLA's threads that compute
                them, which carry the process's name), its copy threads together (the
                values it takes in and sends) and one by one: `copies: exports` (copying
                values out to other lanes), `copies: lane reader` (taking in other
                lanes' values), `copies: driver reader` (reading the driver's calls and
                their arrays), each named for the OS by the lane (`runtime.THREAD_NAMES`;
                a lane of code that names none: its threads but the busiest, `copies:
                other`); and each thread Ray or XLA named (`worker.io`, `tf_XLAEigen`,
                ...), over 0.05 ms an iteration
  driver        this process, every thread, and each of its threads over 0.05 ms an
                iteration by name: Python's by their Python names (`MainThread`, the
                readers of the lanes' connections `jaxsgd-lane-<lane>`, ...), the others
                by their OS names (Ray's and gRPC's); Ray's daemons (raylet, GCS, agents)
  core N        the core's busy time, of the wall time per iteration
A lane is pinned to its core with all its threads (`LanePlacement`), so its copies run
on the core its tasks do unless moved: by default (`--copies=auto`, as `real_speedup`'s)
a first run places them, and the driver's threads, by the load it measured
(`real_speedup.copies_by_load`; the driver for the rounds only), `run`
leaves it to each run's executor (as a training run does), `own` keeps them on their
lanes' cores, and `--copies lane:cores` moves that lane's copy threads
to those cores (`LaneSpec.copy_cores`): they still count as its copy threads, and the
core busy times show where they ran. Not a test: speed is measured, not asserted. The last
line:
`<case>: busiest lane <lane>: task thread <x> ms, its other threads <y> ms an iteration`
(its copy threads and its named threads).
"""

import argparse
import os
import statistics
import threading
import time

import psutil

from benchmarks import common as bench_common
from benchmarks import real_speedup
from jaxsgd.scheduler.lanes import LanePool, runtime

FAMILIES = ('ddg', 'local', 'asgd', 'pdasgd', 'lppsgd')


def daemon_seconds(lane_pids: set[int]) -> float:
  """CPU seconds so far of the processes this one started that are not lanes (Ray's)."""
  total = 0.0
  for child in psutil.Process().children(recursive=True):
    try:
      if child.pid not in lane_pids:
        times = child.cpu_times()
        total += times.user + times.system
    except psutil.Error:
      pass
  return total


# A lane's threads as the OS names them (`runtime.THREAD_NAMES`) -> its role.
LANE_THREADS = {name: role for role, name in runtime.THREAD_NAMES.items()}
COPY_PART = 'copies: '  # the rows of the copy threads one by one (in 'copy threads' too)


def split_threads(before: dict, after: dict, process_name: str) -> dict[str, float]:
  """One lane process's CPU seconds between two `common.thread_cpu_seconds`, by part:
  'task thread' (the tasks' threads: the calls thread, `runtime.THREAD_NAMES['calls']`,
  which hands each task to XLA and waits for it, and the threads still carrying the
  process's name, XLA's that compute it among them: a thread takes its creator's name;
  the lane's accepting thread and its main thread, idle, too),
  'copy threads' (the others the lane names), each of them again as `copies: <role>`
  (`runtime.THREAD_NAMES`), and each thread named otherwise (Ray's, XLA's pool), by name.
  A lane that names none of its threads (older code): the thread that used the most is
  the task thread, the others with the process's name its copy threads (`copies:
  other`)."""
  used = bench_common.thread_cpu_used(before, after)
  if not used:
    return {}
  parts = {'task thread': 0.0, 'copy threads': 0.0}
  # (from every thread: one that used no CPU in the window shows none used)
  named = any(name in LANE_THREADS for name, _ in after.values())
  if not named:
    parts['task thread'] = used.pop(max(used, key=lambda tid: used[tid][1]))[1]
  for name, delta in used.values():
    role = LANE_THREADS.get(name)
    if role is None and process_name.startswith(name):  # (the OS cuts names to 15 bytes)
      role = 'calls' if named else 'other'
    if role is None:
      parts[name] = parts.get(name, 0.0) + delta
    elif role == 'calls':
      parts['task thread'] += delta
    else:
      parts['copy threads'] += delta
      parts[COPY_PART + role] = parts.get(COPY_PART + role, 0.0) + delta
  return parts


def driver_threads(before: dict, after: dict) -> dict[str, float]:
  """This process's CPU seconds between two `common.thread_cpu_seconds('self')`, by
  thread: `driver: <name>`, a Python thread's Python name (the OS knows them all as the
  process), another thread's OS name; threads of one name summed."""
  python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
  parts: dict[str, float] = {}
  for tid, (name, delta) in bench_common.thread_cpu_used(before, after).items():
    key = f'driver: {python_names.get(tid, name)}'
    parts[key] = parts.get(key, 0.0) + delta
  return parts


def one_round(pool: LanePool, case, steps: int, warmup: int) -> dict[str, float]:
  """Seconds per iteration of each part: `split_threads` per lane, 'driver' and
  `driver_threads`, 'Ray daemons', 'core N' busy and 'wall'."""
  pids = pool.pids()
  names = {lane: psutil.Process(pid).name() for lane, pid in pids.items()}
  before = {lane: bench_common.thread_cpu_seconds(pid) for lane, pid in pids.items()}
  driver_before = bench_common.thread_cpu_seconds()
  driver, daemons, cores = (
    time.process_time(),
    daemon_seconds(set(pids.values())),
    bench_common.core_busy_seconds(),
  )
  start = time.perf_counter()
  real_speedup.run(pool, case, steps, warmup)
  wall = time.perf_counter() - start
  parts = {'wall': wall, 'driver': time.process_time() - driver}
  parts.update(driver_threads(driver_before, bench_common.thread_cpu_seconds()))
  parts['Ray daemons'] = daemon_seconds(set(pids.values())) - daemons
  for core, busy in enumerate(bench_common.core_busy_seconds()):
    parts[f'core {core} busy'] = busy - cores[core]
  for lane, pid in pids.items():
    for part, seconds in split_threads(
      before[lane], bench_common.thread_cpu_seconds(pid), names[lane]
    ).items():
      parts[f'{lane}: {part}'] = seconds
  return {key: seconds / steps for key, seconds in parts.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--family', default='pdasgd', choices=FAMILIES)
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--warmup', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument(
    '--moves', default='auto', choices=('auto', 'host', 'socket'), help="the lanes' values' path"
  )
  parser.add_argument(
    '--copies',
    default=real_speedup.BY_LOAD,
    help=f"{real_speedup.BY_LOAD} (placed by load, as real_speedup's), {real_speedup.OWN}, "
    f"{real_speedup.RUN} (by the run's executor) or lane:cores[;...]: those lanes' copy "
    'threads on those cores',
  )
  args = parser.parse_args()
  name, case = list(real_speedup.cases(2, (args.family,)).items())[-1]  # (bp's first)
  by_load = args.copies.strip() == real_speedup.BY_LOAD
  if args.copies.strip() == real_speedup.RUN:
    real_speedup.EXECUTOR['copies'] = 'auto'
  placement, copies = real_speedup.placement_or_error(
    parser, 2, (args.family,), args.moves, args.copies, words=True
  )
  apart = ''.join(f', {lane} copies on {cores}' for lane, cores in copies.items())
  apart += f', copies {args.copies.strip()}' if not copies and args.copies.strip() else ''
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'{name}, moves={args.moves}{apart}, {args.steps} iterations a round, {args.rounds} rounds'
  )
  rounds = []
  with LanePool(placement) as pool:
    for _ in range(2):  # every lane compiled its tasks
      real_speedup.run(pool, case, args.warmup + 2, 2)
    pinned, allowed = None, tuple(sorted(os.sched_getaffinity(0)))
    if by_load:  # as real_speedup's default: placed by what a first run measured
      placed = real_speedup.copies_by_load(pool, {name: case}, args.steps, args.warmup, True)
      moved, pinned = placed[name]
      real_speedup.place_copies(pool, moved, {})
    if pinned is not None:  # the driver too, for the rounds only
      runtime.pin_threads(pinned)
    try:
      for _ in range(args.rounds):
        rounds.append(one_round(pool, case, args.steps, args.warmup))
    finally:
      if pinned is not None:
        runtime.pin_threads(allowed)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  median = lambda key: statistics.median(parts.get(key, 0.0) for parts in rounds)
  keys = sorted({key for parts in rounds for key in parts}, key=_order)
  shown = [key for key in keys if median(key) >= 5e-5 or key == 'wall']
  bench_common.print_table(
    ('part', 'ms / iteration (median)', 'rounds'),
    [
      (key, median(key) * 1e3, ' '.join(f'{p.get(key, 0.0) * 1e3:.1f}' for p in rounds))
      for key in shown
    ],
  )
  lane = _busiest_lane(rounds, keys)
  task = f'{lane}: task thread'
  others = sum(
    median(k)
    for k in keys
    if k.startswith(f'{lane}: ') and k != task and not k.startswith(f'{lane}: {COPY_PART}')
  )
  print(
    f'{name}: busiest lane {lane}: task thread {median(task) * 1e3:.1f} ms, its other '
    f'threads {others * 1e3:.1f} ms an iteration'
  )


def _order(key: str):
  driver = key == 'driver' or key.startswith('driver: ') or key == 'Ray daemons'
  return (key != 'wall', not key.startswith('core'), driver, key)


def _busiest_lane(rounds, keys) -> str:
  """The lane whose task thread used the most CPU (median over rounds)."""
  tasks = [k for k in keys if k.endswith(': task thread')]
  best = max(tasks, key=lambda k: statistics.median(p.get(k, 0.0) for p in rounds))
  return best[: -len(': task thread')]


if __name__ == '__main__':
  main()
