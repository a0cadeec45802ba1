r"""Measures a cost profile for a config (every task it runs, timed once, carefully), or
an executor's host profile.

    python -m experiments.profile --host=processes --out=host.json      # cost.host=host.json

    python -m experiments.profile --config=experiments/configs/ddg.py --out=profiles/ddg.json
    python -m experiments.profile --config=experiments/configs/ddg.py:smoke \
        --config.stages=2 --out=/tmp/ddg2.json --reps=50
    python -m experiments.profile --suite=ddg --out=experiments/results/profile_cnn_adam.json

Writes (or adds a table to) a JSON profile (`jaxsgd.scheduler.profiles`): the
seconds of each stage's forward, backward and update for the config's model,
batch size, stage split and algorithm, the in-process executors' dispatch overhead
(for information: the virtual clock takes an executor's host from a host profile,
`--host`), and the device, jax version and date. Each task: 3 untimed calls, then
`--reps` interleaved wall-clock calls, their median counting, on every core (as
`cost.calibrate` measures them, so the costs are comparable with the kept ones);
`--pin_core` and `--clock=cpu` measure one core by its CPU time instead (see
`jaxsgd.scheduler.task_timing` for how repeatable each is here). The process's
allocator is set as a lane process sets its own (`jaxsgd.allocator`), so that a task's
outputs land in memory used before rather than in fresh pages that fault at every call.
Measure on a quiet machine: the file is then reused as is. An
existing file of the same model, batch size, optimizer and device gets this
config's table added (one profile can serve a whole suite); `--replace` starts a
new file instead. The dispatch overhead is measured once per command.

`--suite=NAME` (instead of `--config`) measures the table of every method of a
comparison suite (`experiments/suites.py`) that takes its costs from a profile (virtual
clock, `cost.calibrate`), together (each round times every task of every table once, so
that the machine's speed at the time prices every method alike), into one file:
`experiments.compare --profile=` then runs the whole suite on it. Its methods must share
the model, batch size and optimizer (checked before anything is timed).

Covers every family: the scheduler algorithms (bp, ddg, local, asgd, dcasgd,
lppsgd, pdasgd: each stage's forward, backward and update; the server's update)
and the data-parallel ones (ssgd, local_sgd, dasgd, diloco: one worker's step,
`(0, 'step')`, at the per-worker batch size; one table serves all four).
"""

import contextlib
import functools
import os
import types
from typing import NamedTuple

import jax

from absl import app
from absl import flags
from ml_collections import config_flags

from jaxsgd import algorithms, allocator
from jaxsgd import data as data_lib
from jaxsgd import optimizers
from jaxsgd.algorithms import ddg
from jaxsgd.algorithms import local
from jaxsgd.pipeline import PlacedStages, sequential_roles
from jaxsgd.scheduler import (
  Placement,
  lane_timing,
  link_timing,
  profile_lookup,
  profiles,
  task_timing,
)
from jaxsgd.scheduler import host as host_lib
from jaxsgd.training.loop import build_model

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'An ml_collections config file.', lock_config=True
)
_OUT = flags.DEFINE_string('out', None, 'The profile file (JSON) to write or add to.')
_REPS = flags.DEFINE_integer('reps', 30, 'Timed calls of each task (their median counts).')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed calls of each task first.')
_REPLACE = flags.DEFINE_bool('replace', False, 'Overwrite --out instead of adding to it.')
_CLOCK = flags.DEFINE_enum(
  'clock',
  'wall',
  list(task_timing.CLOCKS),
  'wall: wall time of each call; cpu: the process CPU time.',
)
_PIN_CORE = flags.DEFINE_integer(
  'pin_core',
  -1,
  'Run on this CPU core only (-1: do not pin; the costs are then those of one core).',
)
_BUSY_CORES = flags.DEFINE_integer(
  'busy_cores',
  0,
  'Other cores of this host kept computing (matrix products, a process each) while the '
  'tasks are timed on --pin_core: a core runs slower beside busy neighbours (shared cache '
  'and memory bus, a lower all-core clock), so a profile for lanes that fill K cores is '
  'measured with K-1. Recorded in the profile.',
)
_SUITE = flags.DEFINE_string(
  'suite', None, 'Instead of --config: every profiled method of this comparison suite.'
)
_HOST = flags.DEFINE_enum(
  'host',
  None,
  list(host_lib.EXECUTORS),
  "Instead of --config: measure this executor's host profile (cost.host) and write it "
  'to --out: its dispatch per task; for processes also its driver, its moves between lane '
  'processes and the same with a busy lane on every core (starts a Ray cluster; ~1 min).',
)
_HOST_REPEATS = flags.DEFINE_integer(
  'host_repeats',
  lane_timing.DRIVER_REPEATS,
  '--host=processes: chains of each dispatch and driver measurement (their median counts); '
  'fewer: a quicker, noisier profile.',
)
flags.mark_flags_as_required(['out'])

