"""Measuring the executors' host costs and the lanes: dispatch, the driver, the links.

A task's measured cost (`task_timing`) is one blocking JAX call. An *executor* adds host
time on top of it, and the process executor adds messages between its driver and the
lane processes and moves between lanes; the virtual clock simulates those from figures
measured here and kept in a host profile (`cost.host`, `jaxsgd.scheduler.host`; written
by `python -m experiments.profile --host=EXECUTOR`, `experiments.profile.measure_host`):

- `measure_dispatch`: the host overhead an executor adds per task (`dispatch`);
- `measure_process_dispatch`: the process executor's (`dispatch`, and its processes' CPU
  per task, `dispatch_loaded`), its driver's CPU per event and a message's way between
  it and a lane (`driver`, `driver_latency`); `measure_loaded_driver`: those two with a
  busy lane on every core (`driver_loaded`, `driver_latency_loaded`);
- `measure_process_links`: a move between two lane processes, its link (`link_latency`,
  `link_bandwidth`, `link_per_array`) and the receiving lane's taking it in at the call
  that reads it (`take_in_latency`, `take_in_bandwidth`, `take_in_per_array`).

The rule: each figure is what a run pays, measured the way a run pays it — a chain of
named tasks (`dispatch_tasks`, built by the lane processes themselves) through the very
executor, and a new value for every move — and is the minimum (dispatch: other
processes only add time) or the median (the driver's latency, a move: a difference of
two times) over repetitions.

Reference: docs/simulator.md (the process executor's host: dispatch, driver, links);
tests/scheduler/test_dispatch_and_links.py, tests/lanes/test_lanes.py.
"""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


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

  - `processes`: `measure_dispatch`'s figure, wall time per task of a chain of tasks:
    what a task waits for the driver and Ray when they have cores of their own (a host
    profile's `dispatch`).
  - `driver`, `driver_latency` (`_driver_figures`): the driver thread's CPU seconds per
    event (a task dispatched, a task's end heard) and each way of a message between it
    and a lane (a task's end to the driver hearing of it, less `driver`), over chains of
    `busy` tasks (tens of milliseconds, as a run's), each waited for: a driver that has
    waited milliseconds wakes later than one that dispatched microseconds before.
  - `processes_cpu` (only with a cluster started for it): the CPU seconds per task of
    every process of the run (the driver, the lane, Ray's raylet and GCS: all this
    process's descendants then): what a lane loses per task where lanes take every
    core (a host profile's `dispatch_loaded`; above the wall-time figure, as the
    driver, the lane and the raylet work at once).
  """
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster  # Ray only if asked
  from jaxsgd.scheduler.process import ProcessExecutor

  placement = LanePlacement.parse(f'dispatch@cores={",".join(map(str, cores))}')
  with LanePool(placement, address=address, verbose=False) as pool:
    before = _cpu_seconds_by_pid()
    measured = measure_dispatch(
      {'processes': lambda: ProcessExecutor(pool=pool, verbose=False)},
      tasks=tasks,
      rounds=rounds,
    )
    after = _cpu_seconds_by_pid()
    owns_cluster = cluster.started_here()
    per_event, latency = _driver_figures(
      ProcessExecutor(pool=pool, verbose=False),
      lanes=('dispatch',),
      tasks=RUN_LENGTH_TASKS,
      name='busy',
      warmup=5,
    )
  figures = {
    'processes': measured['processes'],
    'driver': per_event,
    'driver_latency': latency,
  }
  if owns_cluster:  # Ray's processes are this one's descendants: all counted
    cpu = sum(after[pid] - before[pid] for pid in after.keys() & before.keys())
    # `measure_dispatch` runs the chain once to warm up, then `rounds` times, and
    # before that its `jax_call` loop, whose CPU (this process's) is taken out.
    figures['processes_cpu'] = max(
      (cpu - (rounds + 1) * tasks * measured['jax_call']) / ((rounds + 1) * tasks), 0.0
    )
  return figures


RUN_LENGTH_TASKS = 40  # `busy` tasks of the driver's idle figures: ~1 s


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
  *, cores: Sequence[int], address: str | None = None, tasks: int = 40
) -> dict[str, float]:
  """The simulated driver's figures while the lanes keep every core of `cores` busy:
  `driver_loaded` and `driver_latency_loaded`, measured as `measure_process_dispatch`'s
  `driver` and `driver_latency`, over one lane process pinned to each core of `cores`,
  each running chains of `tasks` ~25 ms tasks (`dispatch_tasks`' `busy`) run ahead, as
  the process executor runs a family's (the first fifth of each chain left out);
  `driver_loaded_lanes`, how many lanes were busy. Where the lanes take every core, the
  driver and Ray run only when they preempt a lane: a task's end reaches the driver
  several times later than on an idle machine (benchmarks/results/simulator_history.md).
  """
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool  # Ray only when asked for
  from jaxsgd.scheduler.process import ProcessExecutor

  if tasks < 5:
    raise ValueError(f'measure_loaded_driver: tasks per lane, at least 5; got {tasks}.')
  lanes = [f'busy{core}' for core in cores]
  placement = LanePlacement.parse('; '.join(f'{n}@cores={c}' for n, c in zip(lanes, cores)))
  with LanePool(placement, address=address, verbose=False) as pool:
    _run_chains(  # compiled on every lane, and the lanes warm
      ProcessExecutor(pool=pool, verbose=False), lanes=lanes, tasks=2, ahead=True, name='busy'
    )
    executor = ProcessExecutor(pool=pool, verbose=False)
    per_event, latency = _driver_figures(
      executor, lanes=lanes, tasks=tasks, ahead=True, name='busy', warmup=5
    )
  return {
    'driver_loaded': per_event,
    'driver_latency_loaded': latency,
    'driver_loaded_lanes': float(len(lanes)),
  }


# Chains `_driver_figures` takes the median over: a machine's state (how soon a waiting
# thread wakes) can last as long as one chain, so one chain's median hear delay can be
# off by a factor of two (figures: benchmarks/results/schedule_error.md).
DRIVER_REPEATS = 5


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
  0), the first `1 / warmup` of each chain's hear delays left out (warm-up)."""
  figures = []
  for _ in range(repeats):
    cpu = time.thread_time()
    records = _run_chains(executor, lanes=lanes, tasks=tasks, ahead=ahead, name=name).records
    cpu = time.thread_time() - cpu
    per_event = cpu / (2 * len(records))
    heard = []
    for lane in {r.lane for r in records}:
      chain = sorted((r for r in records if r.lane == lane), key=lambda r: r.start)
      heard += [r.heard - r.end for r in chain[len(chain) // warmup :]]
    figures.append((per_event, max(float(np.median(heard)) - per_event, 0.0)))
  per_event, latency = np.median(figures, axis=0)
  return float(per_event), float(latency)


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


# --- links between lane processes -------------------------------------------------------------
class Moves(NamedTuple):
  """A move between two lane processes, in two parts, each `(latency s, bandwidth B/s,
  seconds per array beyond a message's first)`: `link`, from the end of the task that
  made the value on the sending lane to its copy arriving on the receiving one (the
  export, the socket), and `take_in`, what the receiving lane then spends making the
  copy its own — paid in front of the first call there that reads it, one call after
  another, however early the copy arrived (`LaneRuntime.take_in`)."""

  link: tuple[float, float, float]
  take_in: tuple[float, float, float]


RUN_LENGTH_PAUSE = 0.02  # s the sending lane waits before the task that makes a move's value


def measure_process_links(
  *,
  cores: Sequence[int] = (0, 1),
  address: str | None = None,
  sizes: Sequence[int] = (1 << 16, 1 << 24),
  arrays: int = 64,
  many_bytes: int = 1 << 20,
  reps: int = 31,
  warmup: int = 3,
) -> Moves:
  """A move between two lane processes (`LanePool.move`, lane to lane), pinned to
  `cores[0]` and `cores[1]`, as its `link` and its `take_in` (`Moves`), each measured as
  a run pays it. For each message, `reps` times: the sending lane waits a run's task
  length (`RUN_LENGTH_PAUSE`, an emulated task), then a task makes the message anew;
  the copy and the receiving lane's call that reads it are asked for before either
  runs, as a process running ahead asks for them. Its link is the time from that task's
  end to the copy's arrival (`LanePool.exported`), its take-in the time from the
  arrival to the reading task's start, less a call's own time from its start to its
  task's on a value already there (the profile's `dispatch` holds that); the messages
  interleaved, the median of each.

  Each part's latency and bandwidth are the line through one-array messages of the two
  `sizes` (`link_line`); its time per array is what a message of `arrays` arrays of
  `many_bytes` bytes in all takes beyond one array of those bytes, per array after the
  first (a lane process exports and takes in a message array by array: a pushed
  gradient of a 16-layer MLP is 34 arrays). Against one array of the same bytes, not the
  line, whose bandwidth's error the difference would carry.

  Why a run's way: a lane that has just ended a task replies to the driver, then its
  export thread copies the result in the same interpreter, and a call waiting for a copy
  wakes when it comes: both took about twice a copy of a value long made, read by a call
  sent after it came (`benchmarks/results/schedule_error.md`). A new value every time, as
  every message of a run is one. Medians: the minimum of a difference is not the
  difference of the minima."""
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool  # Ray only when asked for
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  make = Task(TaskRecipe.of(dispatch_tasks), 'add_one')
  first = Task(TaskRecipe.of(dispatch_tasks), 'first')
  placement = LanePlacement.parse(f'source@cores={cores[0]}; target@cores={cores[1]}')
  # (bytes, arrays): the line's two sizes, then the many arrays and one of their bytes
  messages = [(size, 1) for size in sizes] + [(many_bytes, arrays), (many_bytes, 1)]
  with LanePool(placement, address=address, verbose=False) as pool:
    pause = pool.put('source', np.zeros((), np.float32))
    here = pool.put('target', np.zeros((), np.float32))
    # A list: one value of `count` arrays, as a task's gradient or parameters (a tuple's
    # items would each be a value of their own, with a handle each: `LanePool`).
    sources = [
      pool.put('source', [np.zeros(size // 4 // count, np.float32) for _ in range(count)])
      for size, count in messages
    ]

    def moved(source) -> tuple[float, float]:  # (link, take-in) of a new message
      calls = [pool.start('source', make, (pause,), seconds=RUN_LENGTH_PAUSE)]
      calls.append(pool.start('source', make, (source,)))
      value = pool.early(calls[-1])
      if value is None:  # (its outline not known yet: the first time, a warm-up)
        pool.wait_any(calls[-1:])
        value = calls[-1].result()
      exports = []
      calls.append(pool.start('target', first, (pool.move(value, 'target', exports=exports),)))
      pool.wait_all(calls)
      pool.settle()
      arrival = pool.exported(exports)[1]
      alone = pool.start('target', first, (here,))
      pool.wait_any([alone])
      pool.held('target')  # the copies freed there now, not inside the next call
      own = alone.started - alone.entered
      return arrival - calls[1].ended, calls[2].started - arrival - own

    for _ in range(warmup):  # warm: compiled, the outlines known, the first copies taken in
      for source in sources:
        moved(source)
    # Interleaved: a slow spell of the machine slows every message, not one message's
    # (which tilts the line).
    times = [[moved(source) for source in sources] for _ in range(reps)]
  link, take_in = [
    _fit(sizes, arrays, [float(np.median([rep[i][part] for rep in times])) for i in range(4)])
    for part in (0, 1)
  ]
  return Moves(link, take_in)


def _fit(sizes: Sequence[int], arrays: int, seconds: Sequence[float]) -> tuple[float, float, float]:
  """`(latency, bandwidth, seconds per array)` of a move's median times: the two one-array
  messages of `sizes` (`link_line`), then `arrays` arrays of some bytes in all, beyond one
  array of those bytes (at least 0)."""
  *one_array, many, one_of_many = seconds
  latency, bandwidth = link_line(sizes, one_array)
  return latency, bandwidth, max(many - max(one_of_many, 0.0), 0.0) / (arrays - 1)


def link_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
  """`(latency s, bandwidth B/s)` of the line through two sizes' move times (a negative
  time counts as 0): bandwidth `(n2 - n1) / (t2 - t1)` (infinite if the larger size was
  not slower), latency `t1 - n1 / bandwidth` (at least 0)."""
  (n1, n2), (t1, t2) = sizes, [max(t, 0.0) for t in seconds]
  bandwidth = (n2 - n1) / (t2 - t1) if t2 > t1 else math.inf
  return max(t1 - n1 / bandwidth, 0.0), bandwidth
