"""Measuring the executors' host costs and the lanes: dispatch, the driver, the links.

A task's measured cost (`task_timing`) is one blocking JAX call. An *executor* adds host
time on top of it, and the process executor adds messages between its driver and the
lane processes and moves between lanes; the virtual clock simulates those from figures
measured here and kept in a host profile (`cost.host`, `jaxsgd.scheduler.host`; written
by `python -m experiments.profile --host=EXECUTOR`, `experiments.profile.measure_host`):

- `measure_dispatch`: the host overhead an executor adds per task (`dispatch`);
- `measure_process_dispatch`: the process executor's (`dispatch`: a lane's time between
  two queued calls, `measure_call_gap`; its processes' CPU per task, `dispatch_loaded`),
  its driver's CPU per event and a message's way between it and a lane (`driver`,
  `driver_latency`); `measure_loaded_driver`: those two with a busy lane on every core;
- `link_timing.measure_process_links`: a move between two lane processes.

The rule: each figure is what a run pays, measured the way a run pays it — chains of
named tasks (`dispatch_tasks`, built by the lane processes themselves) of a run's length
through the very executor — and is the median over repetitions (a lane's time between
calls, the driver's latency: differences of two times), or the minimum (the in-process
executors' dispatch: other processes only add time).

Reference: docs/simulator.md (the process executor's host: dispatch, driver);
tests/scheduler/test_dispatch_and_links.py, tests/scheduler/test_profiles.py,
tests/scheduler/test_emulated_tasks.py, tests/lanes/test_lanes.py.
"""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxsgd.scheduler.executor import HOLD_WHILE_QUEUED


# --- the executors' dispatch and the process executor's driver --------------------------------
def dispatch_tasks() -> dict[str, Callable]:
  """The trivial task whose dispatch is timed (a `TaskRecipe` factory: lane processes
  build it themselves): a 4-byte add (of every array of a pytree: `add_one` makes a
  move's new message)."""
  return {
    'add_one': jax.jit(lambda x: jax.tree.map(lambda a: a + 1, x)),
    'first': jax.jit(lambda x: jax.tree.leaves(x)[0].reshape(-1)[0]),  # any pytree
    'busy': jax.jit(_busy),
  }


def _busy(x):
  """`x` (a scalar) + 0, after 16 products of two 512 x 512 float32 matrices (tens of
  milliseconds on one CPU core): a task that keeps its lane's core busy."""
  import jax.numpy as jnp

  a = jnp.full((512, 512), x, jnp.float32) / 512
  a = jax.lax.fori_loop(0, 16, lambda _, m: jnp.tanh(m @ m), a)
  return x + 0 * a[0, 0]


def measure_dispatch(
  executors: Mapping[str, Callable[[], Any]] | None = None,
  *,
  tasks: int = 200,
  rounds: int = 5,
  lane: str = 'dispatch',
  ahead: bool = True,
) -> dict[str, float]:
  """Seconds of host overhead per task: `jax_call` and each executor's.

  `jax_call` is one blocking call of a trivial jitted function (a 4-byte add):
  what every task pays for JAX's dispatch and the wait, and what a measured cost
  already includes. An executor's figure is the wall time per task of one process
  yielding `tasks` such calls in a row (each on the previous one's result) through
  it, minus `jax_call`: what it adds to every task of a lane that it keeps busy —
  its bookkeeping, and for the process executor the round trip to the lane process
  as far as running ahead does not hide it. Each is the minimum over `rounds` rounds
  of the mean per task (the minimum: other processes only ever add time).

  Args:
    executors: name -> a function returning a fresh executor (default: the real
      executor, cooperative and threaded). The task is a named one (`tasks.Task`),
      so a `ProcessExecutor` over a pool with a lane called `lane` can run it.
    lane: the name of the one lane the tasks run on.
    ahead: False marks every task `Compute(..., ahead=False)`: its process waits until
      it has ended before yielding the next (for the process executor, until the driver
      has heard of its end: the round trip; `benchmarks/lane_overheads.py`).
  """
  from jaxsgd.scheduler.real import RealExecutor
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  if executors is None:
    executors = {'real': RealExecutor, 'real_threads': lambda: RealExecutor(threads=True)}
  task = Task(TaskRecipe.of(dispatch_tasks), 'add_one')
  tiny = task.recipe.build()['add_one']
  x = np.zeros((), np.float32)

  def per_task(run_once):
    run_once()  # warm-up
    best = math.inf
    for _ in range(rounds):
      start = time.perf_counter()
      run_once()
      best = min(best, (time.perf_counter() - start) / tasks)
    return best

  def direct():
    y = jax.device_put(x, jax.devices()[0])
    for _ in range(tasks):
      y = tiny(y)
      y.block_until_ready()

  overhead = {'jax_call': per_task(direct)}

  for name, make in executors.items():

    def through(make=make):
      _run_chains(make(), lanes=(lane,), tasks=tasks, ahead=ahead, name='add_one')

    overhead[name] = max(per_task(through) - overhead['jax_call'], 0.0)
  return overhead