PIPELINE_ALGORITHMS = ('bp', 'ddg', 'local', 'pdasgd', 'lppsgd')
SERVER_ALGORITHMS = ('asgd', 'dcasgd')
DATA_PARALLEL_ALGORITHMS = ('ssgd', 'local_sgd', 'dasgd', 'diloco')


def roles_of(name: str, settings):
  """The stage roles whose computations the algorithm `name` runs (its `Settings`)."""
  stages = settings.shared.stages
  if name in ('bp', 'pdasgd'):
    return sequential_roles(stages)
  if name == 'ddg':
    return ddg.roles(stages, settings.variant)
  if name == 'local':
    return local.roles(stages, settings.variant, settings.chunks, settings.pipelined)
  return sequential_roles(1)  # Whole-model workers: lppsgd, asgd, dcasgd.


class TableCalls(NamedTuple):
  """What one table of a config times: its task calls, the stage split, the task set
  (`profile_lookup`) and the batch size it is for."""

  calls: dict
  split: tuple
  tasks: str
  batch_size: int


def table_calls(config, model, batch_for) -> TableCalls:
  """The config's tasks on the first device, for its table.

  `batch_for(n)` returns a host batch of `n` examples. Pipeline and server
  algorithms: every task of their stages at `batch_size`; data-parallel ones: one
  worker's step (forward, backward, inner update; the same computation for all
  four, their communication is modelled apart) at the per-worker batch size.
  """
  name = config.algorithm.name
  known = PIPELINE_ALGORITHMS + SERVER_ALGORITHMS + DATA_PARALLEL_ALGORITHMS
  if name not in known:
    raise ValueError(
      f'algorithm.name: {name!r} has no task table to profile; allowed: {", ".join(known)}.'
    )
  settings = algorithms.get(name).validate(config, model)
  if name in DATA_PARALLEL_ALGORITHMS:
    return _worker_step_calls(settings, model, batch_for)
  shared, roles = settings.shared, roles_of(name, settings)
  tx = optimizers.make_optimizer(shared.optimizer, shared.train_steps)
  stages = PlacedStages(
    model,
    len(roles),
    tx,
    placement=Placement.create(len(roles)),
    batch_size=shared.batch_size,
    seed=shared.seed,
    aux_heads=any(r.loss == 'aux' for r in roles),
  )
  calls = stages.task_calls(roles, batch_for(shared.batch_size))
  tasks = profile_lookup.roles_signature(roles)
  if name == 'lppsgd':  # its averaging tasks too, for its lane-process form
    from jaxsgd.asynchronous import lppsgd  # pylint: disable=import-outside-toplevel

    params = stages.initial_variables(shared.seed, roles[0])['params']
    calls.update(lppsgd.averaging_calls(params, settings.devices))
  if name in SERVER_ALGORITHMS:
    from jaxsgd.algorithms import asgd  # pylint: disable=import-outside-toplevel

    _, server, _, _ = asgd.build(types.SimpleNamespace(model=model), shared, settings.server)
    calls[(0, 'update')] = server.sample_update_call()
    tasks = profile_lookup.server_tasks(name)
  return TableCalls(calls, profile_lookup.split_of(stages.stages), tasks, shared.batch_size)


