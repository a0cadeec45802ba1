"""LPP-SGD, PD-ASGD and models with BatchNorm statistics on lane processes
(`executor='processes'`): the same bits as in one process and on the virtual clock.

Each lane is a process of its own; the replica of LPP-SGD lives in its worker's lane and
PD-ASGD's layers in the shared model's lane, where their updates run as named tasks
(`SharedParams.update_on`). The lanes join a Ray head started with `ray start --head`
(`tests/lanes/ray_head.py`), by address, and none of their processes is left afterwards.
"""

import collections
import os
import sys

import chex
import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'lanes'))
from ray_head import serve_head  # noqa: E402
from test_lanes import _lane_processes, gone, spy_pools  # noqa: E402

from jaxsgd import models, optimizers  # noqa: E402
from jaxsgd.algorithms import ddg  # noqa: E402
from jaxsgd.asynchronous import common, lppsgd, pdasgd, server  # noqa: E402
from jaxsgd.models import stage_functions  # noqa: E402
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles  # noqa: E402
from jaxsgd.scheduler import CostModel, Placement, RealExecutor, VirtualExecutor  # noqa: E402
from jaxsgd.scheduler.core import Compute, Get, Put  # noqa: E402
from jaxsgd.scheduler.lanes import LanePlacement, LanePool  # noqa: E402
from jaxsgd.scheduler.process import ProcessExecutor  # noqa: E402
from jaxsgd.scheduler.tasks import Task  # noqa: E402
from scheduler_helpers import BATCH, batches, mlp, sequential_sgd  # noqa: E402

OPTIMIZER = optimizers.OptimizerSettings('adam', 1e-2)
STEPS = 4
# The virtual clock's costs: F = 1, B = 2, U = 1/8 s (ASGD's server update is a task), a
# free average; binary-exact, so simulated times tie exactly.
COSTS = {'forward': 1.0, 'backward': 2.0, 'update': 0.125, 'average': 0.0}
LANES = ['sharedmodel', 'forwardworker0', 'backwardworker0', 'backwardworker1']
LANES += ['worker0.0', 'worker1.0', 'allreduce', 'stage0', 'stage1', 'server', 'worker0']


@pytest.fixture(scope='module')
def head(tmp_path_factory):
  yield from serve_head(str(tmp_path_factory.mktemp('ray')))


@pytest.fixture(scope='module')
def pool(head):
  with LanePool(LanePlacement.spread(LANES), address=head.address) as lanes:
    yield lanes
  assert gone(lanes.pids().values()) == []


def virtual(num_stages: int = 1) -> VirtualExecutor:
  table = {(k, kind): v for kind, v in COSTS.items() for k in range(num_stages)}
  return VirtualExecutor(CostModel(table))


def on_processes(executor) -> bool:
  return isinstance(executor, ProcessExecutor)


def placed(model, num_stages: int, steps: int = STEPS) -> PlacedStages:
  """`model` cut into `num_stages` on one device, every op a named task (Adam)."""
  return PlacedStages(
    model,
    num_stages,
    optimizers.make_optimizer(OPTIMIZER, steps),
    placement=Placement.create(num_stages, jax.devices()[:1] * num_stages),
    batch_size=BATCH,
    seed=0,
    optimizer=(OPTIMIZER, steps),
  )


def run(session, executor):
  """Runs `session`; its variables and every store's value, fetched to the driver."""
  session.fetch = executor.fetch
  try:
    executor.run(session.cluster, session.processes())
    return session.variables(), executor.fetch([tuple(s.read().value) for s in stores(session)])
  finally:
    executor.close()


def stores(session):
  shared = session.layers if hasattr(session, 'layers') else session.replicas
  return [store.store for store in shared]


def adam_count(opt_state) -> int:
  """The update count of Adam's state (`make_optimizer`: Adam, then the schedule)."""
  return int(opt_state[0][0].count)


def sequential_adam(pipe: PlacedStages, stream, steps: int):
  """The reference, `[(params, opt_state)]` per stage: sequential SGD with Adam."""
  return list(zip(*sequential_sgd(pipe, stream, steps)))


