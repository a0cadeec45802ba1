r"""The process executor's driver: its whole CPU per task, with a core of its own and
with every core busy.

    python -m benchmarks.driver_cpu                  # ~1.5 min on 2 cores
    python -m benchmarks.driver_cpu --leaves=1,64 --tasks=500 --rounds=5

`real_speedup`'s `driver CPU ms / task` is read where the lanes compute on every core of
the machine. This takes that figure apart. One lane process, on the last core, runs
chains of trivial tasks (`lane_timing.dispatch_tasks`' `add_one`, on a list of
`--leaves` small arrays: a stage's parameters are such a tree) through a
`ProcessExecutor`, run ahead as a pipeline's tasks are: the path a run's tasks take
(the policy, the executor, the pool, the wire), with the driver pinned to the first
core. Each thread of the driver is read around a chain of `--tasks` tasks and around
one of a fifth as many (`common.thread_cpu_seconds`: the scheduler's nanoseconds); the
difference of the two over the difference in tasks is what one more task costs the
driver, with the run's start and end left out (`per_task`). Two ways, interleaved in
every round:
  own core    nothing else computing: the driver has its core, as on a machine with
              cores to spare (a GPU host)
  cores busy  a process computing matrix products (one BLAS thread) pinned to every
              core, at the driver's priority: what the driver meets where the lanes
              compute on every core, as in `real_speedup` on two cores
The table: µs of the driver's CPU per task, in all and by thread (`driver_roles`:
`main`, the executor, the policy and the dispatch; `replies`, the threads reading the
lanes' connections; `writer`, the thread writing them; `other`, Ray's threads and any
else), and the long chain's wall time per task; medians over rounds. Not a test: speed is
measured, not asserted. The last line:
`the driver's CPU per task with a core of its own: <x> µs (every core busy: <y> µs)`,
each the median over every chain of that way.
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
from jaxsgd.launch import die_with_parent
from jaxsgd.scheduler import lane_timing
from jaxsgd.scheduler.core import Cluster, Compute, Process
from jaxsgd.scheduler.lanes import LanePlacement, LanePool, runtime, wire
from jaxsgd.scheduler.process import ProcessExecutor
from jaxsgd.scheduler.tasks import Task, TaskRecipe

LANE = 'chain'
WAYS = ('own core', 'cores busy')
ROLES = ('main', 'replies', 'writer', 'other')
SHORT_SHARE = 5  # the short chain: a fifth of the long one's tasks
# A busy core's process: matrix products of ~1 MB matrices, one BLAS thread, until killed.
_BUSY_CODE = 'import numpy as np\na = np.ones((512, 512), np.float32)\nwhile True:\n  a @ a\n'
_BUSY_ENV = {'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
_BUSY_SETTLE_S = 0.5  # for the busy processes to import numpy and start computing


def driver_roles(before: dict, after: dict, main_tid: int) -> dict[str, float]:
  """The driver's CPU seconds between two `common.thread_cpu_seconds('self')`, by role
  (`ROLES`): its main thread (`main_tid`), the lanes' readers and the writer (by the
  names the OS knows them by: `wire.REPLIES_THREAD`, `wire.WRITER_THREAD`), and every
  other thread; a thread new since `before`, counted from zero."""
  parts = dict.fromkeys(ROLES, 0.0)
  by_name = {wire.REPLIES_THREAD: 'replies', wire.WRITER_THREAD: 'writer'}
  for tid, (name, seconds) in after.items():
    role = 'main' if tid == main_tid else by_name.get(name, 'other')
    parts[role] += seconds - before.get(tid, (name, 0.0))[1]
  return parts


def per_task(short: dict[str, float], long: dict[str, float], tasks: tuple[int, int]):
  """What one more task costs: (`long` - `short`) / (its tasks - the short chain's), for
  each key of the two readings (seconds), `tasks` = (short chain's, long chain's)."""
  more = tasks[1] - tasks[0]
  if more <= 0:
    raise ValueError(f'per_task: the long chain must have more tasks; got {tasks}')
  return {key: (long[key] - short[key]) / more for key in long}


def chain(leaves: int, tasks: int) -> Process:
  """A process yielding `tasks` `add_one` tasks on the lane, each on the previous one's
  result, a list of `leaves` 4-float arrays (made on the driver: the first call sends
  them), each run ahead."""
  task = Task(TaskRecipe.of(lane_timing.dispatch_tasks), 'add_one')

  def program():
    tree = [np.zeros((4,), np.float32) for _ in range(leaves)]
    for _ in range(tasks):
      tree = yield Compute(task, (tree,), kind='dispatch', ahead=True)

  return Process(LANE, 0, program())


def read_chain(pool: LanePool, leaves: int, tasks: int) -> dict[str, float]:
  """The driver's CPU seconds by role and the wall seconds (`wall`) of one chain."""
  cluster = Cluster()
  cluster.add_lane(LANE, jax.devices()[0])
  executor = ProcessExecutor(pool=pool, verbose=False)
  main_tid = os.getpid()  # (Linux: the main thread's id is the process's)
  before, start = bench_common.thread_cpu_seconds(), time.perf_counter()
  executor.run(cluster, [chain(leaves, tasks)])
  wall = time.perf_counter() - start
  return {**driver_roles(before, bench_common.thread_cpu_seconds(), main_tid), 'wall': wall}


def measure(pool: LanePool, leaves: int, tasks: int) -> dict[str, float]:
  """Per task of a chain on a tree of `leaves` arrays: the driver's CPU seconds by role
  and in all (`all`; `per_task` of a chain of `tasks` and one of `tasks // SHORT_SHARE`),
  and the long chain's wall seconds per task (`wall`, its start and end included: a
  difference of two walls is as noisy as the run's start)."""
  counts = (tasks // SHORT_SHARE, tasks)
  short, long = (read_chain(pool, leaves, n) for n in counts)
  cost = per_task({r: short[r] for r in ROLES}, {r: long[r] for r in ROLES}, counts)
  cost['all'] = sum(cost.values())
  cost['wall'] = long['wall'] / tasks
  return cost


@contextlib.contextmanager
def busy_cores(cores: list[int]):
  """A process computing on each of `cores` (pinned to it) while the context lasts; each
  killed at its end, and by the kernel if this process dies first (`die_with_parent`)."""
  processes = []
  try:
    for core in cores:
      process = subprocess.Popen(
        [sys.executable, '-c', _BUSY_CODE],
        env={**os.environ, **_BUSY_ENV},
        preexec_fn=die_with_parent,
      )
      processes.append(process)
      os.sched_setaffinity(process.pid, {core})
    time.sleep(_BUSY_SETTLE_S)
    for process, core in zip(processes, cores):
      if process.poll() is not None:
        raise RuntimeError(
          f'driver_cpu: the busy process on core {core} ended ({process.returncode})'
        )
    yield
  finally:
    for process in processes:
      process.kill()
      process.wait()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--leaves', default='1,16,64', help='arrays in the tree, comma-separated')
  parser.add_argument('--tasks', type=int, default=300, help='tasks of the long chain')
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  try:
    leaf_counts = [int(n) for n in args.leaves.split(',')]
  except ValueError:
    parser.error(f'--leaves: comma-separated whole numbers expected; got {args.leaves!r}')
  if min(leaf_counts) < 1:
    parser.error(f'--leaves: at least 1 array each; got {args.leaves!r}')
  if args.tasks < 5 * SHORT_SHARE:
    parser.error(f'--tasks: at least {5 * SHORT_SHARE}; got {args.tasks}')
  if args.rounds < 1:
    parser.error(f'--rounds: at least 1; got {args.rounds}')
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    parser.error(f'driver_cpu: two cores needed (the driver and its lane); this has {cores}')
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'one lane on core {cores[-1]}, the driver pinned to core {cores[0]}; chains of '
    f'{args.tasks} and {args.tasks // SHORT_SHARE} add_one tasks, run ahead; '
    f'{args.rounds} rounds'
  )
  readings = {}  # (way, leaves) -> per-task figures of each round
  with LanePool(LanePlacement.parse(f'{LANE}@cores={cores[-1]}')) as pool:
    runtime.pin_process((cores[0],))  # after the lane started: it inherits no affinity
    read_chain(pool, max(leaf_counts), SHORT_SHARE)  # the lane builds its task
    for _ in range(args.rounds):
      for way in WAYS:
        with busy_cores(cores) if way == 'cores busy' else contextlib.nullcontext():
          for leaves in leaf_counts:
            readings.setdefault((way, leaves), []).append(measure(pool, leaves, args.tasks))
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  print(
    'µs per task (CPU: the long chain less the short; wall: the long chain), median over rounds:'
  )
  header = ('way', 'leaves', 'driver CPU', *ROLES, 'wall', 'rounds (driver CPU)')
  rows = []
  for (way, leaves), rounds in readings.items():
    median = lambda key, rounds=rounds: 1e6 * statistics.median(r[key] for r in rounds)
    each = ' '.join(f'{1e6 * r["all"]:.0f}' for r in rounds)
    rows.append(
      (way, leaves, median('all'), *(median(role) for role in ROLES), median('wall'), each)
    )
  bench_common.print_table(header, rows)
  overall = {
    way: 1e6
    * statistics.median(r['all'] for (w, _), rounds in readings.items() if w == way for r in rounds)
    for way in WAYS
  }
  print(
    f"the driver's CPU per task with a core of its own: {overall['own core']:.0f} µs "
    f'(every core busy: {overall["cores busy"]:.0f} µs)'
  )


if __name__ == '__main__':
  main()
