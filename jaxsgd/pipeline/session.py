"""PlacedStages policies on the scheduler: a model cut into K stages, one lane each.

BP, DDG and local parallelism differ only in the `StageRole` of each stage (which
loss it has, which gradients it receives and sends, how late its backward is);
this module runs any list of roles. Stage `k`'s process, iteration `t`:

    x      = batch t (stage 0)  or  Get(activations[k])        # upstream output of batch t
    snap   = params_k.read()                                   # version v_t
    y, ℓ, vjp = forward(snap, x)                  → Send(activations[k+1], y)
    slots.push((t, v_t, vjp, x))                               # delay line of d_k slots
    (b, v_b, vjp_b, x_b) = slots.pop()                         # batch b = t − d_k
    if t < d_k: continue                                       # pipeline fill: idle slot
    dy     = Get(deltas[k])              if receives_delta     # dL/dy of batch b
    g, dx  = backward(vjp_b, dy)         (role.delayed_backward: or through the kept
                                          activations, or the forward again, at the
                                          current weights v_now)
    Send(deltas[k−1], dx)                if sends_delta
    params_k.write(update(params_k.read(), g), read_version=v_b)   # staleness recorded
    if k == K − 1: report step t + 1 with ℓ

The recorded staleness of an update is the age of what it learns from: the writes
since batch b's forward (v_b), whose input and error signal it uses, in every form.
Where the Jacobian is taken at the current weights, their age (0 writes) is recorded
apart, as the weight staleness (`weight_staleness_mean/stage{k}`).

A stage with a local loss *and* a gradient from downstream (overlapping local
losses) splits its backward: right after the forward, `g_own, dx = backward(vjp_t)`
on the current batch sends its own loss's input gradient upstream at once; then
`g = g_own + vjp_b((dy, 0))` adds the downstream part of batch b = t − d_k.

Activations and deltas are FIFO channels, so "the δ of batch b" is simply the
next one to arrive. Nothing else coordinates the stages: the executor starts a
task when its inputs have arrived and its lane is free, which gives both the
pipelined schedule of the real clock and the simulated one of the virtual clock.
"""

import collections
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxsgd import models as models_lib
from jaxsgd import optimizers
from jaxsgd.errors import NonFiniteLossError
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.scheduler import transfer
from jaxsgd.scheduler import snapshot as snapshot_lib
from jaxsgd.scheduler.core import Cluster, Compute, Get, LoopState, Process, Send
from jaxsgd.pipeline import agreement as agreement_lib
from jaxsgd.pipeline.roles import DELAYED_BACKWARDS, RoleFunctions, StageRole, role_functions
from jaxsgd.scheduler.costs import time_calls
from jaxsgd.scheduler.placement import Placement
from jaxsgd.scheduler.store import VersionedStore
from jaxsgd.scheduler.tasks import Task, TaskRecipe

KINDS = ('forward', 'backward', 'update')  # The task kinds a stage runs (cost keys).
# The functions of a stage in a role (`RoleFunctions` fields), by task name.
STAGE_TASKS = ('forward', 'backward', 'recompute', 'stale_backward', 'delta_backward', 'update')


def stage_tasks(
  *,
  model: models_lib.ModelSpec,
  num_stages: int,
  stage: int,
  role: StageRole,
  optimizer: optimizers.OptimizerSettings,
  total_steps: int,
  batch_size: int,
  aux_heads: bool,
) -> dict[str, Callable]:
  """Stage `stage`'s jitted functions in `role` (`STAGE_TASKS`, plus `jitted` for trace
  counts), built from picklable settings: the factory of a `TaskRecipe`, called once
  per process — in the driver for the in-process clocks, in a lane process otherwise."""
  staged = model.build()
  stages = models_lib.split(staged, num_stages, aux_heads=aux_heads)
  _, outputs = _stage_shapes(staged, stages, batch_size)
  tx = optimizers.make_optimizer(optimizer, total_steps)
  fns = role_functions(stages[stage], role, tx, output=outputs[stage])
  # A model state that stays in a lane reaches a task unmerged (`stages_lib.with_state`).
  return {
    **{name: stages_lib.merging_variables(getattr(fns, name)) for name in STAGE_TASKS},
    'jitted': fns.jitted,
  }