def measure_process_dispatch(
  *, cores: Sequence[int] = (0,), address: str | None = None, tasks: int = 200, rounds: int = 5
) -> dict[str, float]:
  """The process executor's host overhead per task, on one lane process pinned to
  `cores` (a Ray cluster at `address`, or one started here for the measurement):

  - `processes` (a host profile's `dispatch`): the lane's time between two queued calls
    after tasks of a run's length (`measure_call_gap`): what a task waits for beyond its
    own when the driver and Ray have cores of their own. A chain of trivial tasks run
    through the executor (`measure_dispatch`'s wall time per task) gives less: the same
    work between calls takes longer after a task of tens of milliseconds (figures:
    benchmarks/results/schedule_error.md).
  - `driver`, `driver_latency` (`_driver_figures`, `rounds` chains): the driver's CPU seconds per
    event (a task dispatched, a task's end heard) and each way of a message between it
    and a lane (a task's end to the driver hearing of it, less `driver`), over chains of
    `busy` tasks (tens of milliseconds, as a run's), each waited for: a driver that has
    waited milliseconds wakes later than one that dispatched microseconds before.
  - `processes_cpu` (only with a cluster started for it): the CPU seconds per task of
    every process of the run (the driver, the lane, Ray's raylet and GCS: all this
    process's descendants then): what a lane loses per task where lanes take every
    core (a host profile's `dispatch_loaded`), over the chain of trivial tasks
    (`measure_dispatch`'s) run through the executor, less what those processes take
    anyway over its time (`measure_upkeep`; a host profile's `upkeep`).
  """
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster  # Ray only if asked
  from jaxsgd.scheduler.process import ProcessExecutor

  placement = LanePlacement.parse(f'dispatch@cores={",".join(map(str, cores))}')
  with LanePool(placement, address=address, verbose=False) as pool:
    before, start = _cpu_seconds_by_pid(), time.perf_counter()
    measured = measure_dispatch(
      {'processes': lambda: ProcessExecutor(pool=pool, verbose=False)},
      tasks=tasks,
      rounds=rounds,
    )
    after, wall = _cpu_seconds_by_pid(), time.perf_counter() - start
    owns_cluster = cluster.started_here()
    upkeep = measure_upkeep(1.0) if owns_cluster else 0.0  # (the lane warm now)
    between_calls = measure_call_gap(pool, 'dispatch', tasks=RUN_LENGTH_TASKS, repeats=rounds)
    per_event, latency = _driver_figures(
      ProcessExecutor(pool=pool, verbose=False),
      lanes=('dispatch',),
      tasks=RUN_LENGTH_TASKS,
      name='busy',
      warmup=5,
      repeats=rounds,
    )
  figures = {
    'processes': between_calls,
    'driver': per_event,
    'driver_latency': latency,
  }
  if owns_cluster:  # Ray's processes are this one's descendants: all counted
    cpu = _cpu_between(before, after)
    # `measure_dispatch` runs the chain once to warm up, then `rounds` times, and
    # before that its `jax_call` loop, whose CPU (this process's) is taken out, as is
    # what the processes take with no task (a host profile charges that apart).
    cpu -= (rounds + 1) * tasks * measured['jax_call'] + upkeep * wall
    figures['processes_cpu'] = max(cpu / ((rounds + 1) * tasks), 0.0)
  return figures


RUN_LENGTH_TASKS = 40  # `busy` tasks of the driver's idle figures: ~1 s

# Chains `_driver_figures` takes the median over: a machine's state (how soon a waiting
# thread wakes) can last as long as one chain, so one chain's median hear delay can be
# off by a factor of two (figures: benchmarks/results/schedule_error.md).
DRIVER_REPEATS = 5


def measure_call_gap(
  pool, lane: str, *, seconds: float | None = None, tasks: int = 40, repeats: int = 5
) -> float:
  """A lane's time between two calls queued one behind the other (`queued_gap`) over
  chains of `tasks` tasks of a run's length on `lane` of `pool`, `executor.RUN_AHEAD` in
  flight, the first 3 of each left out; the median over `repeats` chains (as the
  driver's figures: a machine's state can last a chain). Tasks that compute
  (`dispatch_tasks`' 'busy', tens of milliseconds) or, with `seconds`, emulated tasks of
  that length. It is longer than between trivial tasks, and can be longer still after
  an emulated task that slept (spinning through the task instead shortened it; figures:
  benchmarks/results/schedule_error.md)."""
  chains = (_busy_chain(pool, lane, tasks, seconds) for _ in range(repeats))
  return float(np.median([queued_gap(calls) for calls in chains]))


