"""A whole period as one program: one all-reduce per period, the same arithmetic.

`DataParallelTrainer(..., period=τ, delay=d)` runs each period of a local method
(`overlap=True`) as one jitted program (`jaxsgd.spmd.step.make_worker_period`).
Checked here on the compiled HLO (`jaxsgd.spmd.hlo.collective_count`): it executes
exactly one all-reduce per period, at top level, reading only the stored snapshot
(delay >= 1), where the per-step program executes one per step. And it computes
what the per-step program computes.

Tolerance: the period program equals M independent SGD workers BIT FOR BIT on the
steps without a merge (`test_first_period_is_bit_exact_...`). The per-step program
does not: XLA:CPU compiles its `params + select(is_merge, u + (w̄ − s), u)` with
different rounding on the non-merge steps (≤ 6e-8 on O(1) weights, measured), so
the two programs are compared at the tolerance of the other equivalence tests
(rtol 1e-6, atol 1e-7), which a one-step error in the schedule fails
(`test_tolerance_can_fail`).
"""

import chex
import jax
import numpy as np
import optax
import pytest
import spmd_helpers
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsgd import models
from jaxsgd import transforms
from jaxsgd.algorithms import backprop
from jaxsgd.spmd import DataParallelTrainer
from jaxsgd.spmd import hlo
from jaxsgd.spmd import mesh as mesh_lib

M, B, STEPS, LR = 4, 8, 9, 0.3
RTOL, ATOL = 1e-6, 1e-7


@pytest.fixture(scope='module')
def model():
  return spmd_helpers.small_mlp()


@pytest.fixture(scope='module')
def batches():
  """STEPS steps of per-worker batches: `batches[t][m]`."""
  return spmd_helpers.worker_batches(STEPS, M, B)


def make_tx(kind, period, delay, overlap=True, merge='keep_local'):
  kwargs = dict(
    period=period, delay=delay, axis_name='data', merge=merge, mix=0.25, overlap=overlap
  )
  if kind == 'diloco':
    return transforms.diloco(optax.sgd(LR), optax.sgd(0.7, momentum=0.9, nesterov=True), **kwargs)
  return transforms.local_sgd(optax.sgd(LR, momentum=0.5), **kwargs)


def run(trainer, batches, steps=STEPS, stops=lambda step: False):
  """Trains `steps` steps as the training loop does; (state, per-step losses)."""
  state, losses, done = trainer.init(0), [], 0
  while done < steps:
    n = trainer.program_length(done, steps, stops)
    state, step_losses = trainer.train_steps(state, batches[done : done + n])
    losses += step_losses
    done += n
  return jax.device_get((state.variables, state.opt_state)), np.asarray(jax.device_get(losses))


CASES = [  # (kind, period, delay, merge)
  ('local_sgd', 4, 1, 'keep_local'),  # DaSGD, paper merge
  ('local_sgd', 4, 3, 'keep_local'),
  ('local_sgd', 3, 2, 'mix'),  # DaSGD, public-code merge
  ('local_sgd', 3, 0, 'keep_local'),  # local SGD: the merge is the last step
  ('diloco', 2, 1, 'mix'),  # overlapped DiLoCo
]