def computation_role(role: StageRole) -> StageRole:
  """`role` with only what its functions depend on (the delay only through the
  backward's form), so that roles differing in delay alone share one recipe."""
  form = role.backward_form
  return StageRole(role.loss, role.receives_delta, role.sends_delta, int(form != 'stored'), form)


def lane_names(num_stages: int) -> list[str]:
  """The session's lanes, one per stage (`stage k`; placement name `stagek`)."""
  return [f'stage {k}' for k in range(num_stages)]


def sequential_roles(num_stages: int) -> tuple[StageRole, ...]:
  """Staged backprop (the reference): the whole gradient, no delay."""
  return tuple(
    StageRole(
      loss='head' if k == num_stages - 1 else 'none',
      receives_delta=k < num_stages - 1,
      sends_delta='total' if k > 0 else 'none',
    )
    for k in range(num_stages)
  )


class StageParams(NamedTuple):
  params: Any
  opt_state: Any


class _Slot(NamedTuple):
  """What a backward needs from its forward: the batch, version, vjp and inputs."""

  batch: int
  version: int
  vjp: Any
  x: Any
  labels: Any


class BatchFeed:
  """Host batch `t` of an iterator, kept until each of its `consumers` took it."""

  def __init__(self, batches: Iterator[dict], consumers: int):
    self._batches = batches
    self._consumers = consumers
    self._cache: dict[int, list] = {}  # t -> [batch, takes left]
    self._pulled = 0
    self._lock = threading.Lock()

  def peek(self, t: int) -> dict:
    with self._lock:
      return self._fetch(t)[0]

  def take(self, t: int, key: str) -> np.ndarray:
    with self._lock:
      entry = self._fetch(t)
      entry[1] -= 1
      if entry[1] == 0:
        del self._cache[t]
      return entry[0][key]

  def snapshot(self) -> dict:
    with self._lock:
      return {'cache': {t: list(entry) for t, entry in self._cache.items()}, 'pulled': self._pulled}

  def load(self, saved: dict) -> None:
    with self._lock:
      self._cache = {int(t): list(entry) for t, entry in saved['cache'].items()}
      self._pulled = saved['pulled']

  def _fetch(self, t):
    while self._pulled <= t:
      self._cache[self._pulled] = [next(self._batches), self._consumers]
      self._pulled += 1
    return self._cache[t]


