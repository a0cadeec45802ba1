"""`bp`: plain backpropagation with one fused `jax.jit` train step (the baseline).

    w ← w − η · OptaxUpdate(∇_w L(w; ξ_t))

With `stages > 1`, the virtual clock or lane processes (`executor='processes'`: one
stage on one lane process), the same algorithm runs stage by stage on the scheduler
instead (see `jaxsgd.scheduler`), which every layer-wise method is checked against.
"""

import dataclasses

import jax
import optax

from jaxsgd import optimizers
from jaxsgd.algorithms import pipelined
from jaxsgd.algorithms.settings import SharedSettings, derived, section
from jaxsgd.models import stage_functions
from jaxsgd.pipeline import sequential_roles


@dataclasses.dataclass(frozen=True)
class Settings:
  """`bp` has no fields of its own; the shared ones are in `shared`."""

  shared: SharedSettings | None = derived()

  @property
  def uses_scheduler(self) -> bool:
    """Staged BP on the scheduler (several stages, simulated time, or lane processes:
    one stage is then one lane process)."""
    return self.shared.stages > 1 or self.shared.virtual or self.shared.on_lane_processes

  @property
  def resumable(self) -> bool:
    """The fused loop checkpoints (`run.maybe_save`) and resumes exactly; so does staged
    BP on the virtual clock (the whole simulation) and on the real clock (at a drained
    point, in one process or on lanes)."""
    return True


def validate(config, model) -> Settings:
  section(config.algorithm, Settings, 'algorithm')
  return Settings(shared=pipelined.validate_pipeline(config, model))


def make_train_step(model, tx):
  """Jitted `(variables, opt_state, batch) -> (variables, opt_state, loss)`."""

  def loss_fn(params, state, batch):
    logits, new_state = stage_functions.apply_train(model.full(), params, state, batch['image'])
    return stage_functions.cross_entropy(logits, batch['label']), new_state

  @jax.jit
  def train_step(variables, opt_state, batch):
    params, state = stage_functions.split_variables(variables)
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {'params': optax.apply_updates(params, updates), **new_state}, opt_state, loss

  return train_step


def train(run, settings: Settings) -> dict:
  """Trains `train_steps` fused steps on worker 0's batch stream.

  With `stages > 1`, `clock='virtual'` or `executor='processes'`: staged BP on the
  scheduler instead (`jaxsgd.pipeline.sequential_roles`), the same updates stage by
  stage.
  """
  s = settings.shared
  if settings.uses_scheduler:
    return pipelined.train_roles(
      run,
      s,
      sequential_roles(s.stages),
      title='bp: staleness per stage',
      resumable=settings.resumable,
    )
  tx = optimizers.make_optimizer(s.optimizer, s.train_steps)
  variables = run.model.init(jax.random.key(s.seed))
  opt_state = tx.init(variables['params'])
  train_step = make_train_step(run.model, tx)
  batches = run.train_batches()
  start = 0
  resumed = run.restore((variables, opt_state), [batches])
  if resumed is not None:
    start, (variables, opt_state) = resumed
  for step in range(start + 1, s.train_steps + 1):
    variables, opt_state, loss = train_step(variables, opt_state, next(batches))
    run.report(step, loss=loss, variables=variables, samples=step * s.batch_size)
    run.maybe_save(step, (variables, opt_state), [batches])
  return {'epochs': batches.epoch}
