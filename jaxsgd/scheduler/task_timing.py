"""Measuring tasks: the seconds of each task of a run, timed carefully, as a profile table.

A profile (`profiles`) is only as good as its measurement. How a task is measured
(`measure`):

    for each task: `warmup` calls (compile, caches), not timed
    for r in 1..reps:                      # interleaved: rep r of every task, then r + 1
      for each task: t = clock time of fn(*args) until every output is ready
    cost(task) = median over the reps of t

The rule, and why the median: the virtual clock prices every call of a run at its
task's cost (times a mean-one noise factor, `cost.straggler_std`), so the cost is what a
typical call takes, not the fastest one. The fastest call is the work with nothing in
its way — a warm cache, no interrupt, the turbo clock — and a run's calls seldom all get
that: in one measured profile, each forward's and backward's median call was
1.01-1.04× its fastest, each ~1 ms update's 1.1-1.3×, about half of what the run's tasks
took over the fastest (benchmarks/results/simulator_accuracy.md); pricing at the fastest
made nearly every prediction fast. Like the minimum, the median ignores a burst of other
jobs' load that slows fewer than half the calls, and interleaving spreads such a burst
over all tasks instead of inflating one.
The fastest call and the 90th percentile are kept next to each cost (`Table.spread`) so
a reader can see how loaded the machine was. A cost is the time of one blocking call:
device time plus one host dispatch, as `costs.time_calls` measures it; what an executor
adds per task is measured apart (`lane_timing`).

Which clock, and pinning (`CLOCKS`, `pin_to_core`). Wall time on every core is what
`costs.time_calls` measures and the default. The process's CPU time of a process pinned
to one core excludes the time other jobs held the core, and gives one core's costs
(the unit of a lane pinned to a core). On a shared, loaded machine no method repeats
well across fresh processes (`benchmarks/profile_repeatability.py`; its figures are in
`benchmarks/results/profile_repeatability.txt`), and no statistic makes a measurement
repeatable there: what makes a *simulation* repeatable is measuring once and reading
the same file back (two loads give equal `CostModel`s and identical simulated
timelines). Measure profiles on a quiet
machine; `BusyNeighbours` measures them with the lanes' other cores computing.

Reference: docs/simulator.md (how a task is measured, and how repeatable that is);
tests/scheduler/test_profiles.py.
"""

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.profile_lookup import model_id, roles_signature, split_of
from jaxsgd.scheduler.profiles import STATISTIC, Profile, Table, as_split, spread_of

# What times a call, by a profile's `clock` (`profiles.CLOCK_NAMES`).
CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}


# --- the machine around the measurement -------------------------------------------------------
def pin_to_core(core: int) -> None:
  """Runs this process (and the threads it starts from now on) on one CPU core.

  Pins the threads running now, and those started later inherit it (XLA's CPU
  thread pool is created at JAX's first computation). On one core a task's process CPU time is
  its cost without the time other jobs took from it (see the module docstring).
  """
  if not hasattr(os, 'sched_setaffinity'):
    raise RuntimeError('pin_to_core: this platform cannot pin a process to a core.')
  os.sched_setaffinity(0, {core})
  for task in os.listdir('/proc/self/task') if os.path.isdir('/proc/self/task') else ():
    try:  # Threads started before (at import) do not inherit the affinity.
      os.sched_setaffinity(int(task), {core})
    except OSError:
      pass  # The thread ended meanwhile.


# A neighbour's work: float32 matrix products of the size of an MLP layer's, one core, in
# a loop, until its parent (the measuring process) is gone. Run as `python -c`, so that
# nothing of this module is imported there (JAX only).
# The parent's pid comes as an argument: read in the child, it could already be a
# reaper's if the parent died while JAX was being imported.
_NEIGHBOUR_LOOP = """
import os, sys
core, parent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {core})
import jax, jax.numpy as jnp
step = jax.jit(lambda a, b: jnp.tanh(a @ b))
a = jnp.ones((512, 1024), jnp.float32) / 1024
b = jnp.ones((1024, 1024), jnp.float32)
a = step(a, b).block_until_ready()  # compiled: busy from the first timed call on
print('busy', flush=True)
while os.getppid() == parent:
  a = step(a, b).block_until_ready()
"""


class BusyNeighbours:
  """A context: one process per core of `cores`, each running float32 matrix products
  in a loop (one thread, `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`), while the
  tasks are timed.

  Lanes on neighbouring cores compute at once, and each task then runs slower than alone
  (a shared last-level cache and memory bus, an all-core clock below the one-core
  turbo): at K = 2 and 4 lanes the lanes' tasks ran 1.04-1.27x a profile measured with
  idle neighbours on a 16-core machine (docs/simulator.md). Measuring with the lanes'
  other cores busy prices tasks as the lanes run them; there it raised DDG K=4's
  predicted time by 6 % (one pair of profiles), less than two runs moved. Entering waits
  until every neighbour computes; leaving stops them (SIGKILL after 5 s); a neighbour
  whose parent dies stops by itself.
  """

  def __init__(self, cores: Sequence[int]):
    self.cores = tuple(int(c) for c in cores)
    self.processes = []

  def __enter__(self):
    environment = {
      **os.environ,
      'JAX_PLATFORMS': 'cpu',
      'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false',
      'OMP_NUM_THREADS': '1',
    }
    try:
      for core in self.cores:
        self.processes.append(
          subprocess.Popen(
            [sys.executable, '-c', _NEIGHBOUR_LOOP, str(core), str(os.getpid())],
            env=environment,
            stdout=subprocess.PIPE,
            text=True,
          )
        )
      for process, core in zip(self.processes, self.cores):
        if process.stdout.readline().strip() != 'busy':
          raise RuntimeError(f'BusyNeighbours: the neighbour on core {core} did not start.')
    except BaseException:
      self.__exit__(None, None, None)
      raise
    return self

  def __exit__(self, *exc):
    for process in self.processes:
      process.terminate()
    for process in self.processes:
      try:
        process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
      process.stdout.close()
    self.processes = []
    return False


