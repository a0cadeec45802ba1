"""Helpers of the asynchronous tests: tiny MLP sessions on synthetic batches, replays."""

import functools

import jax

# tests/ is on sys.path (its conftest.py): the scheduler tests' helpers are shared.
from scheduler_helpers import BATCH, OPTIMIZERS, batches, mlp, run_with_timeout  # noqa: F401
from scheduler_helpers import sequential_sgd  # noqa: F401

from jaxsgd.asynchronous import common, lppsgd, pdasgd, server
from jaxsgd.pipeline import PlacedStages
from jaxsgd.scheduler import CostModel, Placement, RealExecutor, VirtualExecutor
from jaxsgd.pipeline.session import sequential_roles

# F = 1, B = 2, U = 1/8 seconds (binary-exact, so simulated times tie exactly); a free average.
UNIT = {'forward': 1.0, 'backward': 2.0, 'update': 0.125, 'average': 0.0}


def executor(
  clock: str = 'virtual', speeds=(), straggler_std=0.0, seed=0, costs=None, num_stages: int = 1
):
  """A virtual executor with explicit per-kind costs, or the threaded real one."""
  if clock == 'real':
    return RealExecutor(threads=True)
  table = {(k, kind): v for kind, v in (costs or UNIT).items() for k in range(num_stages)}
  return VirtualExecutor(
    CostModel(table, device_speeds=tuple(speeds), straggler_std=straggler_std, seed=seed)
  )


def pipeline(num_stages: int = 1, tx: str = 'sgd', hidden=(16, 16)) -> PlacedStages:
  """A pipeline shared by the tests of one process (its jitted ops compile once);
  `tx` is 'sgd' (0.1) or 'adam' (1e-2)."""
  return _shared_pipeline(num_stages, tx, tuple(hidden))


@functools.lru_cache(maxsize=None)
def _shared_pipeline(num_stages, tx, hidden):
  device = jax.devices()[0]
  return PlacedStages(
    mlp(hidden),
    num_stages,
    OPTIMIZERS[tx](),
    placement=Placement.create(num_stages, [device]),
    batch_size=BATCH,
    seed=0,
  )


def initial(pipe: PlacedStages):
  """(params, model state) of the one-stage pipeline."""
  variables = pipe.initial_variables(0, sequential_roles(1)[0])
  return variables['params'], {k: v for k, v in variables.items() if k != 'params'}


def log_for(names, failures, ex):
  return common.WorkerLog(names, failures or {}, ex.now)


def run_asgd(
  num_workers, steps, *, settings=None, ex=None, tx='sgd', streams=None, failures=None, pipe=None
):
  """Runs ASGD/DC-ASGD; returns (session, timeline, log)."""
  ex = ex or executor(speeds=(1.0,) * (1 + num_workers))
  pipe = pipe or pipeline(tx=tx)
  settings = settings or server.ServerSettings(num_workers)
  params, state = initial(pipe)
  device = jax.devices()[0]
  ps = server.ParameterServer(
    server.server_optimizer(pipe.tx, settings),
    params,
    num_workers,
    device,
    record_pulls=settings.delay_compensation,
  )
  log = log_for([f'worker {m}' for m in range(num_workers)], failures, ex)
  streams = streams or [batches(seed=m) for m in range(num_workers)]
  session = server.AsgdSession(
    pipe, ps, state, streams, [device] * (1 + num_workers), common.StepCounter(steps), log
  )
  return session, ex.run(session.cluster, session.processes()), log


def run_lpp(settings, steps, *, ex=None, tx='sgd', failures=None, pipe=None, streams=None):
  ex = ex or executor()
  pipe = pipe or pipeline(tx=tx)
  variables = pipe.initial_variables(0, sequential_roles(1)[0])
  n = settings.num_workers
  log = log_for([f'worker {m}' for m in range(n)], failures, ex)
  streams = streams or [batches(seed=m) for m in range(n)]
  session = lppsgd.LppSession(
    pipe,
    settings,
    variables,
    pipe.tx.init(variables['params']),
    streams,
    [jax.devices()[0]] * settings.devices,
    common.StepCounter(steps),
    log,
  )
  return session, ex.run(session.cluster, session.processes()), log


def run_pd(
  settings, steps, *, num_stages=3, ex=None, tx='sgd', failures=None, pipe=None, streams=None
):
  ex = ex or executor(num_stages=num_stages)
  pipe = pipe or pipeline(num_stages, tx=tx, hidden=(16,) * (num_stages - 1))
  n = settings.num_workers
  log = log_for([pdasgd.worker_name(settings, w) for w in range(n)], failures, ex)
  streams = streams or [batches(seed=f) for f in range(settings.n_fwd)]
  session = pdasgd.PdSession(
    pipe, settings, streams, [jax.devices()[0]] * (1 + n), common.StepCounter(steps), log
  )
  return session, ex.run(session.cluster, session.processes()), log
