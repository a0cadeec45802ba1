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
  its sync as w_p ← α w_p + (1 − α) θ_p (`mix` = α; 0 takes the global value).

The update rules live in `jaxsgd.transforms` (`local_sgd`, `diloco`); this module
builds them from the config, places state and batches (`jaxsgd.spmd`) and runs
the loop. Optimizer moments and BatchNorm statistics stay per worker in the local
methods (as in DaSGD); SSGD averages BatchNorm statistics every step. Evaluation
uses the workers' mean model.

Clock: `real` measures wall time; `virtual` reports `sim_time` from
`jaxsgd.spmd.timing.StepTimeModel` (compute per step measured once, or
`cost.step_time`; ring all-reduce over `cost.bandwidth_gbps`, `cost.latency`).
"""

import dataclasses
import os

import jax
import ml_collections
import numpy as np

from jaxsgd import transforms
from jaxsgd.algorithms import Algorithm
from jaxsgd.spmd import distributed
from jaxsgd.spmd import mesh as mesh_lib
from jaxsgd.spmd import step as step_lib
from jaxsgd.spmd import timing
from jaxsgd.spmd.trainer import DataParallelTrainer
from jaxsgd.training import optimizers

NAMES = ('ssgd', 'local_sgd', 'dasgd', 'diloco', 'streaming_diloco')
OUTER = ('diloco', 'streaming_diloco')  # The methods with an outer optimizer.
DATA_SHARDING = ('shard', 'stream')
DEFAULT_PERIOD = 4
DEFAULT_DELAY = {'dasgd': 1}
DEFAULT_OUTER = {'name': 'sgd', 'learning_rate': 0.7,
                 'kwargs': {'momentum': 0.9, 'nesterov': True}}
DEFAULT_COST = {'step_time': None, 'bandwidth_gbps': 10.0, 'latency': 1e-5,
                'calibration_steps': 5}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The validated `algorithm` fields of a data-parallel run."""
  name: str
  workers: int
  batch_size: int      # per worker
  period: int
  delay: int
  merge: str
  mix: float
  overlap: bool
  stacked: bool
  data_sharding: str
  save_params: bool
  fragments: int = 1   # streaming_diloco: P (1 for the others)

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.workers


def settings(config) -> Settings:
  """Reads and checks `config.algorithm` (and `workers`, `batch_size`).

  Raises:
    ValueError: naming the field, for any setting that cannot work.
  """
  algo = config.algorithm
  name = algo.name
  if name not in NAMES:
    raise ValueError(f'algorithm.name: {name!r} is not data-parallel; allowed: '
                     f'{", ".join(NAMES)}.')
  workers = config.workers
  period = 1 if name == 'ssgd' else algo.get('period', DEFAULT_PERIOD)
  _int_at_least('algorithm.period', period, 1)
  delay = 0 if name == 'ssgd' else algo.get('delay', DEFAULT_DELAY.get(name, 0))
  _int_at_least('algorithm.delay', delay, 0)
  if delay >= period:
    raise ValueError(f'algorithm.delay: must be < algorithm.period (0 <= delay < '
                     f'period), got delay={delay}, period={period}.')
  if name == 'local_sgd' and delay:
    raise ValueError(f"algorithm.delay: local_sgd averages without delay (0), got "
                     f"{delay}; use algorithm.name='dasgd' for a delayed average.")
  merge = algo.get('merge', 'keep_local')
  if merge not in transforms.MERGES:
    raise ValueError(f'algorithm.merge: {merge!r}; allowed: {", ".join(transforms.MERGES)}.')
  mix = algo.get('mix', 0.25)
  if not 0 <= mix <= 1:
    raise ValueError(f'algorithm.mix: the local weight p must be in [0, 1], got {mix}.')
  data_sharding = algo.get('data_sharding', 'shard')
  if data_sharding not in DATA_SHARDING:
    raise ValueError(f'algorithm.data_sharding: {data_sharding!r}; allowed: '
                     f'{", ".join(DATA_SHARDING)}.')
  fragments = _fragments(name, algo, period, delay)
  return Settings(name, workers, _per_worker_batch(config), period, delay, merge, mix,
                  bool(algo.get('overlap', True)), bool(algo.get('stacked', False)),
                  data_sharding, bool(algo.get('save_params', False)), fragments)


