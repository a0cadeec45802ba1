r"""`ssgd`, `local_sgd`, `dasgd`, `diloco`, `streaming_diloco`: SPMD data parallelism.

M workers (devices of a `data` mesh, or stacked on one device), each with its own
batch of `config.batch_size` examples (per worker: the global batch is
`batch_size × workers`, or `algorithm.global_batch_size` split evenly). Update
rules (w: weights, g_m: worker m's gradient, η: the optimizer):

* `ssgd` (Goyal et al. 2017, arXiv:1706.02677): one replicated model;
  w ← w + opt(mean_m g_m) every step (`lax.pmean` of the gradients).
* `local_sgd` (Lin et al. 2018, arXiv:1808.07217): w_m ← w_m + opt(g_m); every
  `period` steps w_m ← mean_j w_j.
* `dasgd` (Zhou et al. 2020, arXiv:2006.00441): local SGD whose average is
  merged `delay` steps late: snapshot s_m = w_m at k = nτ; at k = nτ + d,
  w_m ← mean_j s_j + (w_m − s_m) (`merge='keep_local'`) or
  w_m ← p w_m + (1 − p) mean_j s_j (`merge='mix'`). With `overlap=True` each period
  runs as one program with one all-reduce, of the snapshot in the optimizer state:
  it depends on no gradient of the period, so XLA may run it during the `delay`
  steps of compute before the merge (`jaxsgd.spmd.step.make_worker_period`).
* `diloco` (Douillard et al. 2023, arXiv:2311.08105): every `period` inner steps,
  an outer optimizer (`algorithm.outer`, default Nesterov SGD 0.7/0.9) steps the
  anchor with the pseudo-gradient anchor − mean_j w_j; workers restart from it.
* `streaming_diloco` (Douillard et al. 2025, arXiv:2501.18512): DiLoCo on
  `algorithm.fragments` = P fragments of the model whose outer steps are staggered
  (fragment p syncs when (t − p·H/P) mod H = 0), each merged `delay` = τ steps after
  its sync as w_p ← α w_p + (1 − α) θ_p (`mix` = α; 0 takes the global value). With
  `overlap=True` each cycle of H steps is one program with one all-reduce per
  fragment (`jaxsgd.spmd.step.make_worker_cycle`).

The update rules live in `jaxsgd.transforms` (`local_sgd`, `diloco`); this module
builds them from the config, places state and batches (`jaxsgd.spmd`) and runs
the loop. Optimizer moments and BatchNorm statistics stay per worker in the local
methods (as in DaSGD); SSGD averages BatchNorm statistics every step. Evaluation
uses the workers' mean model.

Clock: `real` measures wall time; `virtual` reports `sim_time` from
`jaxsgd.spmd.timing.StepTimeModel` (compute per step measured once, or
`cost.compute.step` with `cost.calibrate=False`; ring all-reduce over
`cost.link_bandwidth` bytes/s and `cost.link_latency` seconds).
"""

import dataclasses
import logging

import jax

from jaxsgd import optimizers
from jaxsgd import transforms
from jaxsgd.algorithms import clocks
from jaxsgd.algorithms.settings import SharedSettings, at_least, choice, derived, number
from jaxsgd.algorithms.settings import optimizer_settings, refuse_cost_fields, section
from jaxsgd.algorithms.settings import shared_settings
from jaxsgd.optimizers import OptimizerSettings
from jaxsgd.scheduler import profile_lookup
from jaxsgd.spmd import distributed
from jaxsgd.spmd import mesh as mesh_lib
from jaxsgd.spmd import step as step_lib
from jaxsgd.spmd import timing
from jaxsgd.spmd.trainer import DataParallelTrainer, TrainState