def _worker_step_calls(settings, model, batch_for) -> TableCalls:
  """One data-parallel worker's step, as `cost.calibrate` measures it (`data_parallel`)."""
  from jaxsgd.spmd import step as step_lib  # pylint: disable=import-outside-toplevel

  shared = settings.shared
  inner = optimizers.make_optimizer(shared.optimizer, shared.train_steps)
  one_step = jax.jit(step_lib.make_worker_step(model, inner, average_grads=False))
  variables = model.init(jax.random.key(shared.seed))
  opt_state = jax.jit(inner.init)(variables['params'])
  batch = batch_for(settings.batch_size)
  calls = {(0, 'step'): (one_step, (variables, opt_state, batch))}
  return TableCalls(
    calls, ((0, model.num_layers),), profile_lookup.WORKER_STEP, settings.batch_size
  )


def measure_tables(
  entries, *, warmup: int = 3, reps: int = 30, clock: str = 'wall'
) -> list[profiles.Table]:
  """The table of each `TableCalls` of `entries`, measured together, interleaved
  (`task_timing.measure_tables`): a suite's tables are priced at one speed of the machine."""
  task_sets = [(entry.calls, entry.split, entry.tasks) for entry in entries]
  return task_timing.measure_tables(task_sets, warmup=warmup, reps=reps, clock=clock)


def measure_table(
  config, model, batch_for, *, warmup: int = 3, reps: int = 30, clock: str = 'wall'
) -> tuple[profiles.Table, int]:
  """(the config's task table measured on the first device, the batch size it is for):
  `table_calls`, timed."""
  entry = table_calls(config, model, batch_for)
  [table] = measure_tables([entry], warmup=warmup, reps=reps, clock=clock)
  return table, entry.batch_size


def suite_configs(name: str) -> list:
  """(label, config) of each method of suite `name` that takes its costs from a profile."""
  from experiments import suites  # pylint: disable=import-outside-toplevel

  if name not in suites.SUITES:
    raise SystemExit(f'--suite: {name!r} is not a suite; allowed: {", ".join(suites.SUITES)}.')
  suite = suites.SUITES[name]
  configs = []
  for method in suite.methods:
    config = suites.method_config(method, suite.seeds[0], suite.target_accuracy, smoke=False)
    if config.clock == 'virtual' and config.cost.calibrate:
      configs.append((method.label, config))
  if not configs:
    raise SystemExit(f'--suite: no method of {name} takes its costs from a profile.')
  return configs


