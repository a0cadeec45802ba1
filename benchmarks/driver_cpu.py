r"""The process executor's driver: its whole CPU per task, with a core of its own and
where its core computes too.

    python -m benchmarks.driver_cpu                  # ~30 s on 2 cores
    python -m benchmarks.driver_cpu --leaves=1,64 --tasks=500 --busy_tasks=60 --rounds=5

`real_speedup`'s `driver CPU ms / task` is read where the lanes compute on every core of
the machine. This takes the driver's part of it apart. One lane process, on the last
core, runs chains of tasks through a `ProcessExecutor`, run ahead as a pipeline's tasks
are: the path a run's tasks take (the policy, the executor, the pool, the wire), with
the driver pinned to the first core. Two kinds of chain (`lane_timing.dispatch_tasks`):
  add_one  a trivial task on a list of `--leaves` small arrays (a stage's parameters are
           such a tree), `--tasks` of them: the lane answers at once, so the driver
           hears several ends at each wake-up; the figure is mostly its own Python
  busy     a task that computes for tens of milliseconds (`lane_timing._busy`), `--busy_tasks`
           of them: the driver sleeps between two ends, as in a run; the lane holds
           the end of a task run ahead while two calls are queued behind it
           (docs/engine.md), so the driver wakes once for several ends
Each thread of the driver is read around a chain and around one of a fifth as many
tasks (`common.thread_cpu_seconds`); the difference of the two over the difference in
tasks is what one more task costs the driver, with the run's start and end left out
(`per_task`). Two ways, interleaved in every round:
  own core    nothing else computing on the driver's core
  core busy   a process computing matrix products (one BLAS thread) pinned to every
              core but the lane's and its hyperthreads, at the driver's priority: the
              driver preempts a computing process whenever it wakes, as where lanes
              compute on every core (`real_speedup` on two cores). The lane's core is
              left alone: computed on too, it slowed the chains many times over, and
              what the driver's threads use every second came out per task.
The table: µs of the driver's CPU per task, in all and by thread (`driver_roles`:
`main`, the executor, the policy and the dispatch; `replies`, the threads reading the
lanes' connections; `writer`, the thread writing them; `other`, Ray's threads, which use
CPU every second whatever the tasks, and any else), and the long chain's wall time per
task; medians over rounds. A thread that ends between two readings is not counted (none
of the pool's does). Not a test: speed is measured, not asserted. The last line:
`the driver's CPU per task, tasks of tens of ms (busy): <x> µs with a core of its own,
<y> µs with its core busy; trivial tasks: <z> µs`, medians over rounds (the trivial tasks' over
every tree, with a core of its own).
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from benchmarks import common as bench_common
from jaxsgd.scheduler import lane_timing
from jaxsgd.scheduler.core import Cluster, Compute, Process
from jaxsgd.scheduler.lanes import LanePlacement, LanePool, runtime, wire
from jaxsgd.scheduler.process import ProcessExecutor
from jaxsgd.scheduler.tasks import Task, TaskRecipe

LANE = 'chain'
WAYS = ('own core', 'core busy')
ROLES = ('main', 'replies', 'writer', 'other')
SHORT_SHARE = 5  # the short chain: a fifth of the long one's tasks
TOPOLOGY = '/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list'  # (Linux)
# A busy core's process: matrix products of ~1 MB matrices, one BLAS thread, until killed;
# it says `ready` once it computes. Killed by the kernel too if its parent (argv[1]) dies:
# the parent-death signal comes when the thread that started it ends, here the main one.
# Deaf to the terminal's Ctrl-C (its parent kills it). Set up in the child itself: a
# `preexec_fn` is not safe to run in a parent with threads (Ray's, the pool's).
_BUSY_CODE = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
signal.signal(signal.SIGINT, signal.SIG_IGN)
if os.getppid() != int(sys.argv[1]):
  sys.exit()  # (its parent died before the prctl)
import numpy as np
a = np.ones((512, 512), np.float32)
a @ a
print('ready', flush=True)
while True:
  a @ a
"""
_BUSY_ENV = {'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}


def driver_roles(before: dict, after: dict, main_tid: int) -> dict[str, float]:
  """The driver's CPU seconds between two `common.thread_cpu_seconds('self')`, by role
  (`ROLES`): its main thread (`main_tid`), the lanes' readers and the writer (by the
  names the OS knows them by: `wire.REPLIES_THREAD`, `wire.WRITER_THREAD`), and every
  other thread; a thread new since `before`, counted from zero."""
  parts = dict.fromkeys(ROLES, 0.0)
  by_name = {wire.REPLIES_THREAD: 'replies', wire.WRITER_THREAD: 'writer'}
  for tid, (name, seconds) in bench_common.thread_cpu_used(before, after).items():
    parts['main' if tid == main_tid else by_name.get(name, 'other')] += seconds
  return parts


def per_task(short: dict[str, float], long: dict[str, float], tasks: tuple[int, int]):
  """What one more task costs: (`long` - `short`) / (its tasks - the short chain's), for
  each key of the two readings (seconds), `tasks` = (short chain's, long chain's)."""
  more = tasks[1] - tasks[0]
  if more <= 0:
    raise ValueError(f'per_task: the long chain must have more tasks; got {tasks}')
  return {key: (long[key] - short[key]) / more for key in long}


def chain(name: str, leaves: int, tasks: int) -> Process:
  """A process yielding `tasks` tasks `name` of `dispatch_tasks` on the lane, each on the
  previous one's result, each run ahead: `add_one` on a list of `leaves` 4-float arrays
  (made on the driver: the first call sends them), `busy` on a scalar."""
  task = Task(TaskRecipe.of(lane_timing.dispatch_tasks), name)

  def program():
    value = np.zeros((), np.float32)
    if name == 'add_one':
      value = [np.zeros((4,), np.float32) for _ in range(leaves)]
    for _ in range(tasks):
      value = yield Compute(task, (value,), kind='dispatch', ahead=True)

  return Process(LANE, 0, program())


def read_chain(pool: LanePool, name: str, leaves: int, tasks: int) -> dict[str, float]:
  """The driver's CPU seconds by role and the wall seconds (`wall`) of one chain."""
  cluster = Cluster()
  cluster.add_lane(LANE, jax.devices('cpu')[0])  # (the lane's own device is its own)
  executor = ProcessExecutor(pool=pool, verbose=False)
  main_tid = os.getpid()  # (Linux: the main thread's id is the process's)
  before, start = bench_common.thread_cpu_seconds(), time.perf_counter()
  executor.run(cluster, [chain(name, leaves, tasks)])
  wall = time.perf_counter() - start
  return {**driver_roles(before, bench_common.thread_cpu_seconds(), main_tid), 'wall': wall}


def measure(pool: LanePool, name: str, leaves: int, tasks: int) -> dict[str, float]:
  """Per task of a chain of `name` tasks on `leaves` arrays: the driver's CPU seconds by
  role and in all (`all`; `per_task` of a chain of `tasks` and one of
  `tasks // SHORT_SHARE`), and the long chain's wall seconds per task (`wall`, its start
  and end included: a difference of two walls is as noisy as the run's start)."""
  counts = (tasks // SHORT_SHARE, tasks)
  short, long = (read_chain(pool, name, leaves, n) for n in counts)
  cost = per_task({r: short[r] for r in ROLES}, {r: long[r] for r in ROLES}, counts)
  cost['all'] = sum(cost.values())
  cost['wall'] = long['wall'] / tasks
  return cost


@contextlib.contextmanager
def busy_cores(cores: list[int]):
  """A process computing on each of `cores` (pinned to it) while the context lasts, each
  started and computing when it is entered; all killed at its end, and by the kernel if
  this process dies first (`_BUSY_CODE`)."""
  processes = []
  try:
    for core in cores:
      command = [sys.executable, '-c', _BUSY_CODE, str(os.getpid())]
      env = {**os.environ, **_BUSY_ENV}
      processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
      os.sched_setaffinity(processes[-1].pid, {core})
    for process, core in zip(processes, cores):
      if process.stdout.readline().strip() != 'ready':
        raise RuntimeError(f'the busy process on core {core} ended ({process.wait()})')
    yield
  finally:
    for process in processes:  # all killed first: a Ctrl-C in a wait leaves none running
      process.kill()
    for process in processes:
      process.wait()


def siblings(core: int) -> set[int]:
  """`core` and its hyperthreads (Linux topology; `core` alone where it is not known)."""
  try:
    with open(TOPOLOGY.format(core=core)) as f:
      text = f.read().strip()
  except OSError:
    return {core}
  cores = set()
  for part in text.split(','):
    first, _, last = part.partition('-')
    cores.update(range(int(first), int(last or first) + 1))
  return cores | {core}


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked (one line naming the flag and what it allows, before any lane
  starts); `leaves` becomes a list of whole numbers; `lane_core` the lane's core (the
  last), `busy` every core that is not it or its hyperthread, `driver_core` the first of
  those."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--leaves', default='1,16,64', help='arrays in the tree, comma-separated')
  parser.add_argument('--tasks', type=int, default=300, help='add_one tasks of the long chain')
  parser.add_argument('--busy_tasks', type=int, default=40, help='busy tasks of the long chain')
  parser.add_argument('--rounds', type=int, default=3, help='rounds, the ways interleaved')
  args = parser.parse_args(argv)
  try:
    args.leaves = [int(n) for n in args.leaves.split(',')]
  except ValueError:
    parser.error(f'--leaves: comma-separated whole numbers expected; got {args.leaves!r}')
  if min(args.leaves) < 1 or len(set(args.leaves)) < len(args.leaves):
    parser.error(f'--leaves: different counts, each at least 1 array; got {args.leaves}')
  for flag, tasks in (('--tasks', args.tasks), ('--busy_tasks', args.busy_tasks)):
    if tasks < 5 * SHORT_SHARE:
      parser.error(
        f'{flag}: at least {5 * SHORT_SHARE} (the short chain, a fifth, needs 5); got {tasks}'
      )
  if args.rounds < 1:
    parser.error(f'--rounds: at least 1; got {args.rounds}')
  cores = sorted(os.sched_getaffinity(0))
  args.lane_core = cores[-1]
  args.busy = [core for core in cores if core not in siblings(args.lane_core)]
  if not args.busy:
    parser.error(
      "a core for the driver that is not the lane's or its hyperthread needed; this process "
      f'may use {cores}, core {args.lane_core} with {sorted(siblings(args.lane_core))}'
    )
  args.driver_core = args.busy[0]
  return args


def chains(args) -> list[tuple[str, int, int]]:
  """The chains of a round: (task, leaves, tasks of the long chain)."""
  return [('add_one', n, args.tasks) for n in args.leaves] + [('busy', 1, args.busy_tasks)]


def run_rounds(args) -> dict[tuple[str, str, int], list[dict[str, float]]]:
  """(way, task, leaves) -> each round's per-task figures (`measure`), the ways
  interleaved."""
  readings = {}
  with LanePool(LanePlacement.parse(f'{LANE}@cores={args.lane_core}')) as pool:
    runtime.pin_process((args.driver_core,))  # after the lane started: it inherits no affinity
    for name, leaves, _ in chains(args):  # the lane builds its tasks
      read_chain(pool, name, leaves, SHORT_SHARE)
    for _ in range(args.rounds):
      for way in WAYS:
        with busy_cores(args.busy) if way == 'core busy' else contextlib.nullcontext():
          for name, leaves, tasks in chains(args):
            reading = measure(pool, name, leaves, tasks)
            readings.setdefault((way, name, leaves), []).append(reading)
  return readings


def report(readings: dict[tuple[str, str, int], list[dict[str, float]]]) -> None:
  """The table (µs per task, medians over rounds) and the last line."""
  us = lambda rounds, key='all': 1e6 * statistics.median(r[key] for r in rounds)
  rows = []
  for (way, name, leaves), rounds in readings.items():
    each = ' '.join(f'{1e6 * r["all"]:.0f}' for r in rounds)
    figures = [us(rounds, key) for key in ('all', *ROLES, 'wall')]
    rows.append((way, name, leaves, *figures, each))
  print(
    'µs per task (CPU: the long chain less the short; wall: the long chain), median over rounds:'
  )
  header = ('way', 'task', 'leaves', 'driver CPU', *ROLES, 'wall', 'rounds (driver CPU)')
  bench_common.print_table(header, rows)
  own, busy = WAYS
  trivial = [
    reading
    for (way, name, _), rounds in readings.items()
    if (way, name) == (own, 'add_one')
    for reading in rounds
  ]
  print(
    f"the driver's CPU per task, tasks of tens of ms (busy): {us(readings[own, 'busy', 1]):.0f} µs "
    f'with a core of its own, {us(readings[busy, "busy", 1]):.0f} µs with its core busy; '
    f'trivial tasks: {us(trivial):.0f} µs'
  )


def main():
  args = parse_args()
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'one lane on core {args.lane_core}, the driver pinned to core {args.driver_core}; chains '
    f'of {args.tasks} and {args.tasks // SHORT_SHARE} add_one tasks, {args.busy_tasks} and '
    f'{args.busy_tasks // SHORT_SHARE} busy tasks, run ahead; '
    f'{args.rounds} rounds; core busy: cores {",".join(map(str, args.busy))}'
  )
  readings = run_rounds(args)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  report(readings)


if __name__ == '__main__':
  main()
