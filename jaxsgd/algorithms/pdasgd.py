r"""`pdasgd`: forward and backward workers with layer-wise updates (arXiv:2410.05985).

The schedule is in `jaxsgd.asynchronous.pdasgd` (docs/algorithms.md): `n_fwd`
forward workers and `n_bwd` backward workers share the model cut into `stages`
layers; a backward worker applies each layer's update as soon as its gradient is
ready (`updates='layer'`) or all at once (`'block'`).
"""

import dataclasses

from jaxsgd import optimizers
from jaxsgd.algorithms import clocks, pipelined, workers
from jaxsgd.algorithms.settings import SharedSettings, choice, derived, placed_lanes
from jaxsgd.algorithms.settings import integer, section
from jaxsgd.asynchronous import common
from jaxsgd.asynchronous.pdasgd import UPDATES, PdSession, PdSettings, lane_names, worker_name
from jaxsgd.pipeline import KINDS, PlacedStages, sequential_roles
from jaxsgd.scheduler import Placement


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `pdasgd`, and the shared fields (`shared`).

  Attributes:
    n_fwd, n_bwd: forward and backward workers.
    updates: 'layer' (each layer as soon as its gradient is ready) or 'block'.
    max_inflight: forwards begun but not yet applied; None = n_fwd + n_bwd.
  """

  n_fwd: int = 1
  n_bwd: int = 2
  updates: str = 'layer'
  max_inflight: int | None = None
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """The whole run is checkpointed (`algorithms.resume`): on the virtual clock between
    any two events, on the real clock at a drained point, in one process or on lanes."""
    return True

  @property
  def session(self) -> PdSettings:
    return PdSettings(self.n_fwd, self.n_bwd, self.updates, self.max_inflight)


def validate(config, model) -> Settings:
  settings = section(config.algorithm, Settings, 'algorithm')
  integer(settings.n_fwd, 'algorithm.n_fwd')
  integer(settings.n_bwd, 'algorithm.n_bwd')
  choice(settings.updates, 'algorithm.updates', UPDATES)
  if settings.max_inflight is not None:
    integer(settings.max_inflight, 'algorithm.max_inflight')
  num_workers = settings.session.num_workers
  shared = workers.validate_workers(
    config, model, num_workers, whole_model=False, num_lanes=1 + num_workers
  )
  shared = placed_lanes(shared, lambda: lane_names(settings.session))
  workers.refuse_lost_workers_with_model_state(shared, model, 'pdasgd')
  return dataclasses.replace(settings, shared=shared)


def train(run, settings: Settings) -> dict:
  """Trains until `train_steps` backward passes have been applied."""
  shared, pd = settings.shared, settings.session
  devices = clocks.lane_devices(shared, 1 + pd.num_workers)
  model = PlacedStages(
    run.model,
    shared.stages,
    optimizers.make_optimizer(shared.optimizer, shared.train_steps),
    placement=Placement.create(shared.stages, devices[:1]),
    batch_size=shared.batch_size,
    seed=shared.seed,
    optimizer=(shared.optimizer, shared.train_steps),  # named tasks: lane processes rebuild them
  )
  executor, measured = clocks.make_executor(
    shared,
    pipelined.stage_tasks(
      model,
      sequential_roles(shared.stages),
      lambda: next(run.train_batches(0, 1)),
      shared.batch_size,
    ),
    KINDS,
    shared.stages,
    lane_speeds=(1.0,) + clocks.worker_speeds(shared, pd.num_workers),
    threads=True,
    devices={  # the forward workers', the backward workers', the shared model's
      'forward': devices[1 : 1 + pd.n_fwd],
      'backward': devices[1 + pd.n_fwd :],
      'update': devices[:1],
    },
    # In the lane-process form each update is a task of its own on the shared model's lane.
    adjust=lambda table: (
      table if shared.lane_processes else common.fold_update(table, shared.stages)
    ),
  )
  log = common.WorkerLog(
    [worker_name(pd, w) for w in range(pd.num_workers)],
    clocks.failures(shared, pd.num_workers),
    executor.now,
  )
  streams = [run.train_batches(f, pd.n_fwd) for f in range(pd.n_fwd)]
  # In the lane-process form the policy copies nothing: the executor moves what a task
  # reads from another lane (and the virtual clock, running ahead, prices that copy).
  costed = shared.cost.links_are_costed(shared.clock) and not shared.lane_processes
  return workers.train_session(
    run,
    shared,
    executor,
    measured,
    log,
    lambda steps: PdSession(
      model,
      pd,
      streams,
      devices,
      steps,
      log,
      costed_links=costed,
      lane_processes=shared.lane_processes,
      elastic=shared.tolerate_lost_workers,
    ),
    name='pdasgd',
    title=f'pdasgd ({pd.updates} updates): staleness per layer',
    extra=lambda session: {
      'n_fwd': pd.n_fwd,
      'n_bwd': pd.n_bwd,
      'updates': pd.updates,
      'max_inflight': pd.bound,
    },
    streams=streams,
    resumable=settings.resumable,
  )
