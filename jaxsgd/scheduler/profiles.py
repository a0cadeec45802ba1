"""Cost profiles: task costs measured once, written to a file, reused by every run.

The virtual clock needs the seconds each task takes. Measuring them at the start
of every run (`costs.calibrate`) makes simulated times depend on whatever else
the machine was doing then. A *profile* measures them once, carefully, and is
read back as is, so two runs with the same profile simulate the same times, bit
for bit.

How a task is measured (`measure`):

    for each task: `warmup` calls (compile, caches), not timed
    for r in 1..reps:                      # interleaved: rep r of every task, then r + 1
      for each task: t = clock time of fn(*args) until every output is ready
    cost(task) = min over the reps of t

Why the minimum: other processes only ever *add* time to a call, never remove
any, so the fastest of many calls is the one closest to the task's own cost.
Interleaving spreads a burst of load over all tasks instead of inflating one.
The median and the 90th percentile are kept next to each cost (`spread`) so a
reader can see how loaded the machine was.

Which clock, and pinning (`clock`, `pin_to_core`). Wall time on every core is
what `costs.calibrate` measures and the default. The process's CPU time of a
process pinned to one core excludes the time other jobs held the core, and
gives one core's costs (the unit of a lane pinned to a core). On this 2-core
machine shared by ~7 jobs (load average 5–11), `benchmarks/profile_repeatability.py`
timed the CNN's 12 tasks repeatedly and compared each task's minimum across
repetitions (median over tasks of largest / smallest − 1): within one process,
pinned CPU time repeated to 8–16 % against 60–80 % for wall time on both cores;
across fresh processes (two profile commands), every method spread 24–80 %, and
which one did best changed from run to run. No statistic makes a measurement
repeatable on a machine this loaded: what makes a *simulation* repeatable is
measuring once and reading the same file back (two loads give equal `CostModel`s
and identical simulated timelines). Measure profiles on a quiet machine.

A cost is the time of one blocking call: device time plus one host dispatch,
as `costs.calibrate` measures it. The host overhead an *executor* adds per task
(its bookkeeping on top of the JAX call) is measured separately
(`measure_dispatch`) and stored in the profile's `dispatch` field; with the process
executor's figures (`measure_process_dispatch`) come `driver` and `driver_latency`, its
driver's CPU time per event and the time a message takes between it and a lane, which
`cost.driver` and `cost.driver_latency` simulate; `measure_loaded_driver` measures the
same two with a busy lane on every core (`driver_loaded`, `driver_latency_loaded`).
`cost.driver_from` reads either pair (`driver_of`).

File format (JSON, `FORMAT`):

    {"format": "jaxsgd-cost-profile/1",
     "model": {"name": "cnn", "input_shape": [40, 1], "num_classes": 10,
               "num_layers": 6, "num_params": 12345},
     "batch_size": 128, "optimizer": "adam", "device_kind": "cpu", "platform": "cpu",
     "jax_version": "0.10.2", "date": "2026-11-23T11:00:00+00:00",
     "statistic": "min", "clock": "wall", "pinned": false, "warmup": 3, "reps": 30,
     "dispatch": {"jax_call": 8e-06, "real": 3e-05, "real_threads": 6e-05},
     "tables": [{"split": [[0, 3], [3, 6]], "tasks": "<roles signature>",
                 "costs": {"0/forward": 0.001, "0/backward": 0.002, ...},
                 "spread": {"0/forward": {"median": ..., "p90": ...}, ...}}]}

A profile holds one table per (stage split, task set): a suite whose methods
cut the model the same way and run the same computations shares one table (BP
and DDG), others add their own (auxiliary heads change the computation). Cost
keys are those of `CostModel.compute`: `(stage, kind)` written `"stage/kind"`,
or `kind` alone (every stage).
"""

import dataclasses
import datetime
import json
import math
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.costs import CostModel

FORMAT = 'jaxsgd-cost-profile/1'
STATISTIC = 'min'
# A profile's `statistic` when its costs are a real run's medians (`calibrate`).
CALIBRATED = 'median of a run'
# The other figures of each task's repetitions a profile keeps (`Table.spread`).
SPREAD_STATISTICS = ('median', 'p90')
# The simulated driver's two figures (per event, each way) in a profile's `dispatch`, by
# `cost.driver_from`: measured with an idle lane, or with a busy lane on every core.
DRIVER_FIGURES = {
  'profile': ('driver', 'driver_latency'),
  'profile_loaded': ('driver_loaded', 'driver_latency_loaded'),
}
# The `experiments.profile` flag that measures each pair.
DRIVER_FLAGS = {'profile': '--dispatch_processes', 'profile_loaded': '--loaded_driver'}
_FIELDS = (
  'format',
  'model',
  'batch_size',
  'optimizer',
  'device_kind',
  'platform',
  'jax_version',
  'date',
  'statistic',
  'clock',
  'pinned',
  'warmup',
  'reps',
  'dispatch',
  'tables',
)
CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}
_MODEL_FIELDS = ('name', 'input_shape', 'num_classes', 'num_layers', 'num_params')