NAMES = ('ssgd', 'local_sgd', 'dasgd', 'diloco', 'streaming_diloco')
OUTER = ('diloco', 'streaming_diloco')  # The methods with an outer optimizer.
DATA_SHARDING = ('shard', 'stream')
DILOCO_OUTER = OptimizerSettings('sgd', 0.7, kwargs=(('momentum', 0.9), ('nesterov', True)))


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of a data-parallel run, and the shared fields (`shared`).

  Attributes:
    period: τ / H, local steps between averages (ssgd: 1).
    delay: d < τ, steps the average runs behind; None = 1 for dasgd, else 0.
    merge: 'keep_local' (DaSGD paper: w ← w̄ + (w − s)) or 'mix' (p·w + (1 − p)·w̄).
    mix: p for merge='mix' (DaSGD public code: 8/32).
    overlap: the average is a top-level op XLA can overlap (False: lock-step).
    stacked: every worker vmapped on one device.
    global_batch_size: split evenly over workers; None = batch_size × workers.
    data_sharding: 'shard' (disjoint examples per worker) or 'stream'.
    save_params: write params.npz (the evaluated model) at the end.
    outer: DiLoCo's outer optimizer (default Nesterov SGD 0.7 / 0.9).
    fragments: streaming_diloco's P, a divisor of period (the others use 1).
  """

  period: int = 4
  delay: int | None = None
  merge: str = 'keep_local'
  mix: float = 0.25
  overlap: bool = True
  stacked: bool = False
  global_batch_size: int | None = None
  data_sharding: str = 'shard'
  save_params: bool = False
  outer: OptimizerSettings = DILOCO_OUTER
  fragments: int = 1
  name: str = derived('ssgd')
  workers: int = derived(1)
  batch_size: int = derived(1)  # per worker
  shared: SharedSettings | None = derived()

  @property
  def global_batch(self) -> int:
    return self.batch_size * self.workers

  @property
  def resumable(self) -> bool:
    """The loop checkpoints (`run.maybe_save`) and resumes exactly."""
    return True


def settings(config) -> Settings:
  """Reads and checks `config.algorithm` (and `workers`, `batch_size`).

  Raises:
    ValueError: naming the field, for any setting that cannot work.
  """
  algo = dict(config.algorithm)
  name = choice(algo.get('name'), 'algorithm.name', NAMES)
  outer = algo.pop('outer', None)
  s = section(algo, Settings, 'algorithm')
  shared = shared_settings(config)
  period = 1 if name == 'ssgd' else at_least(s.period, 'algorithm.period', 1)
  delay = s.delay if s.delay is not None else (1 if name == 'dasgd' else 0)
  delay = 0 if name == 'ssgd' else at_least(delay, 'algorithm.delay', 0)
  if delay >= period:
    raise ValueError(
      f'algorithm.delay: must be < algorithm.period (0 <= delay < '
      f'period), got delay={delay}, period={period}.'
    )
  if name == 'local_sgd' and delay:
    raise ValueError(
      f'algorithm.delay: local_sgd averages without delay (0), got '
      f"{delay}; use algorithm.name='dasgd' for a delayed average."
    )
  choice(s.merge, 'algorithm.merge', transforms.MERGES)
  number(s.mix, 'algorithm.mix', maximum=1.0)
  choice(s.data_sharding, 'algorithm.data_sharding', DATA_SHARDING)
  outer_settings = (
    optimizer_settings({**dataclasses.asdict(DILOCO_OUTER), **dict(outer)}, 'algorithm.outer')
    if outer is not None and name in OUTER
    else DILOCO_OUTER
  )
  return dataclasses.replace(
    s,
    name=name,
    period=period,
    delay=delay,
    outer=outer_settings,
    workers=shared.workers,
    batch_size=_per_worker_batch(s, shared),
    shared=shared,
    fragments=_fragments(name, s, period, delay),
  )


def _note_undelayed(period: int, delay: int) -> None:
  """One warning where DaSGD's settings leave nothing delayed (allowed, but not DaSGD):
  merging with keep_local, w ← w̄ + (w − s), an average taken at once (s = w) is w̄."""
  if period == 1:
    logging.warning(
      'algorithm.period=1: DaSGD averaging after every step has no delay (delay < period '
      'leaves 0) and trains as local_sgd with period 1; set period >= 2 and delay >= 1 for '
      'a delayed average.'
    )
  elif delay == 0:
    logging.warning(
      'algorithm.delay=0: DaSGD without delay trains as local_sgd does; set delay >= 1 '
      '(< period) for a delayed average.'
    )


def _fragments(name: str, s: Settings, period: int, delay: int) -> int:
  """`algorithm.fragments` of streaming_diloco (checked against period and delay), else 1."""
  if name != 'streaming_diloco':
    return 1
  fragments = at_least(s.fragments, 'algorithm.fragments', 1)
  if period % fragments:
    raise ValueError(
      f'algorithm.fragments: algorithm.period={period} must be a multiple '
      f'of fragments={fragments} (fragment p syncs at offset p·period/P).'
    )
  if delay >= period // fragments:
    raise ValueError(
      f'algorithm.delay: must be < period / fragments = '
      f'{period // fragments} (one fragment in flight), got {delay}.'
    )
  if s.merge != 'mix':
    raise ValueError(
      f'algorithm.merge: streaming_diloco merges w ← α w + (1 − α) θ '
      f"(merge='mix', α = algorithm.mix); got {s.merge!r}."
    )
  return fragments


def _per_worker_batch(s: Settings, shared: SharedSettings) -> int:
  """`batch_size` (per worker), or `algorithm.global_batch_size / workers`."""
  total = s.global_batch_size
  if total is None:
    return shared.batch_size
  at_least(total, 'algorithm.global_batch_size', 1)
  if total % shared.workers:
    raise ValueError(
      f'algorithm.global_batch_size: {total} examples cannot be split '
      f'evenly over workers={shared.workers}; use a multiple of '
      f'{shared.workers}.'
    )
  return total // shared.workers


def validate(config, model) -> Settings:
  """Refuses bad settings before anything compiles; joins the cluster if launched.

  Joining (`jax.distributed.initialize`, from the launcher's environment) happens
  here because it must precede the first device query, and counting devices is
  part of validation.
  """
  del model
  s = settings(config)
  if s.shared.stages != 1:
    raise ValueError(
      f'stages: the data-parallel methods train the whole model on every '
      f'worker; use stages=1, got {s.shared.stages}.'
    )
  if s.shared.on_lane_processes:
    raise ValueError(
      f'executor: {s.shared.executor!r} runs the scheduler families on lane processes; the '
      'data-parallel methods run SPMD (several processes or hosts: jaxsgd.launch); use '
      "executor='in_process'."
    )
  if s.shared.placement.lanes is not None:
    raise ValueError(
      'placement.lanes: places the lanes of the scheduler families; the data-parallel '
      'methods have none (SPMD over placement.devices); leave it None.'
    )
  refuse_cost_fields(
    s.shared.cost,
    ('speeds', 'failures'),
    'the data-parallel methods run in lock-step SPMD; per-lane speeds and failures are for '
    'the scheduler families.',
  )
  refuse_cost_fields(
    s.shared.cost,
    ('host',),
    "a host profile prices an executor's host per task of the scheduler families; a "
    'data-parallel step is one compiled program. Leave it None.',
  )
  multi_process = distributed.initialize_from_env()
  if s.stacked and multi_process:
    raise ValueError(
      'algorithm.stacked: the stacked form runs on one device; it cannot '
      'span the processes of a multi-process run.'
    )
  if not s.stacked and s.workers > len(jax.devices()):
    raise ValueError(
      f'workers: {s.workers} workers need {s.workers} devices, but '
      f'{len(jax.devices())} are visible; lower workers, add devices '
      f'(XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU, or '
      f'more processes), or set algorithm.stacked=True.'
    )
  if s.name == 'dasgd' and s.merge == 'keep_local':
    _note_undelayed(s.period, s.delay)
  return s


def make_optimizer(s: Settings):
  """The optimizer of the run: the inner one, wrapped by the averaging transform."""
  inner = optimizers.make_optimizer(s.shared.optimizer, s.shared.train_steps)
  if s.name == 'ssgd':
    return inner
  kwargs = dict(
    period=s.period,
    delay=s.delay,
    axis_name=mesh_lib.AXIS,
    merge=s.merge,
    mix=s.mix,
    overlap=s.overlap,
  )
  if s.name in OUTER:
    outer = optimizers.make_optimizer(s.outer, max(1, s.shared.train_steps // s.period))
    if s.name == 'streaming_diloco':
      return transforms.streaming_diloco(
        inner,
        outer,
        s.period,
        s.fragments,
        s.delay,
        s.mix,
        axis_name=mesh_lib.AXIS,
        overlap=s.overlap,
      )
    return transforms.diloco(inner, outer, **kwargs)
  return transforms.local_sgd(inner, **kwargs)


def make_time_model(s: Settings, model, variables, sample_batch) -> timing.StepTimeModel:
  """The virtual clock: compute per step (given or measured once) + all-reduce time.

  Args:
    s: the validated settings.
    model: the `StagedModel`.
    variables: one worker's model variables (one-device arrays).
    sample_batch: one worker's numpy batch, to time a step on.
  """
  cost = s.shared.cost
  comm = timing.ring_allreduce_time(
    sync_bytes(s, variables), s.workers, bandwidth=cost.bandwidth, latency=cost.link_latency
  )
  tasks = clocks.Tasks(
    calls=lambda: {(0, 'step'): _step_call(s.shared, model, variables, sample_batch)},
    model=model,
    batch_size=s.batch_size,
    split=((0, model.num_layers),),
    name=profile_lookup.WORKER_STEP,
  )
  compute = clocks.task_costs(s.shared, tasks, ('step',), 1)[(0, 'step')]
  # overlap=False runs the all-reduce inside a lax.cond on the merge step: it blocks
  # there, so none of it is hidden. overlap=True runs each period as one program whose
  # one all-reduce (of the stored snapshot) may overlap the `delay` steps before the merge.
  return timing.sync_time_model(
    compute,
    comm,
    period=s.period,
    fragments=s.fragments,
    delay=s.delay,
    hidden=s.delay if s.overlap else 0,
  )


def sync_bytes(s: Settings, variables) -> float:
  """Bytes each worker all-reduces at one synchronization: SSGD the gradients and
  BatchNorm statistics, the others the weights; streaming DiLoCo one of its P fragments
  (near-equal in size, so 1/P of the weights)."""
  nbytes = timing.tree_bytes(variables if s.name == 'ssgd' else variables['params'])
  return nbytes / s.fragments


def communication(s: Settings, variables, steps: int) -> dict:
  """What a run of `steps` steps synchronized: its synchronizations (all-reduces merged
  by the end: SSGD every step; the others one per `period / fragments` steps, `delay`
  steps after each snapshot) and each one's payload per worker (`sync_bytes`; a ring
  all-reduce sends 2 (M − 1)/M of it over each worker's link)."""
  schedule = timing.sync_time_model(0.0, 0.0, period=s.period, fragments=s.fragments, delay=s.delay)
  synchronizations = schedule.merges(steps)
  per_sync = sync_bytes(s, variables)
  return {
    'synchronizations': synchronizations,
    'steps_between_synchronizations': schedule.period,
    'bytes_per_synchronization': per_sync,
    'bytes': synchronizations * per_sync,
  }


def _step_call(shared: SharedSettings, model, variables, batch) -> tuple:
  """`(jitted fn, args)` of one worker's step (forward, backward, inner update)."""
  inner = optimizers.make_optimizer(shared.optimizer, shared.train_steps)
  one_step = jax.jit(step_lib.make_worker_step(model, inner, average_grads=False))
  opt_state = jax.jit(inner.init)(variables['params'])
  return one_step, (variables, opt_state, batch)


def train(run, s: Settings) -> dict:
  """Trains `config.train_steps` data-parallel steps; returns summary extras.

  The loop never waits for the device, except every 16 steps when this process
  drives several devices (`DataParallelTrainer.maybe_wait`: queuing too many steps
  with collectives deadlocks there) and at evaluation points.
  """
  model = run.model
  trainer = DataParallelTrainer(
    model,
    make_optimizer(s),
    s.workers,
    average_grads=s.name == 'ssgd',
    stacked=s.stacked,
    **_period_program(s),
  )
  streams = [
    run.train_batches(m, s.workers, batch_size=s.batch_size, sharding=s.data_sharding)
    for m in trainer.local_workers
  ]
  state = trainer.init(s.shared.seed)
  clock = None
  if s.shared.virtual:
    sample = next(
      run.train_batches(0, s.workers, batch_size=s.batch_size, sharding=s.data_sharding)
    )
    clock = make_time_model(s, model, trainer.eval_variables(state), sample)
  # Local methods report this process's first worker's loss (see `report_loss`).
  where = None if trainer.replicated else f'worker {trainer.local_workers[0]}'
  step = 0
  resumed = run.restore(_arrays(state), streams)
  if resumed is not None:
    step, arrays = resumed
    state = TrainState(**arrays)
  while step < s.shared.train_steps:
    # A whole period per program where possible (one all-reduce per period).
    n = trainer.program_length(step, s.shared.train_steps, run.should_evaluate)
    state, losses = trainer.train_steps(state, [[next(b) for b in streams] for _ in range(n)])
    trainer.maybe_wait(step + n, losses[-1], steps=n)
    for loss in losses:
      step += 1
      run.report(
        step,
        loss=loss,
        variables=lambda state=state: trainer.eval_variables(state),
        samples=step * s.global_batch,
        stage=where,
        sim_time=None if clock is None else clock.elapsed(step),
      )
    # A checkpoint due inside a period program is taken at its end (`state` is the
    # state of `step`): cutting the program there would change XLA's arithmetic.
    run.maybe_save(step, _arrays(state), streams, steps=n)
  return _summary_extras(run, s, model, trainer, state, clock, streams)


def _arrays(state: TrainState) -> dict:
  """What a checkpoint holds of the trainer's state."""
  return {'variables': state.variables, 'opt_state': state.opt_state}


def _period_program(s: Settings) -> dict:
  """Trainer arguments: whole-period programs for the local methods with overlap."""
  if s.name == 'ssgd' or not s.overlap:
    return {}
  if s.name == 'streaming_diloco':
    return {'period': s.period, 'delay': s.delay, 'fragments': s.fragments}
  return {'period': s.period, 'delay': s.delay}


def _summary_extras(run, s, model, trainer, state, clock, streams) -> dict:
  extras = {
    'workers': s.workers,
    'global_batch_size': s.global_batch,
    'processes': jax.process_count(),
    'stacked': s.stacked,
    'epochs': streams[0].epoch if streams else 0,
    # One worker's variables, as shapes: nothing computed, no collective.
    'communication': communication(
      s, jax.eval_shape(model.init, jax.random.key(0)), s.shared.train_steps
    ),
  }
  if clock is not None:
    extras['time_model'] = {
      **dataclasses.asdict(clock),
      'hidden_fraction': clock.hidden_fraction(),
      'relative_throughput': clock.relative_throughput(),
    }
  if s.save_params:
    params = trainer.host_params(state)  # Every process: it may involve a collective.
    run.write_arrays('params.npz', params)
  return extras