@pytest.mark.parametrize('stacked', [False, True], ids=['mesh', 'stacked'])
@pytest.mark.parametrize('kind, period, delay, merge', CASES)
def test_period_program_equals_per_step_program(
  model, batches, stacked, kind, period, delay, merge
):
  tx = make_tx(kind, period, delay, merge=merge)
  per_step = DataParallelTrainer(model, tx, M, average_grads=False, stacked=stacked)
  per_period = DataParallelTrainer(
    model, tx, M, average_grads=False, stacked=stacked, period=period, delay=delay
  )
  (state_a, losses_a), (state_b, losses_b) = run(per_step, batches), run(per_period, batches)
  chex.assert_trees_all_close(state_b, state_a, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(losses_b, losses_a, rtol=RTOL, atol=ATOL)
  assert losses_b.shape == (STEPS,)  # Every step's loss comes out, also the remainder's.


def test_first_period_is_bit_exact_with_independent_sgd_workers(model, batches):
  """No merge before step τ: the period program is M plain SGD workers, bit for bit."""
  period = 4
  trainer = DataParallelTrainer(
    model, make_tx('local_sgd', period, 1), M, average_grads=False, period=period, delay=1
  )
  (variables, _), losses = run(trainer, batches, steps=period)
  tx = optax.sgd(LR, momentum=0.5)
  step = backprop.make_train_step(model, tx)
  for m in range(M):
    v = model.init(jax.random.key(0))
    o = tx.init(v['params'])
    for t in range(period):
      v, o, loss = step(v, o, batches[t][m])
      if m == 0:
        assert losses[t] == float(loss)
    chex.assert_trees_all_equal(jax.tree.map(lambda x, m=m: x[m], variables), jax.device_get(v))


def test_tolerance_can_fail(model, batches):
  """A merge one step late (delay 2 instead of 1) is far outside the tolerance."""
  a = DataParallelTrainer(
    model, make_tx('local_sgd', 4, 1), M, average_grads=False, period=4, delay=1
  )
  b = DataParallelTrainer(
    model, make_tx('local_sgd', 4, 2), M, average_grads=False, period=4, delay=2
  )
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(run(a, batches)[0], run(b, batches)[0], rtol=RTOL, atol=ATOL)


def test_evaluation_points_inside_a_period_run_step_by_step(model, batches):
  """Stops (evaluations) need that step's weights: the period around them runs per step."""
  trainer = DataParallelTrainer(
    model, make_tx('local_sgd', 4, 1), M, average_grads=False, period=4, delay=1
  )
  stops = lambda step: step % 6 == 0
  lengths, done = [], 0
  while done < 17:
    lengths.append(trainer.program_length(done, 17, stops))
    done += lengths[-1]
  # Steps 1-4 whole; 5-8 hold the stop at 6 (step by step); 9-12 whole (12 is its
  # last step); 13-16 whole; 17 is the remainder.
  assert lengths == [4, 1, 1, 1, 1, 4, 4, 1]
  chex.assert_trees_all_close(
    run(trainer, batches, stops=stops)[0], run(trainer, batches)[0], rtol=RTOL, atol=ATOL
  )


def compiled(trainer, state, batches, period):
  if period is None:
    return (
      trainer.step.lower(state.variables, state.opt_state, trainer.put_batch(batches[0]))
      .compile()
      .as_text()
    )
  return (
    trainer.period_step.lower(
      state.variables, state.opt_state, trainer.put_batches(batches[:period])
    )
    .compile()
    .as_text()
  )


@pytest.mark.parametrize('kind, period, delay, merge', CASES)
def test_one_allreduce_per_period_in_the_compiled_program(
  model, batches, kind, period, delay, merge
):
  tx = make_tx(kind, period, delay, merge=merge)
  trainer = DataParallelTrainer(model, tx, M, average_grads=False, period=period, delay=delay)
  state = trainer.init(0)
  text = compiled(trainer, state, batches, period)
  assert hlo.collective_count(text) == {'top_level': 1, 'in_loops': 0, 'in_conditionals': 0}
  (deps,) = hlo.collective_inputs(text)
  if delay:  # The stored snapshot only: not the batches, not the weights being trained.
    assert deps and all(d.startswith('opt_state') and 'snapshot' in d for d in deps), deps
  else:  # Local SGD averages the last step's weights: it must wait for the batches.
    assert any(d.startswith('batches') for d in deps), deps
  # The per-step program (the form before): one all-reduce every step, τ per period.
  per_step = hlo.collective_count(compiled(trainer, state, batches, None))
  assert per_step == {'top_level': 1, 'in_loops': 0, 'in_conditionals': 0}


def test_lock_step_form_keeps_its_conditional_allreduce(model, batches):
  """overlap=False: the per-step program, all-reduce inside the merge step's cond."""
  trainer = DataParallelTrainer(
    model, make_tx('local_sgd', 4, 1, overlap=False), M, average_grads=False
  )
  text = compiled(trainer, trainer.init(0), batches, None)
  assert hlo.collective_count(text) == {'top_level': 0, 'in_loops': 0, 'in_conditionals': 1}


def test_collective_count_weights_loops_by_their_trip_count():
  mesh = mesh_lib.data_mesh(M)

  def body(x, _):
    return x + lax.psum(x, 'data'), None

  def program(x):
    return lax.scan(body, x, None, length=3)[0]

  mapped = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P('data'), out_specs=P('data')))
  text = mapped.lower(np.ones((M, 2), np.float32)).compile().as_text()
  assert hlo.collective_count(text) == {'top_level': 0, 'in_loops': 3, 'in_conditionals': 0}


def test_bad_caller_arguments_are_refused():
  tx = transforms.delayed_averaging(period=3, delay=0)
  w = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match=r'average: with delay = 0'):
    tx.update(w, tx.init(w), w, average=w)
  tx = transforms.delayed_averaging(period=3, delay=1)
  with pytest.raises(TypeError, match=r'may_merge must be a Python bool'):
    tx.update(w, tx.init(w), w, may_merge=np.bool_(False))
  with pytest.raises(ValueError, match=r'whole-period programs are for the local methods'):
    DataParallelTrainer(
      models.get_model('mlp', (12,), 5, hidden=(16,)),
      optax.sgd(0.1),
      M,
      average_grads=True,
      period=4,
    )


def test_per_step_losses_come_out_of_the_period_at_their_step(model, batches):
  """A NaN example in worker 0's batch of step 6 (inside the 2nd period) shows at step 6."""
  poisoned = [list(step) for step in batches]
  poisoned[5][0] = dict(poisoned[5][0], image=np.full_like(poisoned[5][0]['image'], np.nan))
  trainer = DataParallelTrainer(
    model, make_tx('local_sgd', 4, 1), M, average_grads=False, period=4, delay=1
  )
  _, losses = run(trainer, poisoned, steps=8)
  assert np.isfinite(losses[:5]).all() and np.isnan(losses[5:]).all(), losses


def test_non_finite_loss_stops_a_run_of_period_programs(data_dir, tmp_path):
  from experiments.configs import dasgd as dasgd_config
  from jaxsgd import training

  config = dasgd_config.get_config('smoke')
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.optimizer.name, config.optimizer.learning_rate = 'sgd', 1e12
  with pytest.raises(
    training.NonFiniteLossError,
    match=r'training loss became (nan|inf) at step \d+ at stage/worker worker 0',
  ):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