# --- measuring --------------------------------------------------------------------------------
def measure_times(
  calls: Mapping[Any, tuple[Callable, tuple]],
  *,
  warmup: int = 3,
  reps: int = 30,
  clock: Callable[[], float] = time.perf_counter,
) -> dict[Any, list[float]]:
  """`{key: [seconds of each timed call]}`: `warmup` untimed calls of every task,
  then `reps` rounds timing each task once (interleaved), each call waited for."""
  if warmup < 1 or reps < 1:
    raise ValueError(f'warmup and reps must be >= 1, got warmup={warmup}, reps={reps}.')
  for fn, args in calls.values():
    for _ in range(warmup):
      transfer.wait(fn(*args))
  times = {key: [] for key in calls}
  for _ in range(reps):
    for key, (fn, args) in calls.items():
      start = clock()
      transfer.wait(fn(*args))
      times[key].append(clock() - start)
  return times


def measure(
  calls: Mapping[Any, tuple[Callable, tuple]],
  *,
  warmup: int = 3,
  reps: int = 30,
  clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict, dict]:
  """(cost, spread) of every `fn(*args)` in `calls` (see the module docstring).

  Returns:
    `{key: seconds}` (the median over `reps` interleaved blocking calls) and
    `{key: {'min': s, 'p90': s}}`.
  """
  times = measure_times(calls, warmup=warmup, reps=reps, clock=clock)
  costs = {key: float(np.median(ts)) for key, ts in times.items()}
  return costs, {key: spread_of(ts) for key, ts in times.items()}


def measure_table(
  calls: Mapping[Any, tuple[Callable, tuple]],
  *,
  split,
  tasks: str,
  warmup: int = 3,
  reps: int = 30,
  clock: str = 'wall',
) -> Table:
  """`measure` as a `Table`; `clock` names one of `CLOCKS`."""
  [table] = measure_tables([(calls, split, tasks)], warmup=warmup, reps=reps, clock=clock)
  return table


def measure_tables(
  task_sets: Sequence[tuple[Mapping[Any, tuple[Callable, tuple]], Any, str]],
  *,
  warmup: int = 3,
  reps: int = 30,
  clock: str = 'wall',
) -> list[Table]:
  """The `Table` of each `(calls, split, tasks)` of `task_sets`, measured together: each
  round times every task of every set once, so that the machine's speed at the time
  prices every table alike. Measured one after another, the tables of one profile could
  disagree on the same computation by more than the lanes' own spread (a whole-model
  forward, one program in three tables measured a minute apart: 29, 41 and 38 ms of a
  core's CPU time; in the lanes 31-40 ms)."""
  if clock not in CLOCKS:
    raise ValueError(f'clock: {clock!r}; allowed: {", ".join(CLOCKS)}.')
  every = {
    (n, key): call for n, (calls, _, _) in enumerate(task_sets) for key, call in calls.items()
  }
  costs, spread = measure(every, warmup=warmup, reps=reps, clock=CLOCKS[clock])
  return [
    Table(
      as_split(split),
      tasks,
      {key: costs[(n, key)] for key in calls},
      {key: spread[(n, key)] for key in calls},
    )
    for n, (calls, split, tasks) in enumerate(task_sets)
  ]


def make_profile(
  model,
  batch_size: int,
  optimizer: str,
  tables: Sequence[Table],
  *,
  warmup: int,
  reps: int,
  clock: str = 'wall',
  pinned: bool = False,
  dispatch: Mapping[str, float] | None = None,
  device: jax.Device | None = None,
  busy_cores: int = 0,
) -> Profile:
  """A profile of `tables` measured now on `device` (default: the first device), with
  `busy_cores` other cores of the host computing meanwhile (`BusyNeighbours`)."""
  device = device or jax.devices()[0]
  return Profile(
    model=model_id(model),
    batch_size=int(batch_size),
    optimizer=optimizer,
    device_kind=device.device_kind,
    platform=device.platform,
    jax_version=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    statistic=STATISTIC,
    clock=clock,
    pinned=bool(pinned),
    warmup=int(warmup),
    reps=int(reps),
    dispatch=dict(dispatch or {}),
    tables=tuple(tables),
    busy_cores=int(busy_cores),
  )


# --- stages of a pipeline (`jaxsgd.pipeline.PlacedStages`) ------------------------------------
def pipeline_table(
  pipeline, roles, batch: dict, *, warmup: int = 3, reps: int = 30, clock: str = 'wall'
) -> Table:
  """The measured table of `pipeline`'s stages in `roles`, on one host `batch`.

  Times the very calls `PlacedStages.time_tasks` times (forward, backward, update
  per stage), each the median of its interleaved calls (`measure`).
  """
  calls = pipeline.task_calls(roles, batch)
  return measure_table(
    calls,
    split=split_of(pipeline.stages),
    tasks=roles_signature(roles),
    warmup=warmup,
    reps=reps,
    clock=clock,
  )