class PlacedStages:
  """A model cut into stages placed on devices, with their jitted ops.

  Args:
    model: the model to cut.
    num_stages: `K`.
    tx: each stage's optimizer (one state per stage).
    placement: stage → device.
    batch_size: the training batch size (fixes every shape).
    seed: the model is initialized exactly like the fused `bp` (`model.init(key(seed))`);
      auxiliary heads are drawn from the same key.
    aux_heads: give stages auxiliary heads (local losses).
    optimizer: `(OptimizerSettings, total steps)` that `tx` was made from
      (`optimizers.make_optimizer`). With it (and a model from `get_model`, which knows
      its `spec`, and the default loss), a stage's ops are named tasks (`tasks.Task` of
      `stage_tasks`): the same jitted functions in this process, and built again from
      the same settings inside a lane process (`scheduler.process.ProcessExecutor`).
  """

  def __init__(
    self,
    model: models_lib.StagedModel,
    num_stages: int,
    tx: optax.GradientTransformation,
    *,
    placement: Placement,
    batch_size: int,
    seed: int = 0,
    aux_heads: bool = False,
    loss_fn: Callable = stages_lib.cross_entropy,
    optimizer: tuple[optimizers.OptimizerSettings, int] | None = None,
  ):
    named = optimizer is not None and model.spec is not None
    self._recipe = (
      dict(
        model=model.spec,
        num_stages=num_stages,
        optimizer=optimizer[0],
        total_steps=optimizer[1],
        batch_size=batch_size,
        aux_heads=aux_heads,
      )
      if named and loss_fn is stages_lib.cross_entropy
      else None
    )
    self.model, self.tx, self.placement, self.loss_fn = model, tx, placement, loss_fn
    self.num_stages = num_stages
    self.stages = models_lib.split(model, num_stages, aux_heads=aux_heads)
    self.inputs, self.outputs = _stage_shapes(model, self.stages, batch_size)
    self._variables = _initial_variables(model, self.stages, seed)
    self._ops: dict[tuple, RoleFunctions] = {}
    self._cosines: dict[tuple, Callable] = {}

  def device(self, k: int) -> jax.Device:
    return self.placement.device(k)

  def ops(self, k: int, role: StageRole) -> RoleFunctions:
    """Stage k's jitted ops for `role` (built once per distinct role; the delay
    does not change the computation)."""
    key = (k, role.loss, role.receives_delta, role.sends_delta, role.backward_form)
    if key not in self._ops and self._recipe is not None:
      recipe = TaskRecipe.of(stage_tasks, stage=k, role=computation_role(role), **self._recipe)
      self._ops[key] = RoleFunctions(
        *(Task(recipe, name) for name in STAGE_TASKS), traced=lambda: recipe.build()['jitted']
      )
    if key not in self._ops:
      self._ops[key] = role_functions(
        self.stages[k], role, self.tx, output=self.outputs[k], loss_fn=self.loss_fn
      )
    return self._ops[key]

  def initial_variables(self, k: int, role: StageRole):
    """Stage k's initial variables on its device (aux heads only where a role uses one)."""
    variables = self._variables[k]
    if role.loss != 'aux':
      variables = {
        **variables,
        'params': {n: p for n, p in variables['params'].items() if not n.startswith('aux_')},
      }
    return transfer.to_device(variables, self.device(k))

  def session(
    self,
    roles: Sequence[StageRole],
    feed: BatchFeed,
    steps: int,
    *,
    on_step: Callable[[int, Any], None] | None = None,
    idle_fill: str | None = None,
    agreement_every: int = 0,
    host_batches: bool = False,
  ) -> 'PipelineSession':
    return PipelineSession(
      self,
      roles,
      feed,
      steps,
      on_step=on_step,
      idle_fill=idle_fill,
      agreement_every=agreement_every,
      host_batches=host_batches,
    )

  def cosines(self, roles: Sequence[StageRole]) -> Callable:
    """The jitted gradient-agreement measurement of `roles` (`agreement.make_cosines`)."""
    key = tuple(roles)
    if key not in self._cosines:
      self._cosines[key] = agreement_lib.make_cosines(self.stages, roles, self.loss_fn)
    return self._cosines[key]

  def time_tasks(self, roles: Sequence[StageRole], batch: dict, reps: int = 3) -> dict:
    """Seconds per (stage, kind), timing the real jitted calls on `batch` once."""
    return time_calls(self.task_calls(roles, batch), reps)

  def task_calls(self, roles, batch) -> dict:
    """`{(stage, kind): (jitted fn, args)}`: every task of `roles` on one host `batch`."""
    calls, x = {}, transfer.to_device(batch['image'], self.device(0))
    for k, role in enumerate(roles):
      ops, device = self.ops(k, role), self.device(k)
      variables = self.initial_variables(k, role)
      labels = transfer.to_device(batch['label'], device) if role.loss != 'none' else None
      dy = (
        transfer.to_device(np.ones(self.outputs[k].shape, self.outputs[k].dtype), device)
        if role.receives_delta
        else None
      )
      y, _, _, vjp = ops.forward(variables, x, labels)
      backward = {
        'stored': (ops.backward, (vjp, dy)),
        'recompute': (ops.recompute, (variables, x, labels, dy)),
        'stale_graph': (ops.stale_backward, (vjp, variables, x, labels, dy)),
      }[role.backward_form]
      grads, _ = backward[0](*backward[1])
      params, _ = stages_lib.split_variables(variables)
      opt_state = transfer.to_device(self.tx.init(params), device)
      calls[(k, 'forward')] = (ops.forward, (variables, x, labels))
      calls[(k, 'backward')] = backward
      calls[(k, 'update')] = (ops.update, (params, opt_state, grads))
      if y is not None:
        x = transfer.to_device(y, self.device(k + 1))
    return calls