def measure_task_spread(pool, lane: str, *, tasks: int = 40, repeats: int = 3) -> float:
  """σ of a computing task's duration on `lane` of `pool` (`log_spread` of chains of
  `tasks` 'busy' tasks of `dispatch_tasks`, `executor.RUN_AHEAD` in flight, the first 3
  of each left out; the median over `repeats` chains): the `cost.straggler_std` of this
  machine's tasks. No two runs of a task take the same time, and a virtual clock whose
  identical lanes' tasks do keeps them in step for the whole run, as no lanes in
  processes stay (docs/simulator.md, stragglers)."""
  chains = (_busy_chain(pool, lane, tasks) for _ in range(repeats))
  return float(np.median([log_spread([c.ended - c.started for c in calls]) for calls in chains]))


def _busy_chain(pool, lane: str, tasks: int, seconds: float | None = None) -> list:
  """`tasks` done calls of `dispatch_tasks`' 'busy' on `lane` of `pool` (emulated, of
  `seconds`, if given), each sent while `executor.RUN_AHEAD` are in flight, after 3 left
  out (the lane's first calls)."""
  from jaxsgd.scheduler.executor import RUN_AHEAD
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  task = Task(TaskRecipe.of(dispatch_tasks), 'busy')
  emulated = {} if seconds is None else {'seconds': seconds}
  calls = []
  for i in range(tasks + 3):
    calls.append(pool.start(lane, task, (np.float32(i),), **emulated))
    pool.wait_all(calls[:-RUN_AHEAD])
  pool.wait_all(calls)
  return calls[3:]


def log_spread(durations) -> float:
  """The standard deviation of the logarithms of `durations` (seconds, > 0): the σ of a
  log-normal that draws them, as `cost.straggler_std` prices every task."""
  seconds = np.asarray(durations, np.float64)
  if seconds.size < 2 or not np.all(seconds > 0):
    raise ValueError(f'log_spread: two or more positive durations, got {list(durations)}.')
  return float(np.log(seconds).std())


def queued_gap(calls) -> float:
  """The median of `b.started - a.ended` over consecutive calls a, b of one lane (done
  `lanes.Pending`s, in the order sent) where b was sent before a ended."""
  gaps = [b.started - a.ended for a, b in zip(calls, calls[1:]) if b.sent < a.ended]
  if not gaps:
    raise RuntimeError('queued_gap: no call was sent before the one ahead of it ended.')
  return float(np.median(gaps))


def _run_chains(executor, *, lanes: Sequence[str], tasks: int, ahead: bool, name: str):
  """The `Timeline` of one process per lane of `lanes`, each yielding `tasks` named tasks
  `name` of `dispatch_tasks` on its lane through `executor`, each on the previous one's
  result (`ahead=False`: each waited for)."""
  from jaxsgd.scheduler.core import Cluster, Compute, Process
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  task = Task(TaskRecipe.of(dispatch_tasks), name)

  def program():
    y = np.zeros((), np.float32)
    for _ in range(tasks):
      y = yield Compute(task, (y,), kind='dispatch', ahead=ahead)

  cluster = Cluster()
  indices = [cluster.add_lane(lane, jax.devices()[0]) for lane in lanes]
  return executor.run(cluster, [Process(lane, i, program()) for lane, i in zip(lanes, indices)])