def measure_host(executor: str, repeats: int = lane_timing.DRIVER_REPEATS) -> host_lib.HostProfile:
  """`executor`'s host profile on this machine (`jaxsgd.scheduler.host`): the in-process
  executors' dispatch per task; the process executor's dispatch (a lane's time between two
  queued calls after tasks of a run's length; the CPU of all the run's processes per task,
  what a lane loses where the lanes take every core), its driver's figures with an idle
  lane and with a busy lane on every core this process may use, the CPU its processes
  take with no task (those lanes waiting: `upkeep`), and a move of a new
  value between two lane processes, its link and the receiving lane's taking it in (each
  the line through 64 KiB and 16 MiB, and what each further array of a 64-array message
  adds). `repeats`: chains of each dispatch and driver measurement (their median counts)."""
  cores = sorted(os.sched_getaffinity(0))
  if executor != 'processes':
    dispatch = lane_timing.measure_dispatch()
    figures = {'dispatch': dispatch['real' if executor == 'in_process' else 'real_threads']}
    return host_lib.make(executor, figures, cores=len(cores))
  from jaxsgd.scheduler.lanes import cluster  # Ray only for this executor

  # One cluster of its own for the three (each would start and stop one: seconds each);
  # its processes are this one's descendants, whose CPU the figures count.
  started = cluster.connect(None)
  try:
    idle = lane_timing.measure_process_dispatch(cores=cores[:1], rounds=repeats)
    loaded = lane_timing.measure_loaded_driver(cores=cores, repeats=repeats)
    moves = link_timing.measure_process_links(cores=(cores[0], cores[-1]))
  finally:
    if started:
      cluster.shutdown()
  figures = {
    'dispatch': idle['processes'],
    'dispatch_loaded': idle['processes_cpu'],
    'driver': idle['driver'],
    'driver_latency': idle['driver_latency'],
    'driver_loaded': loaded['driver_loaded'],
    'driver_latency_loaded': loaded['driver_latency_loaded'],
    'upkeep': loaded['upkeep'],
    **{f'link_{name}': value for name, value in zip(host_lib.MOVE_FIGURES, moves.link)},
    **{f'take_in_{name}': value for name, value in zip(host_lib.MOVE_FIGURES, moves.take_in)},
    **{f'export_{name}': value for name, value in zip(host_lib.MOVE_FIGURES, moves.export)},
  }
  path = 'host' if moves.shared else 'socket'  # (the host path within a host shares memory)
  return host_lib.make(executor, figures, cores=len(cores), moves=path)