def spy_tasks(pool, monkeypatch) -> tuple[dict, dict]:
  """`(prepared, started)`: lane -> the tasks `pool.prepare` was given for it, and those
  `pool.start` ran on it, as the pool is used from now on."""
  prepared, started = collections.defaultdict(set), collections.defaultdict(set)
  prepare, start = pool.prepare, pool.start

  def spied_prepare(lane, tasks):
    prepared[lane].update(tasks)
    return prepare(lane, tasks)

  def spied_start(lane, task, *args, **kw):
    started[lane].add(task)
    return start(lane, task, *args, **kw)

  monkeypatch.setattr(pool, 'prepare', spied_prepare)
  monkeypatch.setattr(pool, 'start', spied_start)
  return prepared, started


# --- PD-ASGD -------------------------------------------------------------------------------
def pd(executor, updates: str, pipe: PlacedStages):
  """PD-ASGD, 1 forward : 1 backward worker, one token; `executor` runs it."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=1, updates=updates, max_inflight=1)
  names = [pdasgd.worker_name(settings, w) for w in range(2)]
  session = pdasgd.PdSession(
    pipe,
    settings,
    [batches(seed=0)],
    [jax.devices()[0]] * 3,
    common.StepCounter(STEPS),
    common.WorkerLog(names, {}, executor.now),
    lane_processes=on_processes(executor),
  )
  variables, values = run(session, executor)
  return variables, values, [s.staleness().tolist() for s in stores(session)]


@pytest.mark.parametrize('updates', ['layer', 'block'])
def test_pdasgd_one_forward_one_backward_on_lane_processes_is_sequential_sgd(
  pool, updates, monkeypatch
):
  """The sequential configuration of PD-ASGD is one forward and one backward worker with
  one token (`max_inflight=1`), not 1:1 alone: with the default bound (2 tokens) the
  forward of batch t + 1 overlaps the backward of batch t and reads layers it has not
  updated yet. With one token the forward of t + 1 waits for the token that the
  backward of t returns after its last update, so every forward reads every layer as
  the previous batch left it: sequential SGD, with layer-wise and with block updates.
  On lane processes the layers live in `sharedmodel` and their updates run there."""
  pipe = placed(mlp(), 3)
  prepared, started = spy_tasks(pool, monkeypatch)
  _, values, staleness = pd(ProcessExecutor(pool=pool), updates, pipe)
  # Each lane was sent, to build as the run began, the tasks it then ran (and no other).
  assert prepared == started and len(prepared) == 3
  chex.assert_trees_all_equal(values, sequential_adam(pipe, batches(seed=0), STEPS))
  assert staleness == [[0] * STEPS] * 3
  for executor in (RealExecutor(threads=True), virtual(3)):
    _, in_process, _ = pd(executor, updates, pipe)
    chex.assert_trees_all_equal(values, in_process)
  assert pool.held('sharedmodel') == pool.held('backwardworker0') == 0  # nothing left


def test_pdasgd_concurrent_updates_on_lane_processes_are_never_lost(pool):
  """Two backward workers update the layers in the shared model's lane as they finish;
  each update takes the layer's turn, so Adam counts every one (a lost update — two
  read-modify-writes from one version — would leave the count behind the writes)."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=2, updates='layer')
  executor = ProcessExecutor(pool=pool)
  session = pdasgd.PdSession(
    placed(mlp(), 3, steps=8),
    settings,
    [batches(seed=0)],
    [jax.devices()[0]] * 4,
    common.StepCounter(8),
    common.WorkerLog([pdasgd.worker_name(settings, w) for w in range(3)], {}, executor.now),
    lane_processes=True,
  )
  _, values = run(session, executor)
  for store, (_, opt_state) in zip(stores(session), values):
    assert adam_count(opt_state) == len(store.updates) == 8
  assert {u.lane for s in stores(session) for u in s.updates} <= {2, 3}
  assert session.steps.applied == 8


# --- LPP-SGD -------------------------------------------------------------------------------
def lpp_session(executor, pipe: PlacedStages, settings, streams, steps: int):
  """An LPP-SGD session of one worker per replica (`settings.devices` replicas, one
  stream each) on one device, starting from the pipeline's initial variables."""
  variables = pipe.initial_variables(0, sequential_roles(1)[0])
  return lppsgd.LppSession(
    pipe,
    settings,
    variables,
    pipe.tx.init(variables['params']),
    list(streams),
    [jax.devices()[0]] * settings.devices,
    common.StepCounter(steps),
    common.WorkerLog([f'worker {d}.0' for d in range(settings.devices)], {}, executor.now),
    lane_processes=on_processes(executor),
  )