class ProfileError(ValueError):
  """A profile file that cannot be read, or does not fit the run."""


@dataclasses.dataclass(frozen=True)
class Table:
  """The measured costs of one stage split and task set.

  Attributes:
    split: `[start, end)` layer range of every stage.
    tasks: names the computations measured (`roles_signature`, or a caller's name).
    costs: seconds keyed like `CostModel.compute`: `(stage, kind)` or `kind`.
    spread: per key, `{'median': s, 'p90': s}` of the same repetitions (diagnostic).
  """

  split: tuple[tuple[int, int], ...]
  tasks: str
  costs: Mapping[Any, float]
  spread: Mapping[Any, Mapping[str, float]] = dataclasses.field(default_factory=dict)

  def figures(self, statistic: str = STATISTIC) -> dict:
    """Seconds per task as `statistic` of the repetitions: `'min'` (`costs`, the cost of
    the work with nothing else in the way) or `'median'` / `'p90'` (`spread`: what a call
    typically takes, which is what a long run pays: on this 2-core VM the lanes' median
    task durations were within 5 % of the profile's medians and 15-30 % above its minima,
    `docs/simulator.md`). Refuses a table that lacks the figure for some task."""
    if statistic == STATISTIC:
      return dict(self.costs)
    if statistic not in SPREAD_STATISTICS:
      raise ProfileError(
        f'cost.statistic: {statistic!r} is not a figure of a profile; allowed: '
        f'{", ".join((STATISTIC, *SPREAD_STATISTICS))}.'
      )
    missing = [_key_str(k) for k in self.costs if statistic not in self.spread.get(k, {})]
    if missing:
      raise ProfileError(
        f'cost.profile: no {statistic} for task {missing[0]} (its table has no "spread"); '
        f"measure the profile again, or use cost.statistic='{STATISTIC}'."
      )
    return {k: float(self.spread[k][statistic]) for k in self.costs}


@dataclasses.dataclass(frozen=True)
class Profile:
  """Measured task costs of one model and batch size on one kind of device."""

  model: Mapping[str, Any]
  batch_size: int
  optimizer: str
  device_kind: str
  platform: str
  jax_version: str
  date: str
  statistic: str
  clock: str
  pinned: bool
  warmup: int
  reps: int
  dispatch: Mapping[str, float]
  tables: tuple[Table, ...]

  def table(self, split: Sequence[Sequence[int]], tasks: str) -> Table:
    """The table of `split` and `tasks`; refuses (naming what it has) when absent."""
    split = _split(split)
    for table in self.tables:
      if table.split == split and table.tasks == tasks:
        return table
    have = '; '.join(f'split={list(map(list, t.split))} tasks={t.tasks!r}' for t in self.tables)
    raise ProfileError(
      f'cost.profile: no table for split={list(map(list, split))} '
      f'tasks={tasks!r}; the profile has: {have or "none"}.'
    )


# --- identifying what was measured ---------------------------------------------------------
def model_id(model) -> dict:
  """What identifies a `StagedModel`'s computation: name, shapes, layers, parameters."""
  variables = jax.eval_shape(lambda key: model.init(key), jax.random.key(0))
  num_params = sum(
    int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(variables.get('params', {}))
  )
  return {
    'name': model.name,
    'input_shape': list(model.input_shape),
    'num_classes': int(model.num_classes),
    'num_layers': int(model.num_layers),
    'num_params': num_params,
  }


