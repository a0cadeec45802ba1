"""`DataParallelTrainer`: M workers, one jitted step, explicit placement.

Everything that moves data between host and devices in the SPMD path is here:
`init` (on device, placed by `out_shardings`), `put_batch` (numpy → global
array), `report_loss` / `eval_variables` (local one-device views, no copy) and
`host_params` (the only device→host copy, for saving).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsgd.spmd import mesh as mesh_lib
from jaxsgd.spmd import step as step_lib


# Several local devices running collectives deadlock (gloo) or abort (XLA:CPU's
# in-process rendezvous timeout) when ~32-100 such steps are queued without waiting,
# in one process as in several (docs/jax_on_cpu.md). Waiting every 16 steps avoids it.
SYNC_EVERY = 16


@jax.jit
def _unstack_first_row(losses):
  """The first row's entries as separate scalars, in one dispatch."""
  return tuple(losses[0])


@dataclasses.dataclass
class TrainState:
  variables: object
  opt_state: object


class DataParallelTrainer:
  """Trains `model` with `tx` on `workers` data-parallel workers.

  Args:
    model: a `StagedModel`.
    tx: the optimizer; for local methods it contains a delayed-averaging
      transform with `axis_name='data'`.
    workers: M.
    average_grads: True for SSGD (one replicated copy of the parameters,
      gradients all-reduced every step); False for local methods (a copy per
      worker, stacked `[M, ...]`; `tx` averages them).
    stacked: run all M workers on one device with `vmap` instead of a mesh.
    devices: the devices of the mesh (default `jax.devices()`; worker m on the
      m-th).
    period: with `delay`, the schedule of the delayed-averaging transform in
      `tx` (a local method with `overlap=True`): then every whole period that
      `program_length` allows runs as ONE program with one all-reduce
      (`step.make_worker_period`); None: every step is its own program.
    delay: the transform's delay d (0 <= d < period).
    fragments: for streaming DiLoCo (`tx` contains `streaming_diloco_outer_step`
      with this `period`, `fragments` and `delay`): each cycle of `period` steps
      runs as one program with one all-reduce per fragment
      (`step.make_worker_cycle`).
  """

  def __init__(
    self,
    model,
    tx,
    workers: int,
    *,
    average_grads: bool,
    stacked: bool = False,
    devices=None,
    period: int | None = None,
    delay: int = 0,
    fragments: int | None = None,
  ):
    self.workers = workers
    self.replicated = average_grads
    self.stacked = stacked
    if period is not None and average_grads:
      raise ValueError(
        'period: whole-period programs are for the local methods '
        '(average_grads=False); SSGD communicates every step.'
      )
    self.period = period
    self.period_step = None
    if stacked:
      self.mesh = None
      worker_step = step_lib.make_worker_step(model, tx, average_grads=average_grads)
      self.step = step_lib.stacked_step(worker_step, workers, replicated=self.replicated)
    else:
      self.mesh = mesh_lib.data_mesh(workers, devices)
      vary = lambda tree: lax.pcast(tree, mesh_lib.AXIS, to='varying')
      worker_step = step_lib.make_worker_step(model, tx, average_grads=average_grads, vary=vary)
      self.step = step_lib.mesh_step(worker_step, self.mesh, replicated=self.replicated)
    if period is not None:
      worker_period = (
        step_lib.make_worker_period(worker_step, period=period, delay=delay)
        if fragments is None
        else step_lib.make_worker_cycle(
          worker_step, period=period, fragments=fragments, delay=delay
        )
      )
      self.period_step = (
        step_lib.stacked_period(worker_period, workers)
        if stacked
        else step_lib.mesh_period(worker_period, self.mesh)
      )
    self._model, self._tx = model, tx
    self._consensus = jax.jit(
      step_lib.consensus_fn(replicated=self.replicated),
      **({'out_shardings': mesh_lib.replicated(self.mesh)} if self.mesh is not None else {}),
    )

  def _state_sharding(self):
    return mesh_lib.replicated(self.mesh) if self.replicated else mesh_lib.per_worker(self.mesh)

  # --- placement ------------------------------------------------------------------
  @property
  def local_workers(self) -> list[int]:
    """The workers whose batches this process must supply, in order."""
    if self.mesh is None:
      return list(range(self.workers))
    return mesh_lib.local_workers(self.mesh)

  @property
  def local_device_count(self) -> int:
    return 1 if self.mesh is None else len(self.local_workers)

  @property
  def sync_every(self) -> int | None:
    """Steps between waits for the device (the deadlock hazard), or None: never."""
    return SYNC_EVERY if self.local_device_count > 1 else None

  def maybe_wait(self, step: int, loss: jax.Array, steps: int = 1) -> None:
    """Blocks on `loss` every `sync_every` steps; the only wait in the hot loop.

    Args:
      step: steps done, after the program that produced `loss`.
      loss: an output of that program.
      steps: steps that program ran (a whole period: `period`).
    """
    if self.sync_every and step // self.sync_every > (step - steps) // self.sync_every:
      loss.block_until_ready()

  def init(self, seed: int) -> TrainState:
    """Same initial weights on every worker: `model.init(key(seed))`, `tx.init`.

    One worker's variables and optimizer state are made on one local device, copied
    to the host once, and placed: replicated, or stacked `[M, ...]` by worker.
    """
    # Eagerly, as `bp` does: bit-identical start, and eager ops are cached across
    # runs (a fresh `jax.jit` of a bound method would recompile every time).
    variables = self._model.init(jax.random.key(seed))
    opt_state = self._tx.init(variables['params'])
    host = jax.device_get((variables, opt_state))
    return TrainState(*jax.tree.map(self._place, host))

  def _place(self, x: np.ndarray) -> jax.Array:
    x = np.asarray(x)
    if not self.replicated:
      x = np.broadcast_to(x, (self.workers,) + x.shape)
    if self.mesh is None:
      return jnp.array(x)
    # From a host value every process holds: each process fills its own shards.
    return jax.make_array_from_callback(x.shape, self._state_sharding(), lambda i: x[i])

  def put_batch(self, local_batches: list[dict[str, np.ndarray]]):
    """The global `[M*B, ...]` batch from this process's workers' numpy batches."""
    if self.mesh is None:
      return jax.tree.map(lambda *xs: jnp.asarray(np.concatenate(xs)), *local_batches)
    return mesh_lib.global_batch(self.mesh, local_batches)

  def put_batches(self, steps: list[list[dict[str, np.ndarray]]]):
    """The `[τ, M*B, ...]` batches of τ steps (`steps[k]`: step k's local batches)."""
    per_worker = [jax.tree.map(lambda *xs: np.stack(xs), *worker) for worker in zip(*steps)]
    if self.mesh is None:
      return jax.tree.map(lambda *xs: jnp.asarray(np.concatenate(xs, axis=1)), *per_worker)
    return mesh_lib.global_batch(self.mesh, per_worker, axis=1)

  # --- training -------------------------------------------------------------------
  def train_step(self, state: TrainState, batch) -> tuple[TrainState, jax.Array]:
    """One step of every worker; asynchronous (returns before the device is done)."""
    variables, opt_state, loss = self.step(state.variables, state.opt_state, batch)
    return TrainState(variables, opt_state), loss

  def train_period(self, state: TrainState, batches) -> tuple[TrainState, jax.Array]:
    """τ steps of every worker as one program (`put_batches`); losses `[M, τ]`.

    Only from a period boundary (steps done a multiple of `period`).
    """
    variables, opt_state, losses = self.period_step(state.variables, state.opt_state, batches)
    return TrainState(variables, opt_state), losses

  def program_length(self, done: int, total: int, stops=lambda step: False) -> int:
    """Steps the next program runs: `period` or 1.

    A whole period runs as one program when one is built, `done` is a period
    boundary, the period ends by `total`, and none of its steps but the last is
    a stop (`stops(step)`, e.g. an evaluation point, which needs the weights of
    that step). Otherwise one step runs (its own program: with `overlap=True`
    it issues its own all-reduce; same arithmetic).
    """
    tau = self.period
    if (
      self.period_step is None
      or done % tau
      or done + tau > total
      or any(stops(step) for step in range(done + 1, done + tau))
    ):
      return 1
    return tau

  def train_steps(
    self, state: TrainState, steps: list[list[dict[str, np.ndarray]]]
  ) -> tuple[TrainState, list[jax.Array]]:
    """`len(steps)` steps (1, or a whole period: `program_length`) from local batches.

    Returns:
      The new state and one reportable loss per step (`report_loss`'s).
    """
    if len(steps) == 1:
      state, loss = self.train_step(state, self.put_batch(steps[0]))
      return state, [self.report_loss(loss)]
    state, losses = self.train_period(state, self.put_batches(steps))
    return state, self.report_losses(losses)

  def report_losses(self, losses: jax.Array) -> list[jax.Array]:
    """`report_loss` of each step of a period program's `[M, τ]` losses."""
    local = mesh_lib.first_local_shard(losses) if self.mesh is not None else losses
    return list(_unstack_first_row(local))

  def report_loss(self, loss: jax.Array) -> jax.Array:
    """A one-device scalar to report: the mean (SSGD) or this process's first worker's.

    Local methods do not average the loss in the step: a collective that depends on
    the current step could be combined by XLA with the delayed average and take
    away its overlap. Process 0's first worker is worker 0.
    """
    local = mesh_lib.first_local_shard(loss) if self.mesh is not None else loss
    return local if self.replicated else local[0]

  def eval_variables(self, state: TrainState):
    """The model to evaluate, as one-device arrays of this process.

    SSGD: the replicated copy. Local methods: the workers' mean (one all-reduce,
    only at evaluation points).
    """
    variables = self._consensus(state.variables)
    if self.mesh is None:
      return variables
    return jax.tree.map(mesh_lib.first_local_shard, variables)

  def host_params(self, state: TrainState) -> dict[str, np.ndarray]:
    """The evaluated model's variables on the host, flattened by path (for saving)."""
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(self.eval_variables(state)))
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat[0]}
