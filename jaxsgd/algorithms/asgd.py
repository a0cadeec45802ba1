r"""`asgd` and `dcasgd`: a parameter server and M asynchronous workers.

The update rules and the schedule are in `jaxsgd.asynchronous.server`
(docs/algorithms.md has the equations and references):

    asgd    w ← w − η g_m                      (Hogwild!; `staleness_lr` scales η by 1/τ or 1/√τ)
    dcasgd  w ← w − η (g_m + λ_t ⊙ g_m ⊙ g_m ⊙ (w − w_bak(m)))   (Zheng et al. 2017)

`config.workers` is M; the server has its own lane.
"""

import dataclasses
import logging

from jaxsgd import optimizers
from jaxsgd.algorithms import clocks, pipelined, workers
from jaxsgd.algorithms.settings import SharedSettings, choice, derived, placed_lanes
from jaxsgd.algorithms.settings import section
from jaxsgd.asynchronous import common
from jaxsgd.asynchronous.server import STALENESS_LR, AsgdSession, ParameterServer, named_apply
from jaxsgd.asynchronous.server import ServerSettings, lane_names, server_gradient_transforms
from jaxsgd.models import stage_functions
from jaxsgd.pipeline import KINDS, PlacedStages, sequential_roles
from jaxsgd.scheduler import profile_lookup

# On lane processes (`executor='processes'`), a worker goes on before its task ends only
# while its lane has nothing else to do, so that its push is sent once its gradient
# exists. Further ahead, pushes reached the server in the driver's order of dispatch,
# before their gradients existed, and the server applied them in that order, waiting in
# its lane for the one sent first while the other was ready: ASGD M=2's staleness was
# {0: 17, 1: 27, 2: 16} on lanes against {0: 1, 1: 59} on the virtual clock; with 1 it is
# {0: 1, 1: 59} on both, at 14.7 ms per update against 15-17 (benchmarks/simulator_accuracy).
RUN_AHEAD = 1


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `asgd` / `dcasgd`, and the shared fields (`shared`).

  Attributes:
    staleness_lr: 'none', 'inverse' (η/τ) or 'inverse_sqrt' (η/√τ).
    lambda0: DC-ASGD's λ0; None: the paper's default (0.04 constant, 2 adaptive).
    adaptive: DC-ASGD-a (True) or DC-ASGD-c (False).
  """

  staleness_lr: str = 'none'
  lambda0: float | None = None
  adaptive: bool = False
  server: ServerSettings | None = derived()
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """The whole run is checkpointed (`algorithms.resume`): on the virtual clock between
    any two events, on the real clock at a drained point, in one process or on lanes."""
    return True


def validate(config, model) -> Settings:
  adaptive = config.algorithm.get('adaptive', False)
  if not isinstance(adaptive, bool):
    raise ValueError(
      f'algorithm.adaptive: True (DC-ASGD-a) or False (DC-ASGD-c), got {adaptive!r}.'
    )
  settings = section(config.algorithm, Settings, 'algorithm')
  dc = config.algorithm.name == 'dcasgd'
  choice(settings.staleness_lr, 'algorithm.staleness_lr', tuple(STALENESS_LR))
  if not dc and (settings.lambda0 is not None or settings.adaptive):
    logging.warning(
      'algorithm.lambda0=%s, algorithm.adaptive=%s: ignored by asgd (delay '
      "compensation is dcasgd's).",
      settings.lambda0,
      settings.adaptive,
    )
    settings = dataclasses.replace(settings, lambda0=None, adaptive=False)
  lambda0 = settings.lambda0
  if lambda0 is not None:
    if (
      isinstance(lambda0, bool)
      or not isinstance(lambda0, (int, float))
      or not (0 <= lambda0 < float('inf'))
    ):
      raise ValueError(
        f'algorithm.lambda0: must be a number >= 0 (0 gives plain ASGD), got {lambda0!r}.'
      )
    lambda0 = float(lambda0)
  shared = workers.validate_workers(
    config,
    model,
    config.workers,
    whole_model=True,
    uses_workers_field=True,
    num_lanes=1 + config.workers,
  )
  shared = placed_lanes(shared, lambda: lane_names(shared.workers))
  if dc and lambda0 == 0:
    logging.warning(
      'algorithm.lambda0=0: DC-ASGD without delay compensation (λ = 0) trains as asgd '
      "does; leave lambda0 unset for the paper's (0.04, or 2 with adaptive=True)."
    )
  server = ServerSettings(shared.workers, settings.staleness_lr, dc, lambda0, settings.adaptive)
  return dataclasses.replace(settings, lambda0=lambda0, server=server, shared=shared)


def build(run, shared: SharedSettings, server_settings: ServerSettings):
  """(the whole model as one stage, server, initial model state, lane devices)."""
  devices = clocks.lane_devices(shared, 1 + server_settings.num_workers)
  base = optimizers.make_optimizer(shared.optimizer, shared.train_steps)
  model = workers.whole_model(run, shared, base, devices[0], shared.train_steps)
  params, state = stage_functions.split_variables(
    model.initial_variables(0, sequential_roles(1)[0])
  )
  tx = optimizers.make_optimizer(
    shared.optimizer,
    shared.train_steps,
    gradient_transforms=server_gradient_transforms(server_settings),
  )
  server = ParameterServer(
    tx,
    params,
    server_settings.num_workers,
    devices[0],
    record_pulls=server_settings.delay_compensation,
    apply_fn=named_apply(shared.optimizer, shared.train_steps, server_settings),
  )
  return model, server, state, devices


def server_tasks(
  shared: SharedSettings, model: PlacedStages, server: ParameterServer, batch, name: str
) -> clocks.Tasks:
  """A worker's forward and backward and the server's update (the cost keys)."""
  tasks = pipelined.stage_tasks(model, sequential_roles(1), batch, shared.batch_size)

  def calls():
    return {**tasks.calls(), (0, 'update'): server.sample_update_call()}

  return dataclasses.replace(tasks, calls=calls, name=profile_lookup.server_tasks(name))


def train(run, settings: Settings) -> dict:
  """Trains `train_steps` server updates; returns the summary extras."""
  shared, num_workers = settings.shared, settings.server.num_workers
  model, server, state, devices = build(run, shared, settings.server)
  executor, measured = clocks.make_executor(
    shared,
    server_tasks(
      shared,
      model,
      server,
      lambda: next(run.train_batches(0, 1)),
      'dcasgd' if settings.server.delay_compensation else 'asgd',
    ),
    KINDS,
    1,
    lane_speeds=(1.0,) + clocks.worker_speeds(shared, num_workers),
    threads=True,
    devices={'forward': devices[1:], 'backward': devices[1:], 'update': devices[:1]},
    run_ahead=RUN_AHEAD,
  )
  log = common.WorkerLog(
    lane_names(num_workers)[1:], clocks.failures(shared, num_workers), executor.now
  )
  streams = [run.train_batches(m, num_workers) for m in range(num_workers)]
  name = 'dcasgd' if settings.server.delay_compensation else 'asgd'
  return workers.train_session(
    run,
    shared,
    executor,
    measured,
    log,
    lambda steps: AsgdSession(model, server, state, streams, devices, steps, log),
    name=name,
    title=f'{name}: staleness per worker',
    extra=lambda _: {'workers': num_workers},
    streams=streams,
    resumable=settings.resumable,
  )