def optimizer_id(optimizer) -> str:
  """What of an optimizer changes the update task's computation (not the rates).

  `optimizer`: `config.optimizer` (a mapping) or its `OptimizerSettings`.
  """
  given = (
    dict(optimizer)
    if isinstance(optimizer, Mapping)
    else {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
  )
  kwargs = sorted(dict(given.get('kwargs') or {}))
  return (
    given['name']
    + (f'({",".join(kwargs)})' if kwargs else '')
    + ('+weight_decay' if given.get('weight_decay') else '')
  )


def split_of(stages) -> tuple[tuple[int, int], ...]:
  """`[start, end)` layer range of each stage of `models.split(...)`."""
  return tuple((s.first_layer, s.first_layer + len(s.layers)) for s in stages)


def roles_signature(roles) -> str:
  """The part of each `StageRole` that changes a stage's computation, stage by stage.

  The delay only decides *when* a backward runs, not what it computes, so BP and
  DDG (paper form) share one signature; a delayed backward at the current weights
  (stale graph, recomputation) and auxiliary heads do not.
  """
  return ','.join(
    f'{r.loss}:{"dy" if r.receives_delta else "-"}:{r.sends_delta}'
    f'{"" if r.backward_form == "stored" else ":" + r.backward_form}'
    for r in roles
  )


# --- measuring -----------------------------------------------------------------------------
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
  idle neighbours on a 16-core machine (docs/simulator.md, "Its error at K = 2, 4, 8").
  Measuring with the lanes' other cores busy prices tasks as the lanes run them; there it
  raised DDG K=4's predicted time by 6 % (one pair of profiles), less than two runs moved. Entering waits until every
  neighbour computes; leaving stops them (SIGKILL after 5 s); a neighbour whose parent
  dies stops by itself.
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
    `{key: seconds}` (the minimum over `reps` interleaved blocking calls) and
    `{key: {'median': s, 'p90': s}}`.
  """
  times = measure_times(calls, warmup=warmup, reps=reps, clock=clock)
  costs = {key: float(min(ts)) for key, ts in times.items()}
  spread = {
    key: {'median': float(np.median(ts)), 'p90': float(np.quantile(ts, 0.9))}
    for key, ts in times.items()
  }
  return costs, spread


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
  if clock not in CLOCKS:
    raise ValueError(f'clock: {clock!r}; allowed: {", ".join(CLOCKS)}.')
  costs, spread = measure(calls, warmup=warmup, reps=reps, clock=CLOCKS[clock])
  return Table(_split(split), tasks, costs, spread)


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
) -> Profile:
  """A profile of `tables` measured now on `device` (default: the first device)."""
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
  )


# --- stages of a pipeline (`jaxsgd.pipeline.PlacedStages`) --------------------------------
def pipeline_table(
  pipeline, roles, batch: dict, *, warmup: int = 3, reps: int = 30, clock: str = 'wall'
) -> Table:
  """The measured table of `pipeline`'s stages in `roles`, on one host `batch`.

  Times the very calls `PlacedStages.calibrate` times (forward, backward, update
  per stage), robustly (`measure`).
  """
  calls = pipeline.calibration_calls(roles, batch)
  return measure_table(
    calls,
    split=split_of(pipeline.stages),
    tasks=roles_signature(roles),
    warmup=warmup,
    reps=reps,
    clock=clock,
  )


def pipeline_costs(
  profile: Profile, pipeline, roles, *, optimizer: str | None = None, source: str = 'profile'
) -> dict:
  """`{(stage, kind): seconds}` for `pipeline` in `roles`, from `profile`.

  Refuses a profile of another model, batch size, stage split or task set: what
  `PlacedStages.calibrate` would have measured, read from the file instead.
  """
  return costs_for(
    profile,
    model=pipeline.model,
    batch_size=pipeline_batch_size(pipeline),
    split=split_of(pipeline.stages),
    tasks=roles_signature(roles),
    optimizer=optimizer,
    source=source,
  )


# `roles_signature(sequential_roles(1))`: one stage, the model's loss, nothing sent
# (a constant, so that this module needs nothing above the engine; tested).
WHOLE_MODEL_WORKER = 'head:-:none'


# The task set of a data-parallel worker's step (forward, backward and inner update
# of the whole model, one table for ssgd, local_sgd, dasgd and diloco): `(0, 'step')`.
WORKER_STEP = 'worker_step'


def server_tasks(algorithm: str) -> str:
  """The task set of a parameter-server algorithm (`asgd`, `dcasgd`): a worker's
  forward and backward of the whole model (one stage) and the server's update,
  whose computation depends on the algorithm (delay compensation)."""
  return f'{WHOLE_MODEL_WORKER}+server:{algorithm}'


def pipeline_batch_size(pipeline) -> int:
  return int(pipeline.inputs[0].shape[0])


# --- host dispatch overhead of the executors -----------------------------------------------
def dispatch_tasks() -> dict[str, Callable]:
  """The trivial task whose dispatch is timed (a `TaskRecipe` factory: lane processes
  build it themselves): a 4-byte add."""
  return {
    'add_one': jax.jit(lambda x: x + 1),
    'first': jax.jit(lambda x: x.reshape(-1)[0]),
    'busy': jax.jit(_busy),
  }


def _busy(x):
  """`x` (a scalar) + 0, after 16 products of two 512 x 512 float32 matrices (~25 ms on
  one core here): a task that keeps its lane's core busy."""
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
  of the mean per task (the minimum for the reason given in the module docstring).

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
    what a task waits for the driver and Ray when they have cores of their own.
  - `driver`: the CPU seconds of the driver's thread per event it handles (a task
    dispatched, a task's end heard), over a chain of tasks each waited for
    (`Compute(ahead=False)`): the simulated driver's time per event (`cost.driver`).
  - `driver_latency`: the median time from a task's end on the lane to the driver
    hearing of it, over the same chain, less `driver`: each way of a message between
    the driver and a lane (`cost.driver_latency`), on an idle machine.
  - `processes_cpu` (only with a cluster started for it): the CPU seconds per task of
    every process of the run — the driver, the lane and Ray's own (raylet, GCS), all
    descendants of this process then — over the same chain: what each task costs the
    machine's cores. On a machine whose lanes take every core (two lanes on this
    2-core VM), the driver and Ray run on the lanes' cores, and that is what a lane
    loses per task: measured here, ~0.7–0.8 ms per task against ~0.5 ms of wall time
    (the driver, the lane and the raylet work at once), and in a DDG K=2 run the
    driver and the raylet took 0.45 and 0.13 of the 2 cores.
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
      ProcessExecutor(pool=pool, verbose=False), lanes=('dispatch',), tasks=tasks
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
  `driver` and `driver_latency`, but over one lane process pinned to each core of
  `cores`, each running a chain of `tasks` tasks of ~25 ms of matrix products
  (`dispatch_tasks`' `busy`), run ahead as the process executor runs a family's tasks
  (the first fifth of each chain left out: warm-up); `driver_loaded_lanes`, how many
  lanes (cores) were busy.

  Why: where the lanes take every core (two lanes on a 2-core VM), the driver and Ray's
  processes only run when they preempt a lane, and a task's end reaches the driver
  later than on an idle machine: measured on a 2-core AMD EPYC VM (2026-11-28), 1.2-1.3
  ms from a task's end to the driver hearing of it with both lanes busy, 0.38 ms with
  an idle lane, and 1.5-2.4 ms (medians) in the families' runs of
  `benchmarks/simulator_accuracy.py`. Where a core is left to the driver, the idle
  figures are the ones that apply.
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
    per_event, latency = _driver_figures(
      ProcessExecutor(pool=pool, verbose=False),
      lanes=lanes,
      tasks=tasks,
      ahead=True,
      name='busy',
      warmup=5,
    )
  return {
    'driver_loaded': per_event,
    'driver_latency_loaded': latency,
    'driver_loaded_lanes': float(len(lanes)),
  }


def _driver_figures(
  executor,
  *,
  lanes: Sequence[str],
  tasks: int,
  ahead: bool = False,
  name: str = 'add_one',
  warmup: int = 10,
) -> tuple[float, float]:
  """`(CPU seconds of this thread per event, driver latency)` of `executor` running one
  chain of `tasks` named tasks `name` per lane of `lanes` (`_run_chains`; `ahead=False`:
  each waited for): two events per task, its dispatch and its end heard; the latency is
  the median time from a task's end to the driver hearing of it, less the CPU per event
  (at least 0), the first `1 / warmup` of each chain's hear delays left out (warm-up)."""
  cpu = time.thread_time()
  records = _run_chains(executor, lanes=lanes, tasks=tasks, ahead=ahead, name=name).records
  cpu = time.thread_time() - cpu
  per_event = cpu / (2 * len(records))
  heard = []
  for lane in {r.lane for r in records}:
    chain = sorted((r for r in records if r.lane == lane), key=lambda r: r.start)
    heard += [r.heard - r.end for r in chain[len(chain) // warmup :]]
  return per_event, max(float(np.median(heard)) - per_event, 0.0)


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


def measure_process_links(
  *,
  cores: Sequence[int] = (0, 1),
  address: str | None = None,
  sizes: Sequence[int] = (1 << 16, 1 << 24),
  reps: int = 21,
  warmup: int = 3,
) -> tuple[float, float]:
  """`(latency s, bandwidth B/s)` of a move between two lane processes (`LanePool.move`,
  Ray's object store), pinned to `cores[0]` and `cores[1]`: for each size, `reps` pairs
  of calls, one of a task on the second lane that needs a new value of that size moved
  there from the first, and one of the same task on an array already there, alternated
  (and the sizes interleaved); the median over the pairs of their difference; then the
  line through the two sizes (`link_line`).

  A new value every pair, because every message of a run is one (a gradient, an
  activation, the parameters after an update): its export writes a new object and its
  import makes a new array, whose memory this VM serves at its first-touch price. Moving
  one value again and again, as this did until 2026-11-28, measured a path the runs never
  take and ran in spells (60 moves of 16 MB in a row: 25 at ~18 ms, 25 at ~4.5 ms, then
  ~55 ms), so the fitted bandwidth moved from 0.32 to 8.2 GB/s between measurements; a
  new value each time gave 1.44-1.53 ms + 0.97-1.02 GB/s in three fresh clusters, and
  the lanes' runs agree with it (docs/simulator.md, "What a link costs a run").
  Paired and a median, because the difference of two minima moved by half from one
  measurement to the next here: the minimum of a difference is not the difference of
  the minima."""
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool  # Ray only when asked for
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  first = Task(TaskRecipe.of(dispatch_tasks), 'first')
  placement = LanePlacement.parse(f'source@cores={cores[0]}; target@cores={cores[1]}')
  with LanePool(placement, address=address, verbose=False) as pool:

    def timed(value) -> float:
      start = time.perf_counter()
      pool.run('target', first, (value,))
      return time.perf_counter() - start

    def new_value(size: int, tag: int):  # put on the source lane, outside the timing
      return pool.put('source', np.full(size // 4, tag, np.float32))

    there = [pool.move(new_value(size, -1), 'target') for size in sizes]
    for size, local in zip(sizes, there):
      for tag in range(warmup):  # warm: compiled, the first copies taken in
        timed(new_value(size, tag)), timed(local)
    # The sizes interleaved, pair by pair: a slow spell of the machine slows both sizes'
    # pairs, not one size's (which tilts the line: one run gave 9.4 GB/s, others 1.6-1.7).
    differences = [[] for _ in sizes]
    for tag in range(reps):
      for size, local, measured in zip(sizes, there, differences):
        moved = new_value(size, tag)
        seconds = timed(moved)
        del moved
        pool.held('target')  # its copy freed there now, not inside the next timed call
        measured.append(seconds - timed(local))
  return link_line(sizes, [float(np.median(d)) for d in differences])


def link_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
  """`(latency s, bandwidth B/s)` of the line through two sizes' move times (a negative
  time counts as 0): bandwidth `(n2 - n1) / (t2 - t1)` (infinite if the larger size was
  not slower), latency `t1 - n1 / bandwidth` (at least 0)."""
  (n1, n2), (t1, t2) = sizes, [max(t, 0.0) for t in seconds]
  bandwidth = (n2 - n1) / (t2 - t1) if t2 > t1 else math.inf
  return max(t1 - n1 / bandwidth, 0.0), bandwidth


def dispatch_of(profile: Profile, executor: str, source: str = 'profile') -> float:
  """Seconds of host overhead per task of `executor` measured in `profile`
  (`cost.dispatch`); refuses a profile without that figure, naming what it has."""
  if executor not in profile.dispatch or executor == 'jax_call':
    have = ', '.join(k for k in profile.dispatch if k != 'jax_call') or 'none'
    raise ProfileError(
      f'cost.dispatch: the profile {source!r} has no dispatch overhead for {executor!r} '
      f'(it has: {have}); measure one with python -m experiments.profile'
      + (' --dispatch_processes.' if executor.startswith('processes') else '.')
    )
  return float(profile.dispatch[executor])


def driver_of(profile: Profile, which: str, source: str = 'profile') -> tuple[float, float]:
  """`(driver, driver_latency)` seconds measured in `profile` (`cost.driver_from`:
  `which` is a key of `DRIVER_FIGURES`); refuses a profile without them, saying how to
  measure them."""
  keys = DRIVER_FIGURES[which]
  missing = [key for key in keys if key not in profile.dispatch]
  if missing:
    raise ProfileError(
      f'cost.driver_from: the profile {source!r} has no {" or ".join(missing)} '
      f'(measure them with python -m experiments.profile {DRIVER_FLAGS[which]}).'
    )
  # (`load` refuses a dispatch figure that is not a finite number of seconds >= 0.)
  return float(profile.dispatch[keys[0]]), float(profile.dispatch[keys[1]])


# --- reading, writing, matching ------------------------------------------------------------
def to_json(profile: Profile) -> dict:
  return {
    'format': FORMAT,
    'model': dict(profile.model),
    'batch_size': profile.batch_size,
    'optimizer': profile.optimizer,
    'device_kind': profile.device_kind,
    'platform': profile.platform,
    'jax_version': profile.jax_version,
    'date': profile.date,
    'statistic': profile.statistic,
    'clock': profile.clock,
    'pinned': profile.pinned,
    'warmup': profile.warmup,
    'reps': profile.reps,
    'dispatch': dict(profile.dispatch),
    'tables': [
      {
        'split': [list(r) for r in t.split],
        'tasks': t.tasks,
        'costs': {_key_str(k): v for k, v in t.costs.items()},
        'spread': {_key_str(k): dict(v) for k, v in t.spread.items()},
      }
      for t in profile.tables
    ],
  }


def save(profile: Profile, path: str) -> None:
  """Writes `profile` as JSON (atomically: a reader never sees half a file)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  partial = f'{path}.tmp{os.getpid()}'
  with open(partial, 'w') as f:
    json.dump(to_json(profile), f, indent=1, sort_keys=True)
    f.write('\n')
  os.replace(partial, path)


def load(path: str) -> Profile:
  """Reads and checks a profile; a bad file raises `ProfileError` naming the field."""
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    raise ProfileError(f'cost.profile: cannot read {path!r}: {e.strerror}.') from None
  except json.JSONDecodeError as e:
    raise ProfileError(f'cost.profile: {path!r} is not JSON ({e.msg}, line {e.lineno}).') from None
  return from_json(data, source=path)


def from_json(data: Any, source: str = 'profile') -> Profile:
  """A `Profile` from the JSON object `to_json` writes, checked field by field."""
  where = f'cost.profile {source!r}'
  if not isinstance(data, dict):
    raise ProfileError(f'{where}: expected a JSON object, got {type(data).__name__}.')
  if data.get('format') != FORMAT:
    raise ProfileError(f'{where}: field "format" must be {FORMAT!r}, got {data.get("format")!r}.')
  missing = [f for f in _FIELDS if f not in data]
  if missing:
    raise ProfileError(f'{where}: missing field(s) {", ".join(missing)}.')
  unknown = sorted(set(data) - set(_FIELDS))
  if unknown:
    raise ProfileError(
      f'{where}: unknown field(s) {", ".join(unknown)}; allowed: {", ".join(_FIELDS)}.'
    )
  model = data['model']
  if not isinstance(model, dict) or sorted(model) != sorted(_MODEL_FIELDS):
    raise ProfileError(
      f'{where}: field "model" must have exactly the keys '
      f'{", ".join(_MODEL_FIELDS)}, got {model!r}.'
    )
  for field in ('batch_size', 'warmup', 'reps'):
    _check_int(data[field], field, where)
  for field in ('optimizer', 'device_kind', 'platform', 'jax_version', 'date', 'statistic'):
    if not isinstance(data[field], str):
      raise ProfileError(f'{where}: field "{field}" must be a string, got {data[field]!r}.')
  if data['clock'] not in CLOCKS:
    raise ProfileError(
      f'{where}: field "clock" must be one of {", ".join(CLOCKS)}, got {data["clock"]!r}.'
    )
  if not isinstance(data['pinned'], bool):
    raise ProfileError(f'{where}: field "pinned" must be true or false, got {data["pinned"]!r}.')
  dispatch = data['dispatch']
  if not isinstance(dispatch, dict):
    raise ProfileError(f'{where}: field "dispatch" must be an object, got {dispatch!r}.')
  for name, seconds in dispatch.items():
    _check_seconds(seconds, f'dispatch.{name}', where)
  if not isinstance(data['tables'], list) or not data['tables']:
    raise ProfileError(f'{where}: field "tables" must be a non-empty list.')
  tables = tuple(_table(t, i, where) for i, t in enumerate(data['tables']))
  return Profile(
    model=dict(model),
    batch_size=data['batch_size'],
    optimizer=data['optimizer'],
    device_kind=data['device_kind'],
    platform=data['platform'],
    jax_version=data['jax_version'],
    date=data['date'],
    statistic=data['statistic'],
    clock=data['clock'],
    pinned=data['pinned'],
    warmup=data['warmup'],
    reps=data['reps'],
    dispatch={k: float(v) for k, v in dispatch.items()},
    tables=tables,
  )


def check_matches(
  profile: Profile, *, model, batch_size: int, optimizer: str | None = None, source: str = 'profile'
) -> None:
  """Refuses a profile of another model, batch size or optimizer (one line, the field).

  `model`: a `StagedModel` or its `model_id`; `optimizer`: `optimizer_id(config.optimizer)`
  (None: not checked).
  """
  expected = model if isinstance(model, Mapping) else model_id(model)
  for field in _MODEL_FIELDS:
    if profile.model[field] != expected[field]:
      raise ProfileError(
        f'cost.profile {source!r}: model.{field} is '
        f'{profile.model[field]!r} in the profile but {expected[field]!r} '
        f'in this run; measure a profile for this model.'
      )
  if profile.batch_size != batch_size:
    raise ProfileError(
      f'cost.profile {source!r}: batch_size is {profile.batch_size} in the '
      f'profile but {batch_size} in this run; measure one for this batch.'
    )
  if optimizer is not None and profile.optimizer != optimizer:
    raise ProfileError(
      f'cost.profile {source!r}: optimizer is {profile.optimizer!r} in the '
      f'profile but {optimizer!r} in this run (the update task differs); '
      f'measure one for this optimizer.'
    )


def costs_for(
  profile: Profile,
  *,
  model,
  batch_size: int,
  split,
  tasks: str,
  optimizer: str | None = None,
  source: str = 'profile',
  statistic: str = STATISTIC,
) -> dict:
  """The cost table (keys as `CostModel.compute`) of a run, refusing any mismatch;
  `statistic` picks the figure of each task's repetitions (`Table.figures`)."""
  check_matches(profile, model=model, batch_size=batch_size, optimizer=optimizer, source=source)
  try:
    return profile.table(split, tasks).figures(statistic)
  except ProfileError as e:
    raise ProfileError(str(e).replace('cost.profile:', f'cost.profile {source!r}:', 1)) from None


def cost_model(
  profile: Profile,
  *,
  model,
  batch_size: int,
  split,
  tasks: str,
  optimizer: str | None = None,
  source: str = 'profile',
  **cost_model_fields,
) -> CostModel:
  """`CostModel(costs_for(...), **cost_model_fields)` (links, speeds, stragglers)."""
  return CostModel(
    costs_for(
      profile,
      model=model,
      batch_size=batch_size,
      split=split,
      tasks=tasks,
      optimizer=optimizer,
      source=source,
    ),
    **cost_model_fields,
  )


def merge(old: Profile, new: Profile) -> Profile:
  """`new`'s tables added to `old`'s (replacing a table of the same split and tasks).

  Both must describe the same model, batch size, optimizer and device kind and be
  measured the same way (statistic, clock, pinning); the result has `new`'s date,
  jax version, and its dispatch figures added to (or replacing) `old`'s.
  """
  for field in (
    'model',
    'batch_size',
    'optimizer',
    'device_kind',
    'platform',
    'statistic',
    'clock',
    'pinned',
  ):
    if getattr(old, field) != getattr(new, field):
      raise ProfileError(
        f'cost.profile: cannot add to a profile of another {field} '
        f'({getattr(old, field)!r} there, {getattr(new, field)!r} here).'
      )
  replaced = {(t.split, t.tasks) for t in new.tables}
  kept = tuple(t for t in old.tables if (t.split, t.tasks) not in replaced)
  return dataclasses.replace(
    new, tables=kept + tuple(new.tables), dispatch={**old.dispatch, **new.dispatch}
  )


# --- calibrating from a real run --------------------------------------------------------
def trace_durations(path: str, skip: int) -> dict[tuple[Any, str], list[float]]:
  """Seconds of every compute task of a run's trace (`trace.json`, as
  `Timeline.write_chrome_trace` writes it), by `(stage, kind)`, leaving out each lane's
  first `skip` tasks in time order (compiling, warming up) and the transfers of link
  lanes."""
  if skip < 0:
    raise ProfileError(f'skip: tasks left out per lane, >= 0; got {skip}.')
  try:
    with open(path) as f:
      events = json.load(f)['traceEvents']
    names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
    tasks = sorted(
      (
        (e['ts'], e['tid'], (e['args'].get('stage'), e['cat']), e['dur'] / 1e6)
        for e in events
        if e.get('ph') == 'X'
      ),
      key=lambda task: (task[0], repr(task[1])),
    )
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ProfileError(f'trace {path!r}: not a trace.json of a run ({e!r}).') from None
  seen: dict[Any, int] = {}
  durations: dict[tuple[Any, str], list[float]] = {}
  for _, lane, key, seconds in tasks:
    if names.get(lane, '').startswith('link '):
      continue
    seen[lane] = seen.get(lane, 0) + 1
    if seen[lane] > skip:
      durations.setdefault(key, []).append(seconds)
  return durations


def calibrate(profile: Profile, durations: Mapping[tuple[Any, str], Sequence[float]]) -> Profile:
  """`profile` (one table) with each task's cost the median of its durations in a real
  run (`trace_durations`): every figure (`costs`, `median`, `p90`) that median, what
  the run's tasks took as they ran there, load and neighbours included. A task the run
  did not time keeps its measured cost; a `kind` key (the stages without a key of
  their own) takes the median over those stages' tasks of that kind. Its `statistic`
  says so (`CALIBRATED`), so that `merge` refuses to mix it with measured tables.

  The virtual clock given it replays the run's task costs: the idea of
  `benchmarks/simulator_accuracy.py`'s "calibrated" column (docs/simulator.md). Speed
  factors the simulation applies to lanes (`cost.device_speeds`, `cost.worker_speeds`,
  LPP-SGD's workers sharing a device) scale these costs again, and an in-process run's
  folded backward-and-update of PD-ASGD and LPP-SGD is timed as one backward.
  """
  if len(profile.tables) != 1:
    have = '; '.join(f'split={list(map(list, t.split))} tasks={t.tasks!r}' for t in profile.tables)
    raise ProfileError(
      f"cost.profile: calibrating needs a profile of one table (the run's); this one "
      f"has {len(profile.tables)}: {have}. Measure one for the run's config."
    )
  (table,) = profile.tables
  if not any(timed_durations(table, key, durations) for key in table.costs):
    raise ProfileError(
      f"cost.profile: the run timed none of the profile's tasks "
      f'({", ".join(map(_key_str, table.costs))}); it timed '
      f'{", ".join(sorted(map(_key_str, durations))) or "none (skip larger than its lanes ran?)"}.'
    )
  calibrated = calibrated_table(table, durations)
  return dataclasses.replace(
    profile,
    tables=(calibrated,),
    statistic=CALIBRATED,  # so that `merge` never mixes it with measured tables
    clock='wall',
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
  )


def timed_durations(table: Table, key, durations: Mapping[tuple[Any, str], Sequence[float]]):
  """The durations (`trace_durations`) that task `key` of `table` costs: its own, or for a
  `kind` key those of the stages without a key of their own (`CostModel.compute` looks
  those up first)."""
  if isinstance(key, tuple):
    return list(durations.get(key, ()))
  return [
    d
    for (stage, kind), ds in durations.items()
    if kind == key and (stage, kind) not in table.costs
    for d in ds
  ]


def calibrated_table(table: Table, durations: Mapping[tuple[Any, str], Sequence[float]]) -> Table:
  """`table` with every task the durations time costing their median (every figure:
  `costs`, `median`, `p90`); the others keep their cost (`calibrate`)."""
  costs = {}
  for key, seconds in table.costs.items():
    found = timed_durations(table, key, durations)
    costs[key] = float(np.median(found)) if found else seconds
  spread = {k: dict.fromkeys(SPREAD_STATISTICS, v) for k, v in costs.items()}
  return dataclasses.replace(table, costs=costs, spread=spread)


def pilot_config(run: str) -> dict:
  """The config of the run at `run` (its summary.json)."""
  try:
    with open(os.path.join(run, 'summary.json')) as f:
      return json.load(f)['config']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ProfileError(f'--run: {run} has no summary.json of a run ({e!r}).') from None


def check_pilot(config: dict, profile: Profile) -> None:
  """Refuses a run (its config, `pilot_config`) that cannot calibrate `profile`, in one
  line naming the field: not on the real clock, another model or batch size, or lanes
  whose simulated speed the virtual clock scales again (LPP-SGD's workers sharing a
  device); warns of an in-process pilot."""
  if config.get('clock') != 'real':
    raise ProfileError(
      f'--run: a run on the {config.get("clock")!r} clock; a pilot runs on the real clock '
      '(--config.clock=real --config.executor=processes).'
    )
  model, batch = config.get('model', {}).get('name'), config.get('batch_size')
  if model != profile.model['name'] or batch != profile.batch_size:
    raise ProfileError(
      f'--run: model {model!r}, batch {batch}; the profile is of model '
      f'{profile.model["name"]!r}, batch {profile.batch_size}.'
    )
  algorithm = config.get('algorithm', {})
  if algorithm.get('name') == 'lppsgd' and algorithm.get('workers_per_device', 1) > 1:
    raise ProfileError(
      '--run: LPP-SGD with algorithm.workers_per_device > 1: the virtual clock divides '
      "those workers' speed by it, and the pilot's durations already carry that sharing; "
      'calibrate from a run with one worker per device.'
    )
  if config.get('executor') != 'processes':
    logging.warning(
      'an in-process pilot: its durations are task costs only with a device per lane (on '
      'one CPU device they are not; docs/simulator.md).'
    )


# --- helpers --------------------------------------------------------------------------------
def _key_str(key) -> str:
  if isinstance(key, tuple):
    stage, kind = key
    return f'{stage}/{kind}'
  return str(key)


def _key(text: str, where: str):
  if '/' not in text:
    return text
  stage, kind = text.split('/', 1)
  if not stage.isdigit() or not kind:
    raise ProfileError(f'{where}: cost key {text!r} must be "stage/kind" or "kind".')
  return int(stage), kind


def _split(split) -> tuple[tuple[int, int], ...]:
  return tuple((int(a), int(b)) for a, b in split)


def _table(data, index: int, where: str) -> Table:
  field = f'tables[{index}]'
  if not isinstance(data, dict) or not {'split', 'tasks', 'costs'} <= set(data):
    raise ProfileError(f'{where}: field "{field}" must have split, tasks and costs.')
  split = data['split']
  if (
    not isinstance(split, list)
    or not split
    or any(
      not isinstance(r, list)
      or len(r) != 2
      or not all(isinstance(i, int) for i in r)
      or not 0 <= r[0] < r[1]
      for r in split
    )
  ):
    raise ProfileError(
      f'{where}: field "{field}.split" must be a list of [start, end) layer ranges, got {split!r}.'
    )
  if not isinstance(data['tasks'], str):
    raise ProfileError(f'{where}: field "{field}.tasks" must be a string.')
  if not isinstance(data['costs'], dict) or not data['costs']:
    raise ProfileError(f'{where}: field "{field}.costs" must be a non-empty object.')
  costs = {}
  for text, seconds in data['costs'].items():
    _check_seconds(seconds, f'{field}.costs.{text}', where)
    costs[_key(text, where)] = float(seconds)
  spread = {
    _key(text, where): {k: float(v) for k, v in value.items()}
    for text, value in (data.get('spread') or {}).items()
  }
  return Table(_split(split), data['tasks'], costs, spread)


def _check_int(value, field: str, where: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ProfileError(f'{where}: field "{field}" must be a positive integer, got {value!r}.')


def _check_seconds(value, field: str, where: str) -> None:
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not value >= 0
    or math.isinf(value)
  ):
    raise ProfileError(
      f'{where}: field "{field}" must be a finite number of seconds >= 0, got {value!r}.'
    )
