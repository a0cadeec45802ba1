"""Helpers shared by the scheduler tests: synthetic batches, small pipelines, timeouts."""

import functools
import threading

import jax
import numpy as np
import optax

from jaxsgd import models
from jaxsgd.algorithms import backprop
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles
from jaxsgd.scheduler import CostModel, Placement, VirtualExecutor

FEATURES, CLASSES, BATCH = 12, 4, 16
# F = 1, B = 2, U = 0 seconds: the costs of the hand-computed schedules.
UNIT_COSTS = CostModel({'forward': 1.0, 'backward': 2.0, 'update': 0.0})


def batches(seed: int = 0):
  """An endless stream of synthetic classification batches."""
  rng = np.random.default_rng(seed)
  while True:
    yield {
      'image': rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
      'label': rng.integers(0, CLASSES, BATCH).astype(np.int32),
    }


def take(n: int, seed: int = 0) -> list[dict]:
  stream = batches(seed)
  return [next(stream) for _ in range(n)]


def mlp(hidden=(16, 16)) -> models.StagedModel:
  return models.get_model('mlp', (FEATURES,), CLASSES, hidden=hidden)


OPTIMIZERS = {'sgd': lambda: optax.sgd(0.1), 'adam': lambda: optax.adam(1e-2)}


def make_pipeline(model, roles, tx=None, devices=None, optimizer=None) -> PlacedStages:
  """A fresh pipeline (its jitted functions compile on first use). `optimizer`:
  `(OptimizerSettings, steps)`, the recipe lane processes rebuild `tx` from."""
  num = len(roles)
  placement = Placement.create(num, devices or jax.devices()[:num])
  return PlacedStages(
    model,
    num,
    tx or optax.sgd(0.1),
    placement=placement,
    batch_size=BATCH,
    seed=0,
    aux_heads=any(r.loss == 'aux' for r in roles),
    optimizer=optimizer,
  )


def pipeline_for(roles, *, hidden=(16, 16), tx: str = 'sgd') -> PlacedStages:
  """A pipeline shared by the tests of one process: compiled ops are reused (they are
  keyed by role, and the delay of a role does not change its computation)."""
  return _shared(len(roles), any(r.loss == 'aux' for r in roles), tuple(hidden), tx)


@functools.lru_cache(maxsize=None)
def _shared(num_stages, aux_heads, hidden, tx):
  placement = Placement.create(num_stages, jax.devices()[:num_stages])
  return PlacedStages(
    mlp(hidden),
    num_stages,
    OPTIMIZERS[tx](),
    placement=placement,
    batch_size=BATCH,
    seed=0,
    aux_heads=aux_heads,
  )


def train(pipeline, roles, steps, *, executor=None, idle_fill=None, seed=0):
  """Runs `steps` iterations; returns (session, timeline, losses of the last stage)."""
  feed = BatchFeed(batches(seed), 1 + sum(r.loss != 'none' for r in roles))
  losses = []
  session = pipeline.session(
    roles, feed, steps, on_step=lambda t, loss: losses.append(loss), idle_fill=idle_fill
  )
  executor = executor or VirtualExecutor(UNIT_COSTS)
  timeline = executor.run(session.cluster, session.processes())
  return session, timeline, losses


def fused_bp(model, tx, steps):
  """The fused one-jit BP of `jaxsgd.algorithms.backprop` on the same batches."""
  variables = model.init(jax.random.key(0))
  opt_state = tx.init(variables['params'])
  step = backprop.make_train_step(model, tx)
  for batch in take(steps):
    variables, opt_state, _ = step(variables, opt_state, batch)
  return variables


def stage_params(session) -> list:
  return [store.read().value.params for store in session.stores]


def run_with_timeout(fn, seconds: float):
  """`fn()` in a thread; fails the test if it is still running after `seconds`."""
  outcome = {}

  def target():
    try:
      outcome['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      outcome['error'] = e

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  assert not thread.is_alive(), f'still running after {seconds} s: the run hangs'
  return outcome


def sequential_sgd(pipe: PlacedStages, stream, steps: int):
  """The reference: forward all stages, backward all stages, update every stage."""
  roles = sequential_roles(pipe.num_stages)
  ops = [pipe.ops(k, role) for k, role in enumerate(roles)]
  params = [pipe.initial_variables(k, role)['params'] for k, role in enumerate(roles)]
  opt = [pipe.tx.init(p) for p in params]
  for _ in range(steps):
    batch = next(stream)
    h, vjps = batch['image'], []
    for k in range(pipe.num_stages):
      labels = batch['label'] if k == pipe.num_stages - 1 else None
      h, _, _, vjp = ops[k].forward({'params': params[k]}, h, labels)
      vjps.append(vjp)
    dy = None
    for k in reversed(range(pipe.num_stages)):
      grads, dy = ops[k].backward(vjps[k], dy)
      params[k], opt[k] = ops[k].update(params[k], opt[k], grads)
  return params, opt


def profile_of(**fields):
  """A `profiles.Profile` for tests: neutral metadata (no tables, no dispatch figures),
  with `fields` in its place."""
  from jaxsgd.scheduler import profiles  # pylint: disable=g-import-not-at-top

  defaults = dict(
    model={},
    batch_size=1,
    optimizer='sgd',
    device_kind='cpu',
    platform='cpu',
    jax_version='0',
    date='',
    statistic='median',
    clock='wall',
    pinned=False,
    warmup=1,
    reps=1,
    dispatch={},
    tables=(),
  )
  return profiles.Profile(**{**defaults, **fields})


def host_file(directory, executor: str = 'processes', *, cores: int = 64, **figures) -> str:
  """A host profile (`cost.host`) of `executor` in `directory`: free links and take-ins and
  no host time unless `figures` give them; `cores` more than any test's lanes fill, unless given."""
  import os

  from jaxsgd.scheduler import host

  base = {
    name: float('inf') if name.endswith('_bandwidth') else 0.0 for name in host.FIGURES[executor]
  }
  path = os.path.join(str(directory), f'host-{executor}-{len(os.listdir(directory))}.json')
  host.save(host.make(executor, {**base, **figures}, cores=cores), path)
  return path