class PipelineSession:
  """One training run of a pipeline: stores, channels and the stage processes.

  `host_batches` (for the process executor only): each batch goes to its stage's task as
  the feed's host arrays, not placed on the stage's device first: a lane process takes
  numpy (the process executor sends it as it is), and placing it on the driver's device
  cost the driver that copy and one back out of it before sending (~220 µs per 3 MB
  batch, most of the driver's CPU per task in `benchmarks/real_speedup.py`'s DDG). An
  in-process executor's tasks take device arrays: there a host batch would be an
  implicit transfer.
  """

  def __init__(
    self,
    pipeline: PlacedStages,
    roles: Sequence[StageRole],
    feed: BatchFeed,
    steps: int,
    *,
    on_step=None,
    idle_fill=None,
    agreement_every: int = 0,
    host_batches: bool = False,
  ):
    check_roles(roles)
    if len(roles) != pipeline.num_stages:
      raise ValueError(f'stages: {len(roles)} roles for {pipeline.num_stages} stages.')
    self.pipeline, self.roles, self.feed, self.steps = pipeline, tuple(roles), feed, steps
    self.on_step = on_step or (lambda t, loss: None)
    if idle_fill not in (None, 'nan'):
      raise ValueError(f'idle_fill: None or "nan", got {idle_fill!r}.')
    self.idle_fill = idle_fill
    self.host_batches = host_batches
    # Values for the driver (logging, evaluation): an executor whose values live in other
    # processes sets its own (`Executor.fetch`).
    self.fetch = lambda value: value
    self.cluster = Cluster()
    self.stores, self.states, self.losses = [], [], []
    # Per stage: writes between reading the weights a Jacobian used and its update.
    self.weight_staleness: list[list[int]] = [[] for _ in self.roles]
    names = lane_names(len(self.roles))
    for k, role in enumerate(self.roles):
      self.cluster.add_lane(
        f'{names[k]} ({pipeline.device(k)})',
        pipeline.device(k),
        shares=pipeline.placement.hardware(k),
      )
      ops = pipeline.ops(k, role)
      self.cluster.declare_tasks(k, [getattr(ops, name) for name in STAGE_TASKS])
      params, state = stages_lib.split_variables(pipeline.initial_variables(k, role))
      opt_state = transfer.to_device(pipeline.tx.init(params), pipeline.device(k))
      self.stores.append(VersionedStore(f'stage {k} params', StageParams(params, opt_state)))
      self.states.append(VersionedStore(f'stage {k} state', state))
      self.losses.append([])
    num = pipeline.num_stages
    # Every `agreement_every` batches: each block's local gradient against backprop's.
    self.agreement = (
      agreement_lib.AgreementProbe(
        pipeline.cosines(self.roles), num, pipeline.device(num - 1), agreement_every
      )
      if agreement_every
      else None
    )
    self.activations = [self.cluster.channel(f'activations → stage {k}', k) for k in range(num)]
    self.deltas = [self.cluster.channel(f'deltas → stage {k}', k) for k in range(num)]

  def processes(self) -> list[Process]:
    """One resumable process per stage (its loop variables in a `LoopState`)."""
    return [
      Process.resumable(
        f'stage {k}',
        k,
        functools.partial(self._stage, k),
        LoopState(
          t=0, dx=None, slots=collections.deque([self._idle_slot(k)] * self.roles[k].delay)
        ),
      )
      for k in range(self.pipeline.num_stages)
    ]

  # --- the stage process (see the module docstring) --------------------------------------
  # Its variables live in `s`, and its steps are phases (`LoopState.enter`; a phase with a
  # yield builds the op from `s` alone), so that a checkpoint saves where it is.
  def _stage(self, k: int, s: LoopState):
    role, ops, device = self.roles[k], self.pipeline.ops(k, self.roles[k]), self.pipeline.device(k)
    last = k == self.pipeline.num_stages - 1
    while s.t < self.steps:
      t = s.t
      if k > 0 and s.enter('input'):
        s.x = yield Get(self.activations[k])
      if s.enter('read'):  # The forward's inputs and weights, at its start.
        probed = self.agreement is not None and self.agreement.wants(t)
        batch = self.feed.peek(t) if probed and k == 0 else None  # Before it is taken.
        batch_device = None if self.host_batches else device
        if k == 0:
          s.x = transfer.to_device(self.feed.take(t, 'image'), batch_device)
        s.labels = (
          transfer.to_device(self.feed.take(t, 'label'), batch_device)
          if role.loss != 'none'
          else None
        )
        snapshot = self.stores[k].read()
        s.version = snapshot.version
        s.variables = stages_lib.with_state(snapshot.value.params, self.states[k].read().value)
        if probed:  # (on lane processes the weights are fetched from the stage's lane)
          weights = stages_lib.split_variables(self.fetch(s.variables))
          self.agreement.record(k, t, *weights, batch)
      if s.enter('forward'):
        s.y, s.loss, new_state, vjp = yield Compute(
          ops.forward, (s.variables, s.x, s.labels), kind='forward', stage=k, batch=t
        )
        self.states[k].write(new_state)
        s.current = _Slot(t, s.version, vjp, s.x, s.labels)
        s.variables = s.x = s.labels = None
      if not last and s.enter('send'):
        yield Send(self.activations[k + 1], s.y, batch=t)
      if role.split_backward:
        yield from self._own_backward(k, s)
      if s.enter('slots'):
        s.slots.append(s.current)
        s.slot, s.current, s.y = s.slots.popleft(), None, None
      if t >= role.delay:  # Else the slot is idle: pipeline fill.
        yield from self._backward(k, s)
        yield from self._update(k, s, s.grads, s.read_version, s.slot.batch, s.weights_version)
      elif role.split_backward:  # Overlapping fill: the own loss alone.
        yield from self._update(k, s, s.own_grads, s.own_version, t, s.own_version)
      if s.enter('step'):
        if role.loss == 'aux':
          self.losses[k].append((t, s.loss))  # Drained (and checked) at evaluation points.
        if last:
          self.on_step(t, s.loss)
        s.t, s.loss, s.slot, s.grads, s.own_grads = t + 1, None, None, None, None

  def _backward(self, k: int, s: LoopState):
    """Backward of `s.slot`'s batch: `s.grads`, `s.read_version` (the version of the
    forward whose input and error signal they use), `s.weights_version` (of the weights
    their Jacobian used).

    Overlapping (`split_backward`: the own-loss gradient of the current batch in
    `s.own_grads`, of version `s.own_version`), only the downstream part goes through
    the slot's vjp and is added.
    """
    role, ops, slot = self.roles[k], self.pipeline.ops(k, self.roles[k]), s.slot
    if role.receives_delta and s.enter('get delta'):
      s.dy = yield Get(self.deltas[k])
    if s.enter('backward inputs'):
      dy = s.dy if role.receives_delta else None
      read_version = weights_version = slot.version
      if role.split_backward:
        call = ops.delta_backward, (slot.vjp, dy, s.own_grads)
        read_version = weights_version = min(slot.version, s.own_version)
      elif role.backward_form == 'stored':  # The forward's weights: its vjp residuals.
        call = ops.backward, (slot.vjp, dy)
      else:  # The current weights: through the kept activations, or the forward again.
        current = self.stores[k].read()
        variables = stages_lib.with_state(current.value.params, self.states[k].read().value)
        weights_version = current.version
        call = (
          (ops.stale_backward, (slot.vjp, variables, slot.x, slot.labels, dy))
          if role.backward_form == 'stale_graph'
          else (ops.recompute, (variables, slot.x, slot.labels, dy))
        )
      s.call, s.read_version, s.weights_version, s.dy = call, read_version, weights_version, None
    if s.enter('backward'):
      s.grads, s.dx = yield Compute(*s.call, kind='backward', stage=k, batch=slot.batch)
      s.call, s.dx_batch = None, slot.batch
    yield from self._send_delta(k, s, 'send delta')

  def _own_backward(self, k: int, s: LoopState):
    """Overlapping: the own loss's backward on the current batch (`s.own_grads`), its
    input gradient sent upstream at once (it does not depend on anything downstream)."""
    ops = self.pipeline.ops(k, self.roles[k])
    if s.enter('own backward'):
      s.own_grads, s.dx = yield Compute(
        ops.backward, (s.current.vjp, None), kind='backward', stage=k, batch=s.current.batch
      )
      s.own_version, s.dx_batch = s.current.version, s.current.batch
    yield from self._send_delta(k, s, 'send own delta')

  def _send_delta(self, k: int, s: LoopState, phase: str):
    """Sends `s.dx`, the input gradient of batch `s.dx_batch`, upstream."""
    # Stage k − 1 runs backwards up to batch steps − 1 − delay; later ones are never used.
    if s.dx is not None and s.dx_batch < self.steps - self.roles[k - 1].delay and s.enter(phase):
      yield Send(self.deltas[k - 1], s.dx, batch=s.dx_batch)
    s.dx = None

  def _update(
    self, k: int, s: LoopState, grads, read_version: int, batch: int, weights_version: int
  ):
    """Applies `grads`, computed at `read_version`, to stage k's store."""
    if s.enter('update inputs'):
      current = self.stores[k].read().value
      s.call = (
        self.pipeline.ops(k, self.roles[k]).update,
        (
          current.params,
          current.opt_state,
          grads,
        ),
      )
    if s.enter('update'):
      params, opt_state = yield Compute(*s.call, kind='update', stage=k, batch=batch)
      s.call = None
      self.weight_staleness[k].append(self.stores[k].version - weights_version)
      self.stores[k].write(
        StageParams(params, opt_state), read_version=read_version, lane=k, batch=batch
      )

  def _idle_slot(self, k: int) -> _Slot | None:
    """What an idle pipeline slot holds: nothing, or (`idle_fill='nan'`) a forward
    computed on NaN inputs, so a schedule that ever read one would produce NaN."""
    if self.idle_fill is None:
      return None
    pipeline, role, device = self.pipeline, self.roles[k], self.pipeline.device(k)
    shape = pipeline.inputs[k]
    x = transfer.to_device(np.full(shape.shape, np.nan, shape.dtype), device)
    labels = transfer.to_device(np.zeros(shape.shape[:1], np.int32), device)
    variables = {'params': self.stores[k].read().value.params, **self.states[k].read().value}
    forward = pipeline.ops(k, role).forward
    result = forward(variables, x, labels)
    snapshot_lib.note_vjps(forward, (variables, x, labels), result)  # A checkpoint saves it.
    return _Slot(-1, 0, result[3], x, labels)

  # --- checkpoints ------------------------------------------------------------------------
  def snapshot(self) -> dict:
    """What a checkpoint saves of the session besides its processes (`algorithms.resume`)."""
    return {
      'stores': [store.snapshot() for store in self.stores],
      'states': [state.snapshot() for state in self.states],
      'losses': [list(losses) for losses in self.losses],
      'weight_staleness': [np.asarray(w, np.int64) for w in self.weight_staleness],
      'feed': self.feed.snapshot(),
      'agreement': None if self.agreement is None else self.agreement.snapshot(),
    }

  def load(self, saved: dict) -> None:
    for store, value in zip(self.stores + self.states, saved['stores'] + saved['states']):
      store.load(value)
    self.losses = [list(losses) for losses in saved['losses']]
    self.weight_staleness = [[int(w) for w in ws] for ws in saved['weight_staleness']]
    self.feed.load(saved['feed'])
    if self.agreement is not None:
      self.agreement.load(saved['agreement'])

  # --- what the run reports -----------------------------------------------------------------
  def variables(self):
    """The full model's variables (aux heads dropped), gathered on the first device."""
    device = self.pipeline.placement.devices[0]
    return models_lib.merge_variables(
      [
        transfer.to_device(
          {'params': self.fetch(store.read().value.params), **self.fetch(state.read().value)},
          device,
        )
        for store, state in zip(self.stores, self.states)
      ]
    )

  def staleness(self) -> dict[str, np.ndarray]:
    return {f'stage {k}': store.staleness() for k, store in enumerate(self.stores)}

  def metrics(self) -> dict[str, float]:
    """Per-stage staleness so far, and local losses since the last call (syncs)."""
    record = {}
    for k, store in enumerate(self.stores):
      values = store.staleness()
      if values.size:
        record[f'staleness_mean/stage{k}'] = float(values.mean())
        record[f'staleness_max/stage{k}'] = int(values.max())
      if self.roles[k].backward_form != 'stored' and self.weight_staleness[k]:
        record[f'weight_staleness_mean/stage{k}'] = float(np.mean(self.weight_staleness[k]))
    for k, role in enumerate(self.roles):
      if role.loss == 'aux' and self.losses[k]:
        record[f'local_loss/stage{k}'] = _drain_local_losses(k, self.losses[k], self.fetch)
    cosines = self.agreement.drain() if self.agreement is not None else None
    if cosines is not None:
      record.update({f'grad_cosine/stage{k}': float(c) for k, c in enumerate(cosines)})
    return record