def _fragments(name, algo, period, delay) -> int:
  """`algorithm.fragments` of streaming_diloco (checked against period and delay), else 1."""
  if name != 'streaming_diloco':
    return 1
  if algo.get('merge', 'keep_local') != 'mix':
    raise ValueError(f"algorithm.merge: streaming_diloco merges w ← α w + (1 − α) θ "
                     f"(merge='mix', α = algorithm.mix); got {algo.get('merge')!r}.")
  fragments = algo.get('fragments', 2)
  _int_at_least('algorithm.fragments', fragments, 1)
  if period % fragments:
    raise ValueError(f'algorithm.fragments: algorithm.period={period} must be a multiple '
                     f'of fragments={fragments} (fragment p syncs at offset p·period/P).')
  if delay >= period // fragments:
    raise ValueError(f'algorithm.delay: must be < period / fragments = '
                     f'{period // fragments} (one fragment in flight), got {delay}.')
  return fragments


def _int_at_least(field, value, minimum):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'{field}: must be an integer >= {minimum}, got {value!r}.')


def _per_worker_batch(config) -> int:
  """`batch_size` (per worker), or `algorithm.global_batch_size / workers`."""
  total = config.algorithm.get('global_batch_size')
  if total is None:
    return config.batch_size
  _int_at_least('algorithm.global_batch_size', total, 1)
  if total % config.workers:
    raise ValueError(f'algorithm.global_batch_size: {total} examples cannot be split '
                     f'evenly over workers={config.workers}; use a multiple of '
                     f'{config.workers}.')
  return total // config.workers


def _check_cost(config) -> dict:
  cost = {**DEFAULT_COST, **dict(config.get('cost') or {})}
  if cost['step_time'] is not None and not cost['step_time'] > 0:
    raise ValueError(f'cost.step_time: seconds per step must be > 0, got {cost["step_time"]}.')
  if not cost['bandwidth_gbps'] > 0:
    raise ValueError(f'cost.bandwidth_gbps: must be > 0, got {cost["bandwidth_gbps"]}.')
  if not cost['latency'] >= 0:
    raise ValueError(f'cost.latency: must be >= 0 seconds, got {cost["latency"]}.')
  return cost


def validate(config, model) -> None:
  """Refuses bad settings before anything compiles; joins the cluster if launched.

  Joining (`jax.distributed.initialize`, from the launcher's environment) happens
  here because it must precede the first device query, and counting devices is
  part of validation.
  """
  del model
  s = settings(config)
  if config.stages != 1:
    raise ValueError(f'stages: the data-parallel methods train the whole model on every '
                     f'worker; use stages=1, got {config.stages}.')
  optimizers.check_optimizer(config.optimizer)
  if s.name in OUTER:
    optimizers.check_optimizer(_outer_config(config))
  _check_cost(config)
  multi_process = distributed.initialize_from_env()
  if s.stacked and multi_process:
    raise ValueError('algorithm.stacked: the stacked form runs on one device; it cannot '
                     'span the processes of a multi-process run.')
  if not s.stacked and s.workers > len(jax.devices()):
    raise ValueError(f'workers: {s.workers} workers need {s.workers} devices, but '
                     f'{len(jax.devices())} are visible; lower workers, add devices '
                     f'(XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU, or '
                     f'more processes), or set algorithm.stacked=True.')


def _outer_config(config) -> ml_collections.ConfigDict:
  """`algorithm.outer` (an optimizer config), or DiLoCo's Nesterov SGD 0.7 / 0.9."""
  outer = config.algorithm.get('outer')
  return ml_collections.ConfigDict(DEFAULT_OUTER) if outer is None else outer


