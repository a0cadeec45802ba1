r"""`async_local_sgd`: asynchronous local SGD with Delayed Nesterov outer steps.

M workers (`config.workers`) and a server, on the parameter server of `asgd`
(`jaxsgd.asynchronous.server`: its lanes, channels, versioned store and clocks). Worker m
pulls θ, runs H = `algorithm.inner_steps` steps of the inner optimizer (`config.optimizer`,
AdamW in the paper) on its own batches, and pushes its pseudo-gradient; the server applies
each push the moment it arrives with `transforms.delayed_nesterov` and the reply is the
worker's next pull:

    worker m:  θ_m ← θ (its pull);  H times: θ_m ← θ_m + inner(∇ℓ(θ_m));  push Δ = θ − θ_m
    server, the t-th push Δ_t (ε, β: algorithm.outer_*, N: algorithm.momentum_every):
      A ← A + Δ_t
      t mod N ≠ 0:  θ ← θ − ε Δ_t / N                                  (momentum not applied)
      t mod N = 0:  m ← A / N + β m;  θ ← θ − ε (Δ_t / N + β m);  A ← 0

Choices the paper leaves open, made here: each worker keeps its inner optimizer state
across its rounds (as DiLoCo's workers do); the outer learning rate is constant; N = M
when `momentum_every` is 0 (the paper's default); `train_steps` counts server updates
(pushes applied), each worth H batches of samples; the inner schedule runs over a worker's
share of the inner steps, `train_steps · H / M`. Every worker runs the same H (the
paper's dynamic local updates, H per worker speed, are not built). The staleness of a push
is the number of server updates between its pull and its arrival.

Costs: a worker's inner update and the server's outer update share the cost key
`(0, 'update')`, priced by the inner update (the costlier: AdamW and Δ against DN's few
element-wise operations).

Reference:
  B. Liu, R. Chhaparia, A. Douillard, S. Kale, A. A. Rusu, J. Shen, A. Szlam, M. Ranzato.
  Asynchronous Local-SGD Training for Language Modeling. 2024. arXiv:2401.09135 (Sec. 4).
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxsgd import optimizers, transforms
from jaxsgd.algorithms import clocks, pipelined, workers
from jaxsgd.algorithms.settings import SharedSettings, derived, integer, placed_lanes
from jaxsgd.algorithms.settings import number, section
from jaxsgd.asynchronous import common
from jaxsgd.asynchronous.server import STALE, AsgdSession, ParameterServer, Push, WorkerFailed
from jaxsgd.asynchronous.server import lane_names, make_apply
from jaxsgd.models import stage_functions
from jaxsgd.pipeline import KINDS, sequential_roles
from jaxsgd.scheduler import profile_lookup, transfer
from jaxsgd.scheduler.core import Compute, Put, Send
from jaxsgd.scheduler.tasks import Task, TaskRecipe

RUN_AHEAD = 1  # as asgd's workers: a push is sent once its pseudo-gradient exists


@dataclasses.dataclass(frozen=True)
class Outer:
  """The server's rule, `transforms.delayed_nesterov(learning_rate, momentum, every)`."""

  learning_rate: float
  momentum: float
  every: int


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `async_local_sgd`, and the shared fields (`shared`).

  Attributes:
    inner_steps: H, a worker's inner steps per push.
    outer_learning_rate: ε (DiLoCo's 0.7).
    outer_momentum: β in [0, 1) (DiLoCo's 0.9).
    momentum_every: N, pushes per momentum step; 0: the number of workers.
  """

  inner_steps: int = 8
  outer_learning_rate: float = 0.7
  outer_momentum: float = 0.9
  momentum_every: int = 0
  outer: Outer | None = derived()
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """Not yet: a worker's local parameters and inner state between pushes are not saved."""
    return False


def validate(config, model) -> Settings:
  settings = section(config.algorithm, Settings, 'algorithm')
  integer(settings.inner_steps, 'algorithm.inner_steps')
  number(settings.outer_learning_rate, 'algorithm.outer_learning_rate', strict=True)
  number(settings.outer_momentum, 'algorithm.outer_momentum', maximum=0.999999)
  every = integer(settings.momentum_every, 'algorithm.momentum_every', minimum=0)
  shared = workers.validate_workers(
    config, model, config.workers, whole_model=True, uses_workers_field=True
  )
  shared = placed_lanes(shared, lambda: lane_names(shared.workers))
  outer = Outer(settings.outer_learning_rate, settings.outer_momentum, every or shared.workers)
  return dataclasses.replace(settings, outer=outer, shared=shared)


def inner_total_steps(settings: Settings) -> int:
  """A worker's share of the inner steps (the inner schedule's length)."""
  shared = settings.shared
  return max(1, shared.train_steps * settings.inner_steps // shared.workers)


# --- named tasks (built again from these settings in a lane process) ---------------------------
def local_tasks(*, optimizer: optimizers.OptimizerSettings, total_steps: int) -> dict:
  """`{'local_step': (θ_m, state, g, θ_pulled) -> (θ_m', state', θ_pulled − θ_m')}`:
  one inner step, and the pseudo-gradient it leaves (the last step's is pushed)."""
  tx = optimizers.make_optimizer(optimizer, total_steps)

  @jax.jit
  def local_step(params, opt_state, grads, pulled):
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, jax.tree.map(jnp.subtract, pulled, params)

  return {'local_step': local_step}


def outer_tasks(*, outer: Outer) -> dict:
  """`{'apply': ...}`: the server's Delayed Nesterov update of a pushed Δ."""
  tx = transforms.delayed_nesterov(outer.learning_rate, outer.momentum, outer.every)
  return {'apply': make_apply(tx, record_pulls=False)}


class AsyncLocalSession(AsgdSession):
  """`AsgdSession` whose workers run H inner steps per pull and push Δ (module docstring)."""

  def __init__(self, *args, inner_steps: int, local_step: Task, inner_states: list, **kwargs):
    super().__init__(*args, **kwargs)
    self.inner_steps, self.local_step, self.inner_states = inner_steps, local_step, inner_states
    for m in range(self.num_workers):  # (`Cluster.declare_tasks`; the rest as ASGD's)
      self.cluster.declare_tasks(1 + m, [local_step])

  def _worker(self, m: int, s):
    device = self.devices[1 + m]
    if getattr(s, 'opt_state', None) is None:  # a new (or rejoined) worker: fresh inner state
      s.opt_state = self.inner_states[m]
    while not s.failed:
      pulled = yield from self._pull(m, s)
      if pulled is common.STOP:
        return
      if pulled is STALE:
        continue
      if pulled is not None:
        s.pulled, s.local, s.state, s.h = pulled, pulled.params, pulled.state, 0
      while s.h < self.inner_steps:
        yield from self._inner_step(m, s, device)
      if self.log.has_failed(m):  # Its pushes stop at its failure time.
        s.failed = True
        break
      if s.enter('push'):
        self.log.pushed(m)
        push = Push(m, s.pulled.version, s.k - 1, s.delta, s.loss, s.state)
        yield Send(self.inbox, push, batch=s.k - 1)
        s.delta = None
    if s.enter('failed'):
      yield Put(self.inbox, WorkerFailed(m))

  def _inner_step(self, m: int, s, device):
    if s.enter('forward'):
      batch = transfer.for_task(next(self.streams[m]), device)
      variables = stage_functions.with_state(s.local, s.state)
      s.forward = yield Compute(
        transfer.HostInputs(self.ops.forward),
        (variables, batch['image'], batch['label']),
        kind='forward',
        stage=0,
        batch=s.k,
      )
    if s.enter('backward'):
      _, s.loss, new_state, vjp = s.forward
      s.forward = None
      s.grads, _ = yield Compute(
        self.ops.backward, (vjp, None), kind='backward', stage=0, batch=s.k
      )
      s.state = new_state if new_state else s.state
    if s.enter('update'):
      args = (s.local, s.opt_state, s.grads, s.pulled.params)
      s.local, s.opt_state, s.delta = yield Compute(
        self.local_step, args, kind='update', stage=0, batch=s.k
      )
      s.grads, s.k, s.h = None, s.k + 1, s.h + 1


def build(run, settings: Settings):
  """(the whole model as one stage, server, model state, lane devices, local step, inner
  states)."""
  shared, num_workers = settings.shared, settings.shared.workers
  devices = clocks.lane_devices(shared, 1 + num_workers)
  total = inner_total_steps(settings)
  inner = optimizers.make_optimizer(shared.optimizer, total)
  model = workers.whole_model(run, shared, inner, devices[0], total)
  params, state = stage_functions.split_variables(
    model.initial_variables(0, sequential_roles(1)[0])
  )
  outer = transforms.delayed_nesterov(
    settings.outer.learning_rate, settings.outer.momentum, settings.outer.every
  )
  apply = Task(TaskRecipe.of(outer_tasks, outer=settings.outer), 'apply')
  server = ParameterServer(
    outer, params, num_workers, devices[0], record_pulls=False, apply_fn=apply
  )
  recipe = TaskRecipe.of(local_tasks, optimizer=shared.optimizer, total_steps=total)
  inner_states = [
    transfer.to_device(inner.init(params), devices[1 + m]) for m in range(num_workers)
  ]
  return model, server, state, devices, Task(recipe, 'local_step'), inner_states


def train(run, settings: Settings) -> dict:
  """Trains `train_steps` server updates (each H inner steps of one worker)."""
  shared, num_workers = settings.shared, settings.shared.workers
  model, server, state, devices, local_step, inner_states = build(run, settings)
  tasks = pipelined.stage_tasks(
    model, sequential_roles(1), lambda: next(run.train_batches(0, 1)), shared.batch_size
  )

  initial = server.store.read().value.params

  def calls():
    # The inner step prices (0, 'update') (module docstring), run where worker 0's runs:
    # beside its inner state, not on the server's device (two devices: refused by jit).
    params = transfer.to_device(initial, devices[1])
    return {**tasks.calls(), (0, 'update'): (local_step, (params, inner_states[0], params, params))}

  executor, measured = clocks.make_executor(
    shared,
    dataclasses.replace(tasks, calls=calls, name=profile_lookup.server_tasks('async_local_sgd')),
    KINDS,
    1,
    lane_speeds=(1.0,) + clocks.worker_speeds(shared, num_workers),
    threads=True,
    devices={'forward': devices[1:], 'backward': devices[1:], 'update': devices},
    run_ahead=RUN_AHEAD,
  )
  log = common.WorkerLog(
    lane_names(num_workers)[1:], clocks.failures(shared, num_workers), executor.now
  )
  streams = [run.train_batches(m, num_workers) for m in range(num_workers)]
  # A server update is worth H batches: samples and epochs count them.
  per_update = dataclasses.replace(shared, batch_size=shared.batch_size * settings.inner_steps)
  return workers.train_session(
    run,
    per_update,
    executor,
    measured,
    log,
    lambda steps: AsyncLocalSession(
      model,
      server,
      state,
      streams,
      devices,
      steps,
      log,
      inner_steps=settings.inner_steps,
      local_step=local_step,
      inner_states=inner_states,
    ),
    name='async_local_sgd',
    title='async_local_sgd: staleness per worker',
    extra=lambda _: {'workers': num_workers, 'inner_steps': settings.inner_steps},
    streams=streams,
    resumable=settings.resumable,
  )
