"""`bp`: plain backpropagation with one fused `jax.jit` train step (the baseline).

    w ← w − η · OptaxUpdate(∇_w L(w; ξ_t))

With `stages > 1` or the virtual clock, the same algorithm runs stage by stage
on the scheduler instead (see `jaxsgd.scheduler`), which every layer-wise method
is checked against.
"""

import jax
import optax

from jaxsgd import stages as stages_lib
from jaxsgd.algorithms import Algorithm
from jaxsgd.scheduler import pipeline
from jaxsgd.training import optimizers


def uses_scheduler(config) -> bool:
  """Staged BP on the scheduler (several stages, or simulated time)."""
  return config.stages > 1 or config.clock == 'virtual'


def validate(config, model) -> None:
  optimizers.check_optimizer(config.optimizer)
  if uses_scheduler(config):
    pipeline.check_config(config, model)


def make_train_step(model, tx):
  """Jitted `(variables, opt_state, batch) -> (variables, opt_state, loss)`."""
  def loss_fn(params, state, batch):
    logits, new_state = stages_lib.apply_train(model.full(), params, state, batch['image'])
    return stages_lib.cross_entropy(logits, batch['label']), new_state

  @jax.jit
  def train_step(variables, opt_state, batch):
    params, state = stages_lib.split_variables(variables)
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {'params': optax.apply_updates(params, updates), **new_state}, opt_state, loss

  return train_step


def run(run_ctx) -> dict:
  """Trains `config.train_steps` fused steps on worker 0's batch stream.

  With `stages > 1` or `clock='virtual'`: staged BP on the scheduler instead
  (`jaxsgd.scheduler.pipeline.sequential_roles`), the same updates stage by stage.
  """
  config = run_ctx.config
  if uses_scheduler(config):
    return pipeline.train(run_ctx, pipeline.sequential_roles(config.stages))
  tx = optimizers.make_optimizer(config.optimizer, config.train_steps)
  variables = run_ctx.model.init(jax.random.key(config.seed))
  opt_state = tx.init(variables['params'])
  train_step = make_train_step(run_ctx.model, tx)
  batches = run_ctx.train_batches()
  for step in range(1, config.train_steps + 1):
    variables, opt_state, loss = train_step(variables, opt_state, next(batches))
    run_ctx.report(step, loss=loss, variables=variables, samples=step * config.batch_size)
  return {'epochs': batches.epoch}


ALGORITHM = Algorithm('bp', validate, run)