def make_optimizer(config, s: Settings):
  """The optimizer of the run: the inner one, wrapped by the averaging transform."""
  inner = optimizers.make_optimizer(config.optimizer, config.train_steps)
  if s.name == 'ssgd':
    return inner
  kwargs = dict(period=s.period, delay=s.delay, axis_name=mesh_lib.AXIS, merge=s.merge,
                mix=s.mix, overlap=s.overlap)
  if s.name in OUTER:
    outer = optimizers.make_optimizer(_outer_config(config),
                                      max(1, config.train_steps // s.period))
    if s.name == 'streaming_diloco':
      return transforms.streaming_diloco(inner, outer, s.period, s.fragments, s.delay, s.mix,
                                         axis_name=mesh_lib.AXIS, overlap=s.overlap)
    return transforms.diloco(inner, outer, **kwargs)
  return transforms.local_sgd(inner, **kwargs)


def make_time_model(config, s: Settings, model, variables,
                    sample_batch) -> timing.StepTimeModel:
  """The virtual clock: compute per step (given or measured once) + all-reduce time.

  Args:
    config: the run's config (`cost`, `optimizer`).
    s: the validated settings.
    model: the `StagedModel`.
    variables: one worker's model variables (one-device arrays).
    sample_batch: one worker's numpy batch, to time a step on.
  """
  cost = _check_cost(config)
  # SSGD all-reduces gradients and BatchNorm statistics; the others the weights.
  nbytes = timing.tree_bytes(variables if s.name == 'ssgd' else variables['params'])
  # Streaming DiLoCo: a 1/P fragment every H/P steps (fragments near-equal in size).
  comm = timing.ring_allreduce_time(nbytes / s.fragments, s.workers,
                                    bandwidth_gbps=cost['bandwidth_gbps'],
                                    latency_s=cost['latency'])
  compute = cost['step_time']
  if compute is None:
    compute = _calibrate(config, model, variables, sample_batch, cost['calibration_steps'])
  # overlap=False runs the all-reduce inside a lax.cond on the merge step: it blocks
  # there, so none of it is hidden. overlap=True runs each period as one program whose
  # one all-reduce (of the stored snapshot) may overlap the `delay` steps before the merge.
  hidden_steps = s.delay if s.overlap else 0
  return timing.StepTimeModel(compute=compute, comm=comm, period=s.period // s.fragments,
                              delay=hidden_steps)


def _calibrate(config, model, variables, batch, repeats: int) -> float:
  """Seconds of one worker's step (forward, backward, inner update) on one device."""
  inner = optimizers.make_optimizer(config.optimizer, config.train_steps)
  one_step = jax.jit(step_lib.make_worker_step(model, inner, average_grads=False))
  opt_state = jax.jit(inner.init)(variables['params'])
  return timing.measure_seconds(one_step, variables, opt_state, batch, repeats=repeats)


def run(run_ctx) -> dict:
  """Trains `config.train_steps` data-parallel steps; returns summary extras.

  The loop never waits for the device, except every 16 steps when this process
  drives several devices (`DataParallelTrainer.maybe_wait`: queuing too many steps
  with collectives deadlocks there) and at evaluation points.
  """
  config, model = run_ctx.config, run_ctx.model
  s = settings(config)
  trainer = DataParallelTrainer(model, make_optimizer(config, s), s.workers,
                                average_grads=s.name == 'ssgd', stacked=s.stacked,
                                **_period_program(s))
  streams = [run_ctx.train_batches(m, s.workers, batch_size=s.batch_size,
                                   sharding=s.data_sharding) for m in trainer.local_workers]
  state = trainer.init(config.seed)
  clock = None
  if config.clock == 'virtual':
    sample = next(run_ctx.train_batches(0, s.workers, batch_size=s.batch_size,
                                        sharding=s.data_sharding))
    clock = make_time_model(config, s, model, trainer.eval_variables(state), sample)
  # Local methods report this process's first worker's loss (see `report_loss`).
  where = None if trainer.replicated else f'worker {trainer.local_workers[0]}'
  step = 0
  while step < config.train_steps:
    # A whole period per program where possible (one all-reduce per period).
    n = trainer.program_length(step, config.train_steps, run_ctx.should_evaluate)
    state, losses = trainer.train_steps(state, [[next(b) for b in streams] for _ in range(n)])
    trainer.maybe_wait(step + n, losses[-1], steps=n)
    for loss in losses:
      step += 1
      run_ctx.report(step, loss=loss,
                     variables=lambda state=state: trainer.eval_variables(state),
                     samples=step * s.global_batch_size, stage=where,
                     sim_time=None if clock is None else clock.elapsed(step))
  return _summary_extras(run_ctx, s, trainer, state, clock, streams)


def _period_program(s: Settings) -> dict:
  """Trainer arguments: whole-period programs for the local methods with overlap."""
  if s.name == 'ssgd' or not s.overlap:
    return {}
  if s.name == 'streaming_diloco':
    return {'period': s.period, 'delay': s.delay, 'fragments': s.fragments}
  return {'period': s.period, 'delay': s.delay}


def _summary_extras(run_ctx, s, trainer, state, clock, streams) -> dict:
  extras = {'workers': s.workers, 'global_batch_size': s.global_batch_size,
            'processes': jax.process_count(), 'stacked': s.stacked,
            'epochs': streams[0].epoch if streams else 0}
  if clock is not None:
    extras['time_model'] = {**dataclasses.asdict(clock),
                            'hidden_fraction': clock.hidden_fraction(),
                            'relative_throughput': clock.relative_throughput()}
  if s.save_params:
    params = trainer.host_params(state)  # Every process: it may involve a collective.
    if run_ctx.is_primary:
      np.savez(os.path.join(run_ctx.workdir, 'params.npz'), **params)
  return extras


ALGORITHMS = {name: Algorithm(name, validate, run, uses_workers=True) for name in NAMES}