def lpp(executor, pipe: PlacedStages, stream):
  """LPP-SGD with one replica and one worker; from step 1 on, every other step is
  partitioned over one slice, which is the whole model: sequential SGD."""
  settings = lppsgd.LppSettings(devices=1, workers_per_device=1, warmup_steps=0)
  session = lpp_session(executor, pipe, settings, [stream], STEPS)
  variables, values = run(session, executor)
  return variables, values, stores(session)[0].staleness().tolist()


def test_lppsgd_one_worker_on_lane_processes_is_sequential_sgd(pool, monkeypatch):
  pipe = placed(mlp(), 1)
  prepared, started = spy_tasks(pool, monkeypatch)
  _, values, staleness = lpp(ProcessExecutor(pool=pool), pipe, batches(seed=0))
  # Its lane was sent, to build as the run began, the tasks it then ran: forward,
  # backward and the update (the partitioned step over one slice is the update itself).
  assert prepared == started and [len(tasks) for tasks in prepared.values()] == [3]
  chex.assert_trees_all_equal(values, sequential_adam(pipe, batches(seed=0), STEPS))
  assert staleness == [0] * STEPS
  for executor in (RealExecutor(threads=True), virtual()):
    chex.assert_trees_all_equal(values, lpp(executor, pipe, batches(seed=0))[1])
  assert pool.held('worker0.0') == 0


def test_lppsgd_two_replicas_on_lane_processes_average_and_lose_no_update(pool, monkeypatch):
  """D = 2 replicas (one worker each), averaged after every update: the mean runs on the
  averaging lane, each keep-local merge on the replica's lane in the replica's turn. A
  merge that overwrote an update would set Adam's count back below the writes.

  The replicas are made to meet (`meeting_in_a_round`): left to real timing, a lane
  still compiling could leave every step to the other, or the run end before the mean
  came back, and no round would be merged (once in a clean clone, in four tries)."""
  settings = lppsgd.LppSettings(devices=2, workers_per_device=1, averaging_freq=1)
  pipe = placed(mlp(), 1, steps=16)
  prepared, started = spy_tasks(pool, monkeypatch)
  executor = ProcessExecutor(pool=pool)
  session = lpp_session(executor, pipe, settings, [batches(seed=d) for d in range(2)], 16)
  monkeypatch.setattr(session, 'processes', meeting_in_a_round(session, updates_before=4))
  _, values = run(session, executor)
  counts = [adam_count(opt_state) for _, opt_state in values]
  assert counts == [len(store.updates) for store in stores(session)] and sum(counts) == 16
  assert session.averaged_rounds >= 1  # the merges were exercised
  assert pool.held('allreduce') == 0
  # Each lane was sent, to build as the run began, what it could run: a replica's lane
  # (worker d.0's) its worker's forward and backward, the update and the merge; the
  # averaging lane the mean. Only those ran there.
  ops, merge = session.ops, Task(lppsgd.AVERAGING, 'merge')
  replica = {ops.forward, ops.backward, ops.update, merge}
  mean = {Task(lppsgd.AVERAGING, 'mean')}
  assert prepared == {'worker0.0': replica, 'worker1.0': replica, 'allreduce': mean}
  assert all(started[lane] <= prepared[lane] for lane in started)
  assert started['allreduce'] == mean and merge in started['worker0.0'] | started['worker1.0']


def meeting_in_a_round(session: lppsgd.LppSession, updates_before: int):
  """`session.processes`, with each replica's worker held before its forward once its
  replica has `updates_before` updates, until the first averaging round is merged.

  Both replicas' first updates send snapshots (`averaging_freq=1`), which make that
  round; at most `devices * updates_before` steps, fewer than the run's, are taken
  before it is merged, so the run cannot end first. A replica's updates after its
  snapshot (up to the bound, and past it once released) land before its merge, which
  must keep them; a worker below the bound may update while the merge waits for its
  turn. A hold that nothing released would end the run as a `DeadlockError`, not hang
  it."""
  processes = session.processes
  released = [session.cluster.channel(f'released {d}', session.home(d)) for d in range(2)]

  def held(d, program):
    value = None
    while True:
      try:
        op = program.send(value)
      except StopIteration:
        return
      if isinstance(op, Compute) and op.kind == 'forward' and session.averaged_rounds == 0:
        if session.device_updates[d] >= updates_before:
          yield Get(released[d])
      value = yield op

  def releasing(program):
    value, sent = None, False
    while True:
      try:
        op = program.send(value)
      except StopIteration:
        op = None
      if session.averaged_rounds >= 1 and not sent:
        sent = True
        for channel in released:
          yield Put(channel, None)
      if op is None:
        return
      value = yield op

  def gated():
    all_processes = processes()
    for p in all_processes:
      if p.name == 'averaging':
        p.program = releasing(p.program)
      else:
        p.program = held(int(p.name.split()[1].split('.')[0]), p.program)
    return all_processes

  return gated