def write_host(executor: str, out: str) -> None:
  if os.path.exists(out) and not _REPLACE.value:
    raise SystemExit(f'--out: {out!r} exists; --replace overwrites it.')
  measured = measure_host(executor, _HOST_REPEATS.value)
  host_lib.save(measured, out)
  figures = ', '.join(f'{name} {value:.3g}' for name, value in measured.figures)
  print(f'wrote {out}: host profile of {executor} on {measured.cores} cores: {figures}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _HOST.value is not None:
    if _CONFIG.value is not None or _SUITE.value is not None:
      raise SystemExit('--host: measures an executor, not a config; drop --config/--suite.')
    if _HOST_REPEATS.value < 1:
      raise SystemExit(
        f'--host_repeats: chains per measurement, at least 1; got {_HOST_REPEATS.value}.'
      )
    return write_host(_HOST.value, _OUT.value)
  if (_CONFIG.value is None) == (_SUITE.value is None):
    raise SystemExit('--config, --suite or --host: give exactly one.')
  configs = suite_configs(_SUITE.value) if _SUITE.value else [('', _CONFIG.value)]
  neighbours = busy_neighbour_cores(_BUSY_CORES.value, _PIN_CORE.value)
  allocator.keep_freed_memory()  # as a lane's: a task's outputs in memory used before
  if _PIN_CORE.value >= 0:
    task_timing.pin_to_core(_PIN_CORE.value)  # Before JAX's first computation.
  workers = max(config.get('workers', 1) for _, config in configs)
  if workers > 1 and 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
    # The settings check wants one device per worker; one worker's tasks are what is
    # timed (on the first device), so fake CPU devices do (ignored on accelerators).
    jax.config.update('jax_num_cpu_devices', workers)
  with contextlib.ExitStack() as busy:
    if neighbours:
      busy.enter_context(task_timing.BusyNeighbours(neighbours))
    measured = _measure(configs)  # one profile holds them all: checked before timing
  profile = functools.reduce(profiles.merge, measured)
  for (label, _), one in zip(configs, measured):
    print((f'{label}:\n' if label else '') + describe(one.tables[0], one.dispatch))
  out = _OUT.value
  if os.path.exists(out) and not _REPLACE.value:
    try:
      profile = profiles.merge(profiles.load(out), profile)
    except profiles.ProfileError as e:
      raise SystemExit(f'{e} (--replace overwrites {out})') from None
  profiles.save(profile, out)
  print(
    f'wrote {out}: {len(profile.tables)} table(s), model {profile.model["name"]}, batch '
    f'{profile.batch_size}, {profile.device_kind}'
  )


def busy_neighbour_cores(count: int, pin_core: int) -> list[int]:
  """The `count` cores this process may use, other than `pin_core`, kept busy while the
  tasks are timed (`--busy_cores`); refused in one line where that cannot be."""
  if count == 0:
    return []
  if count < 0 or pin_core < 0:
    raise SystemExit(
      f'--busy_cores: an integer >= 0 of cores beside the one --pin_core names (which it '
      f'needs), got --busy_cores={count} --pin_core={pin_core}.'
    )
  others = [core for core in sorted(os.sched_getaffinity(0)) if core != pin_core]
  if count > len(others):
    raise SystemExit(
      f'--busy_cores: {count} cores asked for beside core {pin_core}; this process may '
      f'use {len(others)} others ({", ".join(map(str, others)) or "none"}).'
    )
  return others[:count]


def _measure(configs) -> list[profiles.Profile]:
  """A profile of one table for each `(label, config)` of `configs`: its tasks, all the
  configs' measured together (`measure_tables`), and the in-process executors' `dispatch`
  (measured once, after the tables). A bad config, or configs that one profile cannot
  hold (another model, batch size or optimizer), are refused before anything is timed."""
  prepared = []
  for label, config in configs:
    dataset = data_lib.load(config.dataset, config.get('data_dir'))
    model = build_model(config, dataset)

    def batch_for(batch_size, dataset=dataset, config=config):
      return next(dataset.train_batches(batch_size, seed=config.seed))

    try:
      prepared.append((label, config, model, table_calls(config, model, batch_for)))
    except ValueError as e:
      raise SystemExit(str(e)) from None

  def profile_of(config, model, entry, tables, dispatch):
    return task_timing.make_profile(
      model,
      entry.batch_size,
      profile_lookup.optimizer_id(dict(config.optimizer)),
      tables,
      warmup=_WARMUP.value,
      reps=_REPS.value,
      clock=_CLOCK.value,
      pinned=_PIN_CORE.value >= 0,
      dispatch=dispatch,
      busy_cores=_BUSY_CORES.value,
    )

  held = None
  for label, config, model, entry in prepared:  # one profile must hold them all
    shell = profile_of(config, model, entry, [], {})
    try:
      held = shell if held is None else profiles.merge(held, shell)
    except profiles.ProfileError as e:
      raise SystemExit(f'{label}: {e}') from None
  try:
    tables = measure_tables(
      [entry for *_, entry in prepared], warmup=_WARMUP.value, reps=_REPS.value, clock=_CLOCK.value
    )
  except ValueError as e:
    raise SystemExit(str(e)) from None
  dispatch = lane_timing.measure_dispatch()
  return [
    profile_of(config, model, entry, [table], dispatch)
    for (_, config, model, entry), table in zip(prepared, tables)
  ]


def describe(table: profiles.Table, dispatch) -> str:
  """The measured table: stage, kind, minimum, median (the cost) and p90 in ms."""
  lines = [
    f'tasks {table.tasks}, split {list(map(list, table.split))}',
    f'{"stage":>5} {"kind":<9} {"min ms":>9} {"median ms":>10} {"p90 ms":>9}',
  ]
  for key, seconds in table.costs.items():
    stage, kind = key if isinstance(key, tuple) else ('*', key)
    spread = table.spread.get(key, {})
    lines.append(
      f'{stage:>5} {kind:<9} {1e3 * spread.get("min", float("nan")):9.4f} '
      f'{1e3 * seconds:10.4f} '
      f'{1e3 * spread.get("p90", float("nan")):9.4f}'
    )
  lines.append(
    'dispatch overhead per task (µs): '
    + ', '.join(f'{k} {1e6 * v:.1f}' for k, v in dispatch.items())
  )
  return '\n'.join(lines)


if __name__ == '__main__':
  app.run(main)
