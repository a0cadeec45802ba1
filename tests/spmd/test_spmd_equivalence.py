"""Exact equivalences of the data-parallel methods (docs/algorithms.md: equivalences are the tests).

A small MLP on random data; M = 4 workers on 4 of the 8 fake CPU devices. Float32
results agree to float reassociation (the mesh all-reduce sums in another order
than a mean over a concatenated batch); the tolerances are tight enough that one
wrong step, a missed average or a wrong delay fails them (see
`test_tolerance_can_fail`).
"""

import chex
import jax
import numpy as np
import optax
import pytest
import spmd_helpers

from experiments.configs import dasgd as dasgd_config
from jaxsgd.algorithms import backprop
from jaxsgd.algorithms import data_parallel
from jaxsgd.spmd import DataParallelTrainer

M, B, STEPS = 4, 8, 6
RTOL, ATOL = 1e-6, 1e-7


@pytest.fixture(scope='module')
def model():
  return spmd_helpers.small_mlp()


@pytest.fixture(scope='module')
def batches():
  """STEPS steps of per-worker batches: `batches[t][m]`."""
  return spmd_helpers.worker_batches(STEPS, M, B)


def _config(name, **algorithm):
  config = dasgd_config.get_config('smoke')
  config.algorithm.name = name
  config.algorithm.delay = 1 if name == 'dasgd' else 0
  config.optimizer.name, config.optimizer.schedule = 'sgd', 'constant'
  config.optimizer.learning_rate = 0.3
  config.workers = M
  config.batch_size = B
  for key, value in algorithm.items():
    config.algorithm[key] = value
  return config


_RUNS = {}


def train(model, batches, name, **algorithm):
  """Per-worker params [M, ...] after STEPS steps of the algorithm's own optimizer and
  trainer (memoized: several tests compare with the same run)."""
  key = (id(model), id(batches), name, repr(sorted(algorithm.items())))
  if key not in _RUNS:
    _RUNS[key] = _train(model, batches, name, **algorithm)
  return _RUNS[key]


def _train(model, batches, name, **algorithm):
  config = _config(name, **algorithm)
  s = data_parallel.settings(config)
  trainer = DataParallelTrainer(
    model, data_parallel.make_optimizer(s), M, average_grads=name == 'ssgd', stacked=s.stacked
  )
  state = trainer.init(config.seed)
  for t in range(STEPS):
    state, _ = trainer.train_step(state, trainer.put_batch(batches[t]))
  params = jax.device_get(state.variables['params'])
  if trainer.replicated:
    params = jax.tree.map(lambda x: np.broadcast_to(x, (M,) + x.shape), params)
  return params


def sequential(model, batches, lr=0.3):
  """Plain SGD on the concatenated global batch (the BP step of `bp`)."""
  tx = optax.sgd(lr)
  variables = model.init(jax.random.key(0))
  opt_state = tx.init(variables['params'])
  step = backprop.make_train_step(model, tx)
  for t in range(STEPS):
    global_batch = jax.tree.map(lambda *xs: np.concatenate(xs), *batches[t])
    variables, opt_state, _ = step(variables, opt_state, global_batch)
  return jax.device_get(variables['params'])


def close(a, b):
  chex.assert_trees_all_close(a, b, rtol=RTOL, atol=ATOL)


def test_ssgd_equals_sequential_sgd_on_the_concatenated_batch(model, batches):
  ssgd = train(model, batches, 'ssgd')
  reference = sequential(model, batches)
  close(jax.tree.map(lambda x: x[0], ssgd), reference)


def test_dasgd_delay0_period1_equals_ssgd(model, batches):
  close(train(model, batches, 'dasgd', delay=0, period=1), train(model, batches, 'ssgd'))


def test_local_sgd_period1_equals_ssgd(model, batches):
  close(train(model, batches, 'local_sgd', period=1), train(model, batches, 'ssgd'))


def test_diloco_with_outer_sgd1_equals_local_sgd(model, batches):
  config = _config('diloco')
  config.algorithm.outer.learning_rate = 1.0
  config.algorithm.outer.kwargs = {}
  diloco = train(model, batches, 'diloco', period=3, outer=config.algorithm.outer)
  close(diloco, train(model, batches, 'local_sgd', period=3))


@pytest.mark.parametrize('name, fields', [('ssgd', {}), ('dasgd', {'period': 2, 'delay': 1})])
def test_stacked_form_equals_mesh_form(model, batches, name, fields):
  close(train(model, batches, name, stacked=True, **fields), train(model, batches, name, **fields))


def _dasgd_reference(model, batches, period, delay, lr=0.3):
  """M independent SGD workers + the DaSGD merge in numpy (Zhou et al. 2020, Alg. 1)."""
  tx = optax.sgd(lr)
  step = backprop.make_train_step(model, tx)
  start = model.init(jax.random.key(0))
  workers = [(start, tx.init(start['params'])) for _ in range(M)]
  snapshots = None
  for t in range(1, STEPS + 1):
    workers = [step(v, o, batches[t - 1][m])[:2] for m, (v, o) in enumerate(workers)]
    params = [jax.device_get(v['params']) for v, _ in workers]
    if t % period == 0:
      snapshots = params
    if t >= period and t % period == delay:  # w ← mean(s) + (w − s)
      mean = jax.tree.map(lambda *s: np.mean(s, axis=0), *snapshots)
      params = [
        jax.tree.map(lambda a, w, s: a + (w - s), mean, p, s) for p, s in zip(params, snapshots)
      ]
      workers = [({'params': p}, o) for p, (_, o) in zip(params, workers)]
  return jax.tree.map(lambda *ws: np.stack(ws), *[jax.device_get(v['params']) for v, _ in workers])


def test_dasgd_equals_independent_workers_with_delayed_merge(model, batches):
  close(
    train(model, batches, 'dasgd', period=2, delay=1),
    _dasgd_reference(model, batches, period=2, delay=1),
  )


def test_tolerance_can_fail(model, batches):
  """A one-step-late average (delay 1 instead of 0) is far outside the tolerance."""
  with pytest.raises(AssertionError):
    close(
      train(model, batches, 'dasgd', period=2, delay=1),
      train(model, batches, 'local_sgd', period=2),
    )