# --- BatchNorm statistics ------------------------------------------------------------------
IMAGE = (4, 4, 3)


def resnet():
  """The smallest model with BatchNorm statistics: ResNet-8 (a block a stack), one
  channel wide."""
  return models.get_model('resnet8', IMAGE, 4, width=1)


def images(seed: int = 0):
  rng = np.random.default_rng(seed)
  while True:
    yield {
      'image': rng.standard_normal((BATCH,) + IMAGE).astype(np.float32),
      'label': rng.integers(0, 4, BATCH).astype(np.int32),
    }


def pipeline(roles, executor, pipe: PlacedStages):
  """`STEPS` iterations of `roles`: the variables (BatchNorm statistics too), losses."""
  losses = []
  session = pipe.session(
    roles,
    BatchFeed(images(), 2),
    STEPS,
    on_step=lambda t, loss: losses.append(executor.deferred(loss)),
  )
  session.fetch = executor.fetch
  try:
    executor.run(session.cluster, session.processes())
    return session.variables(), [np.asarray(loss) for loss in losses]
  finally:
    executor.close()


def test_batchnorm_ddg_on_lane_processes_is_bit_identical_to_in_process(pool):
  pipe = placed(resnet(), 2)
  variables, losses = pipeline(ddg.roles(2), ProcessExecutor(pool=pool), pipe)
  assert 'batch_stats' in variables and variables['batch_stats']  # the statistics moved
  for executor in (RealExecutor(), virtual(2)):
    chex.assert_trees_all_equal((variables, losses), pipeline(ddg.roles(2), executor, pipe))


@pytest.mark.parametrize(
  'config_name, variant',
  [
    ('lppsgd', 'smoke'),
    ('pdasgd', 'smoke'),
    pytest.param('pdasgd', 'lm_smoke', marks=pytest.mark.slow),
  ],
)
def test_a_config_run_on_lane_processes_matches_the_in_process_run(
  config_name, variant, head, data_dir, tmp_path, capsys, monkeypatch
):
  """`--config.executor=processes` end to end in the sequential configuration (one
  replica and worker; one forward and one backward worker, one token), joined to the
  cluster by address; the lanes are ended when the run is over. `lm_smoke`: the
  transformer's stages and their residual streams move between lane processes."""
  from jaxsgd import training

  def summary(executor, **fields):
    config = _config(config_name, variant, executor=executor, data_dir=data_dir, train_steps=20)
    config.update({'eval_every': 10, **fields})
    if config_name == 'lppsgd':
      config.algorithm.update({'devices': 1, 'workers_per_device': 1})
    else:
      config.update({'stages': 2})
      config.algorithm.update({'n_fwd': 1, 'n_bwd': 1, 'max_inflight': 1})
    workdir = str(tmp_path / executor)
    return training.train_and_evaluate(config, workdir, show_progress=False)['final']

  before = set(_lane_processes(head))
  pools = spy_pools(monkeypatch)
  on_lanes = summary('processes', cluster_address=head.address)
  printed = capsys.readouterr().out
  names = ('worker0.0',) if config_name == 'lppsgd' else ('sharedmodel', 'backwardworker0')
  assert all(f'  {name}: host=' in printed for name in names)  # the placement, at start
  # Every lane's process was started as the model was built, placed as the run placed it.
  lanes = (
    ('worker0.0',) if config_name == 'lppsgd' else ('sharedmodel', 'forwardworker0', *names[1:])
  )
  assert [pool.started_early for pool in pools] == [lanes]
  assert gone(set(_lane_processes(head)) - before) == []
  in_process = summary('in_process')
  assert on_lanes['staleness_mean'] == in_process['staleness_mean']  # the same schedule
  if variant == 'lm_smoke':
    # XLA's CPU arithmetic for the transformer depends on the threads it may use, and a
    # lane pinned to one core runs single-threaded (`LanePlacement`'s XLA_FLAGS): the
    # same program on the same inputs in two thread settings differs in the last bits
    # (five Adam steps: 22,914 of its 43k weights). So the runs agree to rounding here,
    # where one more batch in flight (`max_inflight=2`) moves the test loss by 2.3 %.
    for key in ('train_loss', 'test_loss'):
      assert on_lanes[key] == pytest.approx(in_process[key], rel=1e-6), key
    return
  for key in ('train_loss', 'test_loss', 'test_accuracy'):
    assert on_lanes[key] == in_process[key], key


