"""Task factories for the lane tests: module-level, built inside each lane process."""

import os
import time

import jax
import numpy as np
import jax.numpy as jnp


def layer(w, x):
  return jnp.tanh(x @ w)


class SlowToReport(ValueError):
  """A task's error that takes `seconds` to pickle: its lane has marked the call failed
  well before Ray has the error to give the driver."""

  def __init__(self, seconds: float):
    super().__init__(f'failed, reported after {seconds} s')
    self.seconds = seconds

  def __reduce__(self):
    time.sleep(self.seconds)
    return SlowToReport, (self.seconds,)


def build_layer_tasks(scale: float):
  """A dense tanh layer: init, forward (with its VJP), backward, and a few probes."""

  def init(seed):
    return scale * jax.random.normal(jax.random.key(seed), (8, 4))

  def forward(w, x):
    y, vjp = jax.vjp(layer, w, x)
    return y, vjp

  def backward(vjp, g):
    return vjp(g)

  def by_shape(w, x):  # a VJP for batches of more than 2 rows, else arrays only
    if x.shape[0] > 2:
      return jax.vjp(layer, w, x)
    return layer(w, x), jnp.zeros(())

  def loss(w, x):  # an array, one number, and a key (one value, not a number)
    y = layer(w, x)
    return y, jnp.sum(y * y), jax.random.key(0)

  def fail(x):
    raise ValueError(f'bad input of shape {x.shape}')

  def fail_if_positive(x):  # slow to report (`SlowToReport`); shaped as its input if not
    if np.asarray(x).sum() > 0:
      raise SlowToReport(3.0)
    return x

  def hang(seconds):
    time.sleep(seconds)
    return jnp.zeros(())

  def spin(seconds):  # computes until its process has used `seconds` more of CPU
    until = time.process_time() + seconds
    while time.process_time() < until:
      pass
    return jnp.zeros(())

  return {
    'init': jax.jit(init),
    'forward': jax.jit(forward),
    'backward': jax.jit(backward),
    'by_shape': jax.jit(by_shape),
    'add': jax.jit(lambda a, b: a + b),
    'loss': jax.jit(loss),
    'same': lambda v: v,
    'fail': fail,
    'fail_if_positive': fail_if_positive,
    'hang': hang,
    'spin': spin,
    'pid': os.getpid,
    'affinity': lambda: np.array(sorted(os.sched_getaffinity(0))),
    'thread_affinities': thread_affinities,
    'env': lambda name: os.environ.get(name, ''),
    'jax_flag': lambda name: str(getattr(jax.config, name)),
    'device_count': jax.device_count,
  }


def thread_affinities() -> str:
  """The cores each thread of this process may run on (Linux: a thread's
  `sched_getaffinity` by its id), sorted, as text: `0|0|1` for three threads (a lane's
  task returns one structure for every call; a list's length would change)."""
  cores = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')]
  return '|'.join(sorted(','.join(map(str, mine)) for mine in cores))


BUILT = []  # the tags of the `build_noted_tasks` recipes built in this process, in order


def build_noted_tasks(tag: str):
  """A recipe that notes its build in this process (`BUILT`); its task `built` returns
  the tags built so far. Tag 'broken' cannot be built."""
  if tag == 'broken':
    raise ValueError('the broken recipe cannot be built')
  BUILT.append(tag)
  return {'built': lambda: ' '.join(BUILT)}