def measure_loaded_driver(
  *,
  cores: Sequence[int],
  address: str | None = None,
  tasks: int = 40,
  repeats: int = DRIVER_REPEATS,
) -> dict[str, float]:
  """The simulated driver's figures while the lanes keep every core of `cores` busy:
  `driver_loaded` and `driver_latency_loaded`, measured as `measure_process_dispatch`'s
  `driver` and `driver_latency`, over one lane process pinned to each core of `cores`,
  each running `repeats` chains of `tasks` ~25 ms tasks (`dispatch_tasks`' `busy`) run
  ahead, as the process executor runs a family's (the first fifth of each left out);
  `driver_loaded_lanes`, how many lanes were busy. Where the lanes take every core, the
  driver and Ray run only when they preempt a lane: a task's end reaches the driver
  several times later than on an idle machine (benchmarks/results/simulator_history.md).
  With a cluster started for it, also `upkeep` (`measure_upkeep`, those lanes
  warm and waiting): what the run's processes take from the lanes' cores with no task.
  """
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster  # Ray only if asked
  from jaxsgd.scheduler.process import ProcessExecutor

  if tasks < 5:
    raise ValueError(f'measure_loaded_driver: tasks per lane, at least 5; got {tasks}.')
  lanes = [f'busy{core}' for core in cores]
  placement = LanePlacement.parse('; '.join(f'{n}@cores={c}' for n, c in zip(lanes, cores)))
  with LanePool(placement, address=address, verbose=False) as pool:
    _run_chains(  # compiled on every lane, and the lanes warm
      ProcessExecutor(pool=pool, verbose=False), lanes=lanes, tasks=2, ahead=True, name='busy'
    )
    upkeep = {'upkeep': measure_upkeep()} if cluster.started_here() else {}
    executor = ProcessExecutor(pool=pool, verbose=False)
    per_event, latency = _driver_figures(
      executor, lanes=lanes, tasks=tasks, ahead=True, name='busy', warmup=5, repeats=repeats
    )
  return {
    'driver_loaded': per_event,
    'driver_latency_loaded': latency,
    'driver_loaded_lanes': float(len(lanes)),
    **upkeep,
  }


def measure_upkeep(seconds: float = 2.0, settle: float = 0.5) -> float:
  """Cores of CPU that this process and its descendants take over `seconds` of waiting,
  after `settle` seconds (what the tasks just run left to finish): their CPU seconds
  over the wall seconds. With lane processes waiting on a cluster started here, that is
  the executor's own cost with no task to run (Ray's daemons' heartbeats, the lanes' and
  the driver's threads): a host profile's `upkeep`. Processes that start or end
  meanwhile are left out."""
  time.sleep(settle)
  before, start = _cpu_seconds_by_pid(), time.perf_counter()
  time.sleep(seconds)
  after, wall = _cpu_seconds_by_pid(), time.perf_counter() - start
  return _cpu_between(before, after) / wall


def _cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
  """CPU seconds between two `_cpu_seconds_by_pid` readings of the processes in both."""
  return sum(after[pid] - before[pid] for pid in after.keys() & before.keys())


def _driver_figures(
  executor,
  *,
  lanes: Sequence[str],
  tasks: int,
  ahead: bool = False,
  name: str = 'add_one',
  warmup: int = 10,
  repeats: int = DRIVER_REPEATS,
) -> tuple[float, float]:
  """`(CPU seconds of this thread per event, driver latency)` of `executor` running a
  chain of `tasks` named tasks `name` per lane of `lanes` (`_run_chains`; `ahead=False`:
  each waited for), `repeats` times, the median of each figure over the repeats. Per
  chain: two events per task, its dispatch and its end heard; the latency is the median
  time from a task's end to the driver hearing of it, less the CPU per event (at least
  0), over the ends the lane sent as they came (`sent_at_once`), the first `1 / warmup`
  of each chain left out (warm-up)."""
  figures = []
  for _ in range(repeats):
    cpu = time.thread_time()
    records = _run_chains(executor, lanes=lanes, tasks=tasks, ahead=ahead, name=name).records
    cpu = time.thread_time() - cpu
    per_event = cpu / (2 * len(records))
    heard = []
    for lane in {r.lane for r in records}:
      chain = sorted((r for r in records if r.lane == lane), key=lambda r: r.start)
      heard += [r.heard - r.end for r in sent_at_once(chain[len(chain) // warmup :])]
    figures.append((per_event, max(float(np.median(heard)) - per_event, 0.0)))
  per_event, latency = np.median(figures, axis=0)
  return float(per_event), float(latency)


def sent_at_once(chain: Sequence) -> list:
  """The task records of one lane's chain (in order) whose end the lane sent as it
  ended: a lane holds the end of a task run ahead while `HOLD_WHILE_QUEUED` calls are
  queued behind it (docs/engine.md, "Running ahead"), so those whose task that many
  places later was dispatched after their end (or that have none). A held end's time to
  the driver is the next reply's, not a message's way."""
  later = [*chain[HOLD_WHILE_QUEUED:], *[None] * min(HOLD_WHILE_QUEUED, len(chain))]
  return [
    record
    for record, following in zip(chain, later)
    if following is None or following.dispatched is None or following.dispatched >= record.end
  ]


def _cpu_seconds_by_pid() -> dict[int, float]:
  """CPU seconds (user + system) of this process and of each of its descendants."""
  import psutil

  me = psutil.Process()
  seconds = {}
  for process in [me, *me.children(recursive=True)]:
    try:
      times = process.cpu_times()
    except psutil.Error:  # ended meanwhile
      continue
    seconds[process.pid] = times.user + times.system
  return seconds