def asgd(executor, pipe: PlacedStages):
  """ASGD with one worker: its pushes carry the BatchNorm statistics to the server, its
  pulls bring them back (moved lane to lane on processes)."""
  settings = server.ServerSettings(1)
  params, state = stage_functions.split_variables(pipe.initial_variables(0, sequential_roles(1)[0]))
  tx = optimizers.make_optimizer(
    OPTIMIZER, STEPS, gradient_transforms=server.server_gradient_transforms(settings)
  )
  ps = server.ParameterServer(
    tx,
    params,
    1,
    jax.devices()[0],
    record_pulls=False,
    apply_fn=server.named_apply(OPTIMIZER, STEPS, settings),
  )
  session = server.AsgdSession(
    pipe,
    ps,
    state,
    [images()],
    [jax.devices()[0]] * 2,
    common.StepCounter(STEPS),
    common.WorkerLog(['worker 0'], {}, executor.now),
  )
  session.fetch = executor.fetch
  try:
    executor.run(session.cluster, session.processes())
    return session.variables()
  finally:
    executor.close()


def test_batchnorm_asgd_on_lane_processes_is_bit_identical_to_in_process(pool, monkeypatch):
  pipe = placed(resnet(), 1)
  prepared, started = spy_tasks(pool, monkeypatch)
  variables = asgd(ProcessExecutor(pool=pool), pipe)
  assert prepared == started and len(prepared) == 2  # the server's update, the worker's
  initial = pipe.initial_variables(0, sequential_roles(1)[0])['batch_stats']
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), variables['batch_stats'], initial)
  assert all(jax.tree.leaves(changed))  # the statistics went to the server and back
  for executor in (RealExecutor(threads=True), virtual()):
    chex.assert_trees_all_equal(variables, asgd(executor, pipe))


# --- what cannot run on lane processes is refused, naming the field ------------------------
def _config(name: str, variant: str = 'smoke', **fields):
  import importlib

  module = 'default' if name == 'bp' else name
  config = importlib.import_module(f'experiments.configs.{module}').get_config(variant)
  config.update({'clock': 'real', 'executor': 'processes', **fields})
  return config


def test_combinations_that_cannot_run_on_lane_processes_are_refused_before_compiling():
  from jaxsgd import algorithms

  model = mlp()
  with pytest.raises(ValueError, match=r"^executor: 'processes' runs the scheduler families"):
    algorithms.get('ssgd').validate(_config('ssgd'), model)
  config = _config('ddg')
  config.placement.devices = (0,)
  with pytest.raises(ValueError, match=r'^placement.devices: places stages on this process'):
    algorithms.get('ddg').validate(config, model)
  config = _config('ddg', executor='in_process')
  config.placement.lanes = 'stage0@cores=0'
  with pytest.raises(
    ValueError, match=r'^placement.lanes: places lane processes \(or the simulated lanes'
  ):
    algorithms.get('ddg').validate(config, model)
  # Every scheduler family validates on processes; bp of one stage is one lane process.
  for name in ('bp', 'ddg', 'local', 'asgd', 'dcasgd', 'lppsgd', 'pdasgd'):
    config = _config(name)
    if name == 'lppsgd':
      config.algorithm.devices = 2
    settings = algorithms.get(name).validate(config, models.get_model('mlp', (40,), 10))
    assert settings.shared.executor == 'processes', name
  assert algorithms.get('bp').validate(_config('bp', stages=1), model).uses_scheduler


LANES_OF = [  # hand-written: each family's lanes for the fields beside it
  ('bp', {'stages': 1}, 'stage0'),
  ('ddg', {'stages': 2}, 'stage0, stage1'),
  ('local', {'stages': 3}, 'stage0, stage1, stage2'),
  ('asgd', {'workers': 2}, 'server, worker0, worker1'),
  ('dcasgd', {'workers': 3}, 'server, worker0, worker1, worker2'),
  (
    'lppsgd',
    {'algorithm.devices': 2, 'algorithm.workers_per_device': 2},
    'worker0.0, worker0.1, worker1.0, worker1.1, allreduce',
  ),
  ('lppsgd', {'algorithm.devices': 1, 'algorithm.workers_per_device': 2}, 'worker0.0, worker0.1'),
  (
    'pdasgd',
    {'algorithm.n_fwd': 1, 'algorithm.n_bwd': 2},
    'sharedmodel, forwardworker0, backwardworker0, backwardworker1',
  ),
]


