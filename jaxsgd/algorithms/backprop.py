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
from jaxsgd.training import optimizers


def validate(config, model) -> None:
  del model
  optimizers.check_optimizer(config.optimizer)


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
  """Trains `config.train_steps` fused steps on worker 0's batch stream."""
  config = run_ctx.config
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
