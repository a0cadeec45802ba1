"""PD-ASGD: sequential equivalence, hand-derived per-layer staleness, atomic updates, failures."""

import types

import chex
import jax
import jax.numpy as jnp
import pytest

from async_helpers import batches, executor, pipeline, run_pd, run_with_timeout, sequential_sgd
from jaxsgd import models
from jaxsgd.algorithms import workers
from jaxsgd.asynchronous import common, pdasgd
from jaxsgd.scheduler.core import Compute, Get, LoopState, Put


@pytest.mark.parametrize('updates', ['block', 'layer'])
def test_one_forward_one_backward_bound_one_is_sequential_sgd(updates):
  """Token bound 1: the forward of batch t + 1 starts after the backward of t ended."""
  pipe = pipeline(3, tx='adam', hidden=(16, 16))
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=1, updates=updates, max_inflight=1)
  session, timeline, _ = run_pd(settings, 8, pipe=pipe)
  params, opt = sequential_sgd(pipe, batches(seed=0), 8)
  for k, layer in enumerate(session.layers):
    chex.assert_trees_all_equal(tuple(layer.read().value), (params[k], opt[k]))
    assert layer.store.staleness().tolist() == [0] * 8
  forwards, backwards = timeline.tasks(lane=1), timeline.tasks(lane=2)
  assert all(b.end <= f.start for b, f in zip(backwards[2::3], forwards[3::3]))  # No overlap.