@pytest.mark.parametrize('name, fields, lanes', LANES_OF)
def test_placement_lanes_must_name_the_runs_lanes_on_either_clock(name, fields, lanes):
  """A placed name that is no lane of the run was ignored on the virtual clock (a typo
  left its lane unplaced without a word) and found on processes only once the run had
  loaded its data and built its model; now `validate` refuses both, naming the lanes."""
  from jaxsgd import algorithms

  names = lanes.split(', ')
  model = models.get_model('mlp', (40,), 10)

  def validate(clock, executor, placement):
    config = _config(name, clock=clock, executor=executor)
    config.update_from_flattened_dict({**fields, 'placement.lanes': placement})
    return algorithms.get(name).validate(config, model)

  every = '; '.join(f'{lane}@cores=0' for lane in names)
  for clock, executor in (('virtual', 'in_process'), ('real', 'processes')):
    shared = validate(clock, executor, every).shared
    assert shared.placement.lanes == every
    assert shared.lanes == tuple(names)  # (the lanes started while the model is built)
    typo = every.replace(names[-1], names[-1] + 'x')
    with pytest.raises(ValueError) as refused:
      validate(clock, executor, typo)
    assert str(refused.value) == (
      f"placement.lanes: no lane of this run is named '{names[-1]}x'; its lanes: {lanes}."
    )
  if len(names) == 1:
    return  # leaving its lane out leaves no placement
  some = '; '.join(f'{lane}@cores=0' for lane in names[:-1])
  assert validate('virtual', 'in_process', some)  # unplaced: a lane of its own
  with pytest.raises(ValueError) as refused:
    validate('real', 'processes', some)
  assert str(refused.value) == (
    f'placement.lanes: no lane for {names[-1]}; this run needs lanes named {lanes}.'
  )


def test_a_run_neither_placed_nor_on_lane_processes_names_no_lanes(monkeypatch):
  """Only a placement or lane processes read a run's lane names: for the others none is
  made, so a config of millions of workers reaches the memory limit that refuses it at
  once (naming ten million lanes took the validation ~40 s)."""
  from jaxsgd import algorithms
  from jaxsgd.algorithms import asgd

  model = models.get_model('mlp', (40,), 10)
  config = _config('asgd', clock='virtual', executor='in_process')
  with monkeypatch.context() as patched:
    patched.setattr(asgd, 'lane_names', lambda _: pytest.fail('lanes named'))
    assert algorithms.get('asgd').validate(config, model).shared.lanes == ()
  config.placement.lanes = 'serverx@cores=0'  # placed: checked against the lanes' names
  with pytest.raises(ValueError, match=r"^placement.lanes: no lane of this run is named 'serverx'"):
    algorithms.get('asgd').validate(config, model)


def test_elastic_lppsgd_names_its_replica_lanes_before_anything_is_built():
  """With lost workers tolerated on lane processes, each LPP-SGD replica has a lane of
  its own (`replica d`, after the workers'): the settings name them, so that a placement
  may place them and the run's lanes start, placed as the run places them, while the
  model is built."""
  from jaxsgd import algorithms

  names = ['worker0.0', 'worker1.0', 'replica0', 'replica1', 'allreduce']
  config = _config('lppsgd', tolerate_lost_workers=True)
  config.algorithm.update({'devices': 2, 'workers_per_device': 1})
  model = models.get_model('mlp', (40,), 10)
  assert algorithms.get('lppsgd').validate(config, model).shared.lanes == tuple(names)
  config.placement.lanes = '; '.join(f'{lane}@cores=0' for lane in names)
  assert algorithms.get('lppsgd').validate(config, model).shared.lanes == tuple(names)


def test_placement_lanes_are_refused_for_the_data_parallel_methods():
  from jaxsgd import algorithms

  config = _config('ssgd', clock='virtual', executor='in_process')
  config.placement.lanes = 'worker0@cores=0'
  with pytest.raises(ValueError, match=r'^placement.lanes: places the lanes of the scheduler'):
    algorithms.get('ssgd').validate(config, mlp())
