r"""`lppsgd`: Hogwild! workers sharing one replica per device, replicas averaged.

The schedule and the keep-local merge are in `jaxsgd.asynchronous.lppsgd`
(docs/algorithms.md): D devices (`algorithm.devices`), W workers per device
(`algorithm.workers_per_device`) updating their replica without locks; every
`averaging_freq` updates a replica joins a non-blocking ring all-reduce.
"""

import dataclasses
import math

from jaxsgd import optimizers
from jaxsgd.algorithms import clocks, pipelined, workers
from jaxsgd.algorithms.settings import SharedSettings, derived, integer, placed_lanes
from jaxsgd.algorithms.settings import section
from jaxsgd.asynchronous import common
from jaxsgd.asynchronous.lppsgd import LppSession, LppSettings, allreduce_time
from jaxsgd.pipeline import KINDS, sequential_roles
from jaxsgd.scheduler import transfer


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `lppsgd`, and the shared fields (`shared`)."""

  devices: int = 2
  workers_per_device: int = 2
  warmup_steps: int = 0
  averaging_freq: int = 4
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """The whole run is checkpointed (`algorithms.resume`): on the virtual clock between
    any two events, on the real clock at a drained point, in one process or on lanes."""
    return True

  @property
  def session(self) -> LppSettings:
    elastic = self.shared is not None and self.shared.tolerate_lost_workers
    return LppSettings(
      self.devices, self.workers_per_device, self.warmup_steps, self.averaging_freq, elastic
    )


def validate(config, model) -> Settings:
  settings = section(config.algorithm, Settings, 'algorithm')
  integer(settings.devices, 'algorithm.devices')
  integer(settings.workers_per_device, 'algorithm.workers_per_device')
  integer(settings.warmup_steps, 'algorithm.warmup_steps', minimum=0)
  integer(settings.averaging_freq, 'algorithm.averaging_freq')
  shared = workers.validate_workers(config, model, settings.session.num_workers, whole_model=True)
  settings = dataclasses.replace(settings, shared=shared)  # (its lanes depend on `shared`)
  shared = placed_lanes(shared, lambda: settings.session.lane_names)
  settings = dataclasses.replace(settings, shared=shared)
  workers.refuse_lost_workers_with_model_state(shared, model, 'lppsgd')
  return settings


def task_costs(
  table: dict,
  nbytes: int,
  devices: int,
  *,
  bandwidth: float,
  latency: float,
  lane_processes: bool = False,
) -> dict:
  """The update paid by the backward task it ends, and the averaging collective.

  In the lane-process form (`SharedSettings.lane_processes`) the update, the mean of a
  round's snapshots and each keep-local merge are tasks of their own, and the virtual
  clock prices the copies of the snapshots and the mean between lanes. The mean and a
  merge cost what the table measured of them (`experiments.profile` times both for
  lppsgd: `lppsgd.averaging_calls`); a table without them (a profile measured before,
  a calibration) prices each as one update, an elementwise pass over the parameters
  like them."""
  if lane_processes:
    update = table[(0, 'update')]
    return {
      **table,
      (0, 'average'): table.get((0, 'average'), update),
      (0, 'merge'): table.get((0, 'merge'), update),
    }
  return {
    **common.fold_update(table, 1),
    (0, 'average'): allreduce_time(nbytes, devices, bandwidth=bandwidth, latency=latency),
  }


def train(run, settings: Settings) -> dict:
  """Trains until `train_steps` updates were applied over all replicas."""
  shared, session_settings = settings.shared, settings.session
  D, W = settings.devices, settings.workers_per_device
  devices = clocks.lane_devices(shared, D)
  # Each replica keeps its own optimizer state and takes ~train_steps / D of the
  # updates: its learning-rate schedule spans that many steps, not train_steps.
  replica_steps = math.ceil(shared.train_steps / D)
  base = optimizers.make_optimizer(shared.optimizer, replica_steps)
  model = workers.whole_model(run, shared, base, devices[0], replica_steps)
  variables = model.initial_variables(0, sequential_roles(1)[0])
  opt_state = base.init(variables['params'])
  nbytes = transfer.nbytes(variables['params'])
  executor, measured = clocks.make_executor(
    shared,
    pipelined.stage_tasks(
      model, sequential_roles(1), lambda: next(run.train_batches(0, 1)), shared.batch_size
    ),
    KINDS,
    1,
    lane_speeds=[speed / W for speed in clocks.worker_speeds(shared, D * W)],
    threads=True,
    devices=dict.fromkeys(KINDS, devices),  # a replica's device runs all three
    adjust=lambda table: task_costs(
      table,
      nbytes,
      D,
      bandwidth=shared.cost.bandwidth,
      latency=shared.cost.link_latency,
      lane_processes=shared.lane_processes,
    ),
  )
  log = common.WorkerLog(
    session_settings.lane_names[: D * W], clocks.failures(shared, D * W), executor.now
  )
  streams = [run.train_batches(m, D * W) for m in range(D * W)]
  return workers.train_session(
    run,
    shared,
    executor,
    measured,
    log,
    lambda steps: LppSession(
      model,
      session_settings,
      variables,
      opt_state,
      streams,
      devices,
      steps,
      log,
      lane_processes=shared.lane_processes,
    ),
    name='lppsgd',
    title='lppsgd: staleness per worker',
    extra=lambda session: {
      'devices': D,
      'workers_per_device': W,
      'averaging_rounds': session.averaged_rounds,
    },
    streams=streams,
    resumable=settings.resumable,
  )