def _drain_local_losses(k: int, pending: list, fetch: Callable) -> float:
  steps, losses = zip(*pending)
  pending.clear()
  values = np.asarray(transfer.to_host(fetch(list(losses))), np.float64)
  bad = np.flatnonzero(~np.isfinite(values))
  if bad.size:
    raise NonFiniteLossError(
      f'training loss became {values[bad[0]]} at step '
      f'{steps[bad[0]] + 1} at stage/worker stage {k} (its local loss); '
      f'lower optimizer.learning_rate or check the data.'
    )
  return float(values.mean())


def check_roles(roles: Sequence[StageRole]) -> None:
  """A stage that waits for deltas needs a next stage that sends them, and so on."""
  last = len(roles) - 1
  if roles[last].loss != 'head':
    raise ValueError('roles: the last stage must have the model loss (loss="head").')
  for k, role in enumerate(roles):
    if role.delay < 0:
      raise ValueError(f'roles: stage {k} has a negative delay.')
    if role.delayed_backward not in DELAYED_BACKWARDS:
      raise ValueError(
        f'roles: stage {k} delayed_backward={role.delayed_backward!r}; '
        f'allowed: {", ".join(DELAYED_BACKWARDS)}.'
      )
    if role.split_backward and role.backward_form != 'stored':
      raise ValueError(
        f'roles: stage {k} splits its backward (a local loss and a gradient '
        f'from downstream), which supports only delayed_backward="stored".'
      )
    if role.receives_delta != (k < last and roles[k + 1].sends_delta != 'none'):
      raise ValueError(
        f'roles: stage {k} receives_delta={role.receives_delta} but stage '
        f'{k + 1} sends {roles[k + 1].sends_delta if k < last else "nothing"}.'
      )
    if role.loss == 'none' and not role.receives_delta:
      raise ValueError(f'roles: stage {k} has neither a loss nor a gradient from downstream.')


