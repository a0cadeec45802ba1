"""DaSGD's all-reduce does not depend on the current step's gradients (compiled HLO).

The compiled SPMD step is read back (`jaxsgd.spmd.hlo`): for each all-reduce we
collect the jitted step's arguments it transitively depends on. For DaSGD
(delay >= 1) that is the snapshot in the optimizer state only — not the batch, not
the weights being trained — so XLA is free to run it during the forward/backward
pass. SSGD and local SGD without delay must depend on the batch: the check can fail.
"""

import numpy as np
import optax
import pytest

from jaxsgd import models
from jaxsgd import transforms
from jaxsgd.spmd import DataParallelTrainer
from jaxsgd.spmd import hlo

M = 4


@pytest.fixture(scope='module')
def model():
  return models.get_model('mlp', (12,), 5, hidden=(16,))


def compiled_text(model, tx, *, average_grads=False):
  trainer = DataParallelTrainer(model, tx, M, average_grads=average_grads)
  state = trainer.init(0)
  batch = trainer.put_batch(
    [{'image': np.zeros((2, 12), np.float32), 'label': np.zeros(2, np.int32)}] * M
  )
  return trainer.step.lower(state.variables, state.opt_state, batch).compile().as_text()


def reads(deps, prefix):
  return any(d.startswith(prefix) for d in deps)


@pytest.mark.parametrize('overlap', [True, False])
def test_dasgd_allreduce_reads_only_the_snapshot(model, overlap):
  tx = transforms.local_sgd(optax.sgd(0.1), period=4, delay=1, axis_name='data', overlap=overlap)
  sites = hlo.collective_inputs(compiled_text(model, tx))
  assert sites, 'no all-reduce in the compiled DaSGD step'
  for deps in sites:
    assert not reads(deps, 'batch'), deps
    assert not reads(deps, 'variables'), deps  # The weights this step trains.
    assert reads(deps, 'opt_state'), deps
    snapshot_or_count = [d for d in deps if 'snapshot' in d or d.endswith('.count')]
    assert sorted(snapshot_or_count) == sorted(deps), deps


def test_dasgd_allreduce_is_scheduled_among_the_compute(model):
  """Where XLA:CPU put it: at least one dot of this step runs after the all-reduce."""
  tx = transforms.local_sgd(optax.sgd(0.1), period=4, delay=1, axis_name='data')
  ((before, after),) = hlo.compute_around_collectives(compiled_text(model, tx))
  assert after >= 1, (before, after)


@pytest.mark.parametrize('name', ['ssgd', 'local_sgd'])
def test_synchronous_allreduce_depends_on_the_batch(model, name):
  if name == 'ssgd':
    text = compiled_text(model, optax.sgd(0.1), average_grads=True)
  else:
    text = compiled_text(model, transforms.local_sgd(optax.sgd(0.1), period=4, axis_name='data'))
  sites = hlo.collective_inputs(text)
  assert sites and all(reads(deps, 'batch') for deps in sites), sites