def _staleness(updates):
  """K = 2 layers, 1 forward : 2 backward workers, F = 1 and B = 2 per layer, bound 3."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=2, updates=updates)
  session, _, _ = run_pd(settings, 8, num_stages=2, ex=executor(num_stages=2))
  return session


def test_layerwise_updates_have_the_hand_derived_staleness():
  """Steady state: batch t's forward reads layer 0 at 2t and layer 1 at 2t + 1; its
  backward runs in [2t + 2, 2t + 6] on one of the two backward workers.
    layer-wise: layer 1 is written at 2t + 4, layer 0 at 2t + 6
      → layer 1 sees one write in (2t + 1, 2t + 4) (batch t − 1's): staleness 1;
        layer 0 sees two in (2t, 2t + 6) (batches t − 2, t − 1): staleness 2.
    block: both written at 2t + 6 → two writes in each window: staleness 2 and 2.
  (Batch t − 3 writes layer 0 at 2t, then returns the token the forward of t waits for.)
  """
  layer, block = _staleness('layer'), _staleness('block')
  assert [s.store.staleness().tolist() for s in layer.layers] == [
    [0, 1, 2, 2, 2, 2, 2, 2],
    [0, 1, 1, 1, 1, 1, 1, 1],
  ]
  assert [s.store.staleness().tolist() for s in block.layers] == [
    [0, 1, 2, 2, 2, 2, 2, 2],
    [0, 1, 2, 2, 2, 2, 2, 2],
  ]
  mean = lambda s: sum(x.store.staleness().sum() for x in s.layers) / 16
  assert mean(layer) == 1.25 < mean(block) == 1.625
  # A forward reads the latest version of each layer: batch 3 saw layer 0 at version 1
  # (batch 0's write at 6) and layer 1 at version 2 (batches 0 and 1, at 4 and 6).
  read = [{u.batch: u.read_version for u in s.store.updates} for s in layer.layers]
  assert (read[0][3], read[1][3]) == (1, 2)


@pytest.mark.parametrize('clock', ['virtual', 'real'])
def test_concurrent_layer_updates_are_never_lost(clock):
  """Three backward workers update the layers concurrently; Adam counts each update."""
  settings = pdasgd.PdSettings(n_fwd=2, n_bwd=3, updates='layer')
  session, _, _ = run_pd(settings, 12, tx='adam', ex=executor(clock, num_stages=3))
  for layer in session.layers:
    assert int(layer.read().value.opt_state[0].count) == len(layer.store.updates) >= 12
  assert session.steps.applied == 12


def test_a_failed_forward_worker_stops_queueing_and_the_run_finishes():
  settings = pdasgd.PdSettings(n_fwd=2, n_bwd=2)
  session, _, log = run_pd(settings, 10, failures={1: 5.0})
  [failed] = log.summary()['failed_workers']
  assert failed['worker'] == 'forward worker 1' and failed['last_push'] < 5.0
  assert max(log.pushes[0]) > 5.0 and session.steps.applied == 10


def test_a_failed_backward_worker_hands_its_batch_back():
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=2)
  session, _, log = run_pd(settings, 10, failures={2: 4.0})  # backward worker 1
  [failed] = log.summary()['failed_workers']
  # Batch 1 reaches it at 6 > 4: it puts the batch back and stops; worker 0 does all.
  assert (failed['worker'], failed['stopped_at'], failed['pushes']) == ('backward worker 1', 6.0, 0)
  assert session.steps.applied == 10
  assert {u.lane for layer in session.layers for u in layer.store.updates} == {2}


def test_when_every_backward_worker_fails_the_run_stops_with_a_clear_error():
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=1)
  outcome = run_with_timeout(lambda: run_pd(settings, 10, failures={1: 0.0}), 60)
  assert isinstance(outcome.get('error'), common.WorkersFailedError), outcome
  assert 'every backward worker failed (cost.failures) after 0 of 10 steps' in str(outcome['error'])


def test_elastic_workers_refuse_a_model_with_batchnorm_statistics():
  """With `tolerate_lost_workers`, BatchNorm statistics would stay in the lane of the
  worker that computed them: ResNet-20 is refused in one line, before any compile; an MLP
  (no statistics) is not, nor ResNet-20 without `tolerate_lost_workers`."""
  elastic = types.SimpleNamespace(tolerate_lost_workers=True)
  resnet = models.get_model('resnet20', (32, 32, 3), 10)
  with pytest.raises(ValueError, match=r'^tolerate_lost_workers: pdasgd keeps BatchNorm statis'):
    workers.refuse_lost_workers_with_model_state(elastic, resnet, 'pdasgd')
  workers.refuse_lost_workers_with_model_state(elastic, models.get_model('mlp', (40,), 10), 'x')
  fixed = types.SimpleNamespace(tolerate_lost_workers=False)
  workers.refuse_lost_workers_with_model_state(fixed, resnet, 'pdasgd')


def _updater_answers(session, requests) -> list[list]:
  """Drives the elastic session's updater by hand: each request in turn, each update it
  yields computed here. For each request, the batches it answered."""
  program = session._updater(LoopState(i=0))
  op, answered = next(program), []
  for request in requests:
    assert isinstance(op, Get) and op.channel is session.updates
    op, answers = program.send(request), []
    while not isinstance(op, Get):
      if isinstance(op, Compute):
        op = program.send(op.fn(*op.args))
      else:
        assert isinstance(op, Put) and op.channel is session.answers[0]
        answers.append(op.value)
        op = program.send(None)
    answered.append(answers)
  return answered


def _request(session, batch, *layers):
  zeros = lambda k: jax.tree.map(jnp.zeros_like, session.layers[k].read().value.params)
  grads = tuple(zeros(k) for k in layers)
  loss = 1.0 if 0 in layers else None
  return pdasgd.UpdateRequest(1, batch, layers, grads, (0,) * len(layers), loss)


def test_the_updater_answers_a_batch_once_all_its_layers_are_applied_in_any_order():
  """Elastic PD-ASGD, 3 layers, 1 forward : 1 backward worker. A worker's requests may
  land out of order (layer 0's before layer 1's); the worker is answered only when the
  batch's last layer is applied — answered at layer 0, it went on, and a layer update
  still on its way died with its lane. A batch sent again by a replaced worker is
  answered at its layer 0, its updates dropped (each (batch, layer) applied once)."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=1)
  steps = common.StepCounter(4)
  session = pdasgd.PdSession(
    pipeline(3),
    settings,
    [batches(seed=0)],
    [jax.devices()[0]] * 3,
    steps,
    common.WorkerLog(['forward worker 0', 'backward worker 0'], {}, lambda: 0.0),
    elastic=True,
  )
  requests = [
    _request(session, 0, 2),
    _request(session, 0, 0),  # landed before layer 1's
    _request(session, 0, 1),
    _request(session, 0, 2),  # the whole batch again, from a replaced worker
    _request(session, 0, 1),
    _request(session, 0, 0),
  ]
  assert _updater_answers(session, requests) == [[], [], [0], [], [], [0]]
  assert [len(layer.store.updates) for layer in session.layers] == [1, 1, 1]
  assert steps.applied == 1
