"""Resumable processes (`LoopState`) and the simulation snapshot's encoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsgd.asynchronous import common
from jaxsgd.scheduler import CostModel, VirtualExecutor, snapshot
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Put
from jaxsgd.scheduler.tasks import Task, TaskRecipe


def _program(log, s):
  while s.t < 3:
    if s.enter('get'):
      s.item = yield Get('channel')
      log.append(('got', s.t, s.item))
    if s.enter('tally'):  # No yield: skipped when resuming past it.
      log.append(('tally', s.t))
    if s.enter('compute'):
      s.result = yield Compute(abs, (s.item,))
      s.t += 1


def test_a_program_resumes_at_its_phase_and_yields_the_same_op():
  log, s = [], LoopState(t=0)
  program = _program(log, s)
  assert isinstance(next(program), Get)
  assert isinstance(program.send(-5), Compute)  # Suspended at 'compute' of t = 0.
  assert s.phase == 'compute' and log == [('got', 0, -5), ('tally', 0)]
  again = _program(log, s.resuming())
  op = next(again)  # Straight to the saved phase, no code of earlier phases run again.
  assert isinstance(op, Compute) and op.args == (-5,) and len(log) == 2
  assert isinstance(again.send(5), Get) and s.t == 1 and s.result == 5


def test_a_phase_the_program_never_reaches_is_an_error():
  s = LoopState(t=0)
  s.phase = 'elsewhere'
  with pytest.raises(RuntimeError, match="never reaches phase 'elsewhere'"):
    next(_program([], s.resuming()))


def vjp_tasks() -> dict:
  """A task factory (`TaskRecipe`): a checkpoint names a vjp's task."""
  return {'forward': jax.jit(lambda w, x: jax.vjp(lambda w: jnp.tanh(w * x).sum(), w))}


def test_encode_decode_keeps_bits_types_sharing_and_references():
  cluster = Cluster()
  cluster.add_lane('a')
  channel = cluster.channel('c', 0)
  executor = VirtualExecutor(CostModel({'compute': 1.0}))
  executor.cluster = cluster
  process = Process.resumable('p', 0, lambda s: iter(()), LoopState())
  executor.policy_processes = [process]
  w, x = jnp.asarray([0.5, -1.0, 2.0], jnp.float32), jnp.asarray([1.0, 2.0, 3.0])
  fn = Task(TaskRecipe.of(vjp_tasks), 'forward')
  value, vjp = fn(w, x)
  snapshot.note_vjps(fn, (w, x), (value, vjp))
  weak = jnp.asarray(2.0) * 1  # a weakly typed scalar (from a Python float)
  assert weak.aval.weak_type
  data = {
    'shared': [w, w],
    'weak': weak,
    'empty': jnp.zeros((0, 3)),
    'host': np.arange(5, dtype=np.float64) / 3,
    'vjp': vjp,
    'stop': common.STOP,
    'refs': (process, channel, executor, jax.devices()[0]),
  }
  state = snapshot.encode(data, executor, [process])
  assert len(state['arrays']) == 1 + 1 + 1 + len(jax.tree.leaves(vjp))  # w saved once
  back = snapshot.decode(state, executor, cluster, [process])
  assert back['shared'][0] is back['shared'][1]
  np.testing.assert_array_equal(back['shared'][0], w)
  assert back['weak'].aval.weak_type and back['empty'].shape == (0, 3)
  assert type(back['host']) is np.ndarray and back['host'].dtype == np.float64
  np.testing.assert_array_equal(back['host'], data['host'])
  np.testing.assert_array_equal(back['vjp'](jnp.float32(1.0))[0], vjp(jnp.float32(1.0))[0])
  assert back['stop'] is common.STOP
  assert back['refs'][:3] == (process, channel, executor)


def test_a_vjp_not_made_by_a_task_is_refused():
  executor = VirtualExecutor(CostModel({'compute': 1.0}))
  executor.cluster, executor.policy_processes = Cluster(), []
  _, vjp = jax.vjp(lambda w: (w * w).sum(), jnp.ones(7))
  with pytest.raises(snapshot.NotResumableError, match='not made by a task'):
    snapshot.encode({'vjp': vjp}, executor, [])


def test_a_process_that_is_not_resumable_is_refused():
  cluster = Cluster()
  cluster.add_lane('a')
  channel = cluster.channel('c', 0)

  def waits():
    yield Get(channel)

  def puts_later():
    yield Compute(abs, (1,))
    yield Put(channel, 1)

  executor = VirtualExecutor(CostModel({'compute': 1.0}))
  executor.between_events = lambda: executor.snapshot()
  with pytest.raises(snapshot.NotResumableError, match='waits is not a resumable process'):
    executor.run(cluster, [Process('waits', 0, waits()), Process('puts', 0, puts_later())])
