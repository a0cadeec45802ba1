"""What the asynchronous algorithms (`asgd`, `dcasgd`, `lppsgd`, `pdasgd`) share: the
checks of a worker run, and running a session of `jaxsgd.asynchronous` to its summary."""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxsgd import models as models_lib
from jaxsgd.algorithms import clocks
from jaxsgd.algorithms import resume as resume_lib
from jaxsgd.algorithms.settings import SharedSettings, refuse_workers_field, shared_settings
from jaxsgd.pipeline import KINDS, PlacedStages
from jaxsgd.scheduler import Placement
from jaxsgd.asynchronous import common


def refuse_lost_workers_with_model_state(shared: SharedSettings, model, name: str) -> None:
  """With `tolerate_lost_workers`, PD-ASGD and LPP-SGD keep no value in a worker's lane
  that another lane needs, but BatchNorm statistics would stay in the lane of the worker
  that computed them: a model with any is refused (its shapes traced, nothing computed)."""
  if not shared.tolerate_lost_workers:
    return
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0)))
  if jax.tree.leaves(variables.get('batch_stats', {})):
    raise ValueError(
      f"tolerate_lost_workers: {name} keeps BatchNorm statistics in its workers' lanes, "
      f'which a lost worker takes with it; use a model without BatchNorm (mlp, cnn) or '
      'leave tolerate_lost_workers False.'
    )


def validate_workers(
  config,
  model,
  num_workers: int,
  *,
  whole_model: bool,
  uses_workers_field: bool = False,
  num_lanes: int | None = None,
) -> SharedSettings:
  """The shared settings of an asynchronous run of `num_workers` workers.

  `whole_model`: every worker computes whole-model gradients (ASGD, DC-ASGD, LPP-SGD),
  so `stages` must be 1. `uses_workers_field`: the worker count is `config.workers`
  (else it comes from `algorithm.*` and `workers` must stay 1). `num_lanes`: the
  session's compute lanes, which `placement.lane_to_device` maps to simulated devices
  (None: the algorithm does not take that map).
  """
  shared = shared_settings(config)
  name = config.algorithm.name
  lane_map = shared.placement.lane_to_device
  if lane_map is not None:
    if num_lanes is None:
      raise ValueError(
        f'placement.lane_to_device: {name} places its workers itself (lppsgd: '
        'algorithm.devices x workers_per_device); leave it None.'
      )
    if not shared.virtual:
      raise ValueError(
        'placement.lane_to_device: models shared devices on the virtual clock; set '
        "clock='virtual' (on the real clock lane i runs on jax.devices()[i % n])."
      )
    if len(lane_map) != num_lanes:
      raise ValueError(
        f'placement.lane_to_device: {len(lane_map)} entries for the {num_lanes} lanes of '
        f'{name} (asgd/dcasgd: server + workers; pdasgd: shared model + n_fwd + n_bwd).'
      )
  if whole_model and shared.stages != 1:
    raise ValueError(
      f'stages: {name} computes whole-model gradients on each worker; use '
      f'stages=1, got {shared.stages}.'
    )
  models_lib.check_num_stages(model, shared.stages)
  if not uses_workers_field:
    refuse_workers_field(name, shared.workers)
  if shared.prices_tasks and not shared.cost.calibrate:
    shared.cost.explicit(KINDS, shared.stages)
  clocks.worker_speeds(shared, num_workers)
  clocks.failures(shared, num_workers)
  return shared


def whole_model(run, shared: SharedSettings, tx, device, total_steps: int) -> PlacedStages:
  """The whole model as one placed stage on `device`: a worker's jitted forward (with its
  vjp), backward and update under `tx` (`make_optimizer(shared.optimizer, total_steps)`:
  named tasks a lane process rebuilds), and the initial variables of the fused `bp`."""
  return PlacedStages(
    run.model,
    1,
    tx,
    placement=Placement.create(1, [device]),
    batch_size=shared.batch_size,
    seed=shared.seed,
    optimizer=(shared.optimizer, total_steps),
  )


def train_session(
  run,
  shared: SharedSettings,
  executor,
  measured: dict,
  log: common.WorkerLog,
  make_session: Callable[[common.StepCounter], Any],
  *,
  name: str,
  title: str,
  extra: Callable[[Any], dict],
  streams: Sequence = (),
  resumable: bool = False,
) -> dict:
  """Runs the session `make_session(steps)` builds and returns the summary extras.

  `steps` reports every applied step to `run`; the session must provide
  `cluster`, `processes()`, `variables()`, `metrics()` and `staleness()`. With
  `resumable` (the virtual clock; the in-process real clock at a drained point), the run
  checkpoints the whole simulation and resumes
  from a checkpoint (`algorithms.resume`; the session also provides `snapshot()` and
  `load()`, and `streams` are the data streams it reads).
  """
  session = None
  steps = common.run_reporter(
    run,
    executor,
    steps=shared.train_steps,
    batch_size=shared.batch_size,
    variables=lambda: session.variables(),
    metrics=lambda: session.metrics(),
  )
  session = make_session(steps)
  processes = session.processes()
  checkpoints = resume = None
  if resumable:
    checkpoints = resume_lib.SimulationCheckpoints(
      run, executor, session, processes, streams, lambda: steps.applied
    )
    resume = checkpoints.restore()
  session.fetch = executor.fetch  # values in lane processes come to the driver when read
  if shared.placement.lane_to_device is not None:
    common.share_devices(session.cluster, shared.placement.lane_to_device)
  try:
    timeline = executor.run(session.cluster, processes, resume=resume)
    if checkpoints is not None:
      checkpoints.after_run()  # steps reported after the last `between_events` call
  finally:
    executor.close()  # lane processes (executor='processes') end here
  if not steps.done:
    raise common.WorkersFailedError(
      f'{name}: the run stopped after {steps.applied} of {steps.steps} '
      f'steps: the workers that could go on failed or were lost '
      f'({log.summary()["failed_workers"] + log.summary()["lost_workers"]}).'
    )
  summary = {**extra(session), **log.summary(), **clocks.executor_summary(executor)}
  if measured:
    summary['backward_forward_ratio'] = common.backward_forward_ratio(measured)
    logging.info(
      '%s: measured backward/forward time ratio %.2f.', title, summary['backward_forward_ratio']
    )
  return run.write_schedule_outputs(
    timeline,
    session.staleness(),
    cost_table=clocks.cost_table(executor),
    epochs=steps.applied * shared.batch_size / run.dataset.num_train,
    title=title,
    extra=summary,
  )