def _stage_shapes(model, stages, batch_size):
  """Input and output `ShapeDtypeStruct`s of every stage at `batch_size`."""
  variables = jax.eval_shape(lambda key: model.init(key, batch_size), jax.random.key(0))
  h = jax.ShapeDtypeStruct((batch_size,) + model.input_shape, np.float32)
  inputs, outputs = [], []
  for stage in stages:
    inputs.append(h)
    h = jax.eval_shape(
      lambda v, x, s=stage: s.apply(v, x, train=False),
      models_lib.stage_variables(variables, stage),
      h,
    )
    outputs.append(h)
  return inputs, outputs


def _initial_variables(model, stages, seed):
  """The fused `bp` initialization, cut per stage, plus auxiliary heads if any."""
  key = jax.random.key(seed)
  full = model.init(key)
  with_aux = (
    models_lib.init_stages(model, stages, key)
    if any(s.aux_classes for s in stages)
    else [None] * len(stages)
  )
  result = []
  for stage, aux in zip(stages, with_aux):
    variables = models_lib.stage_variables(full, stage)
    if aux is not None:
      heads = {n: p for n, p in aux['params'].items() if n.startswith('aux_')}
      variables = {**variables, 'params': {**variables['params'], **heads}}
    result.append(variables)
  return result
