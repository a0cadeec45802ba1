"""What the stage-per-lane algorithms (staged `bp`, `ddg`, `local`) share: their roles,
run on the scheduler from settings.

Each of them turns its settings into one `StageRole` per stage (`jaxsgd.pipeline`);
`train_roles` places the stages, builds the executor of `config.clock` and runs the
pipeline session for `train_steps` iterations.
"""

from collections.abc import Sequence


from jaxsgd import models as models_lib
from jaxsgd import optimizers
from jaxsgd.algorithms import clocks
from jaxsgd.algorithms import resume as resume_lib
from jaxsgd.algorithms.settings import SharedSettings, refuse_cost_fields, refuse_workers_field
from jaxsgd.algorithms.settings import check_lane_speeds, placed_lanes, shared_settings
from jaxsgd.pipeline import KINDS, BatchFeed, PlacedStages, StageRole, lane_names
from jaxsgd.scheduler import profile_lookup


def validate_pipeline(config, model) -> SharedSettings:
  """The shared settings, and the checks of a stage-per-lane run."""
  shared = shared_settings(config)
  models_lib.check_num_stages(model, shared.stages)
  refuse_workers_field(config.algorithm.name, shared.workers)
  if shared.prices_tasks and not shared.cost.calibrate:
    shared.cost.explicit(KINDS, shared.stages)
  refuse_cost_fields(shared.cost, ('failures',), 'a pipeline has no workers to fail.')
  check_lane_speeds(shared.cost, shared.stages, 'stage')
  return placed_lanes(shared, lambda: lane_names(shared.stages))


def stage_tasks(stages: PlacedStages, roles, batch, batch_size: int) -> clocks.Tasks:
  """The cost keys of `stages` in `roles`: every stage's forward, backward and update on
  `batch()` (a host batch)."""
  return clocks.Tasks(
    calls=lambda: stages.task_calls(roles, batch()),
    model=stages.model,
    batch_size=batch_size,
    split=profile_lookup.split_of(stages.stages),
    name=profile_lookup.roles_signature(roles),
  )


class _Saved:
  """What a checkpoint saves of a pipeline run: its session and the last step's loss
  (reported once every lane is done)."""

  def __init__(self, session, last_loss: list):
    self.cluster, self._session, self._last_loss = session.cluster, session, last_loss

  def snapshot(self) -> dict:
    return {'session': self._session.snapshot(), 'last_loss': list(self._last_loss)}

  def load(self, saved: dict) -> None:
    self._session.load(saved['session'])
    self._last_loss[:] = saved['last_loss']


def train_roles(
  run,
  shared: SharedSettings,
  roles: Sequence[StageRole],
  title: str,
  *,
  agreement_every: int = 0,
  resumable: bool = False,
) -> dict:
  """Trains `roles` on the scheduler for `train_steps` iterations.

  Step `t` (1-based) is reported when the last stage has applied batch t − 1's
  update (at the simulated time, on the virtual clock); the final step is
  reported after every lane has finished. Writes `trace.json` and `staleness.png`;
  with `agreement_every` (`jaxsgd.pipeline.agreement`), `grad_cosine/stage{k}` in the
  records, and `grad_cosine.png` and `grad_cosine.npz` (every measurement). With
  `resumable` (the virtual clock; the in-process real clock at a drained point),
  checkpoints hold the whole run and a run resumes from one exactly (`algorithms.resume`).
  """
  num_stages, steps = shared.stages, shared.train_steps
  stages = PlacedStages(
    run.model,
    num_stages,
    optimizers.make_optimizer(shared.optimizer, steps),
    placement=clocks.placement(shared, num_stages),
    batch_size=shared.batch_size,
    seed=shared.seed,
    aux_heads=any(r.loss == 'aux' for r in roles),
    optimizer=(shared.optimizer, steps),  # named tasks: lane processes rebuild them
  )
  batches = run.train_batches()
  feed = BatchFeed(batches, consumers=1 + sum(r.loss != 'none' for r in roles))
  executor, _ = clocks.make_executor(
    shared,
    stage_tasks(stages, roles, lambda: feed.peek(0), shared.batch_size),
    KINDS,
    num_stages,
    lane_speeds=shared.cost.speeds,
  )
  last_loss, reported = [], [0]

  def report(step, loss, sim_time):
    reported[0] = step
    run.report(
      step,
      loss=loss,
      variables=session.variables,
      samples=step * shared.batch_size,
      sim_time=sim_time,
      extra=session.metrics,
      stage=f'stage {num_stages - 1}',
    )

  def on_step(t, loss):
    loss = executor.deferred(loss)  # a lane's value: fetched when the report reads it
    if t + 1 < steps:
      report(t + 1, loss, executor.now() if shared.virtual else None)
    else:
      last_loss.append(loss)  # Reported once every lane is done.

  session = stages.session(
    roles,
    feed,
    steps,
    on_step=on_step,
    agreement_every=agreement_every,
    host_batches=shared.on_lane_processes,
  )
  session.fetch = executor.fetch
  processes = session.processes()
  checkpoints = resume = None
  if resumable:
    checkpoints = resume_lib.SimulationCheckpoints(
      run, executor, _Saved(session, last_loss), processes, [batches], lambda: reported[0]
    )
    resume = checkpoints.restore()
  try:
    timeline = executor.run(session.cluster, processes, resume=resume)
    if checkpoints is None or checkpoints.resumed_step != steps:  # Else reported already.
      report(steps, last_loss[0], timeline.makespan if shared.virtual else None)
    if checkpoints is not None:
      checkpoints.after_run()
  finally:
    executor.close()  # lane processes (executor='processes') end here
  if session.agreement is not None:
    steps_, cosines = session.agreement.series()
    run.write_agreement(steps_, cosines, title=title.split(':')[0])
  return run.write_schedule_outputs(
    timeline,
    session.staleness(),
    cost_table=clocks.cost_table(executor),
    epochs=batches.epoch,
    title=title,
    extra=clocks.executor_summary(executor),
  )
