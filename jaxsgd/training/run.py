"""The run context every algorithm reports to: metrics, evaluation, progress, plots.

An algorithm calls `run.report(step, loss=..., variables=...)` after each of its
steps. `report` keeps the loss as a device array (no sync). Every `CHECK_EVERY_STEPS`
steps (or `CHECK_EVERY_S` seconds) it looks at the losses that are *already
computed* (`jax.Array.is_ready`: no wait) and stops the run at the first NaN/inf,
naming its step; it waits for pending losses only when more than
`WAIT_AFTER_STEPS` are still unchecked. So a loss that becomes NaN at step 2 is
reported as step 2 within a few dozen steps, whatever `eval_every` is. At
evaluation points (every `eval_every` steps and at the end) it pulls the rest of the
losses to the host, evaluates on the test split and appends one line to
`metrics.jsonl`. While the run has not reached `config.target_accuracy`, it also checks
the test accuracy every `target_check_every(train_steps)` steps (1 % of the run), so that
the step and time the target is first reached are known to 1 % of the run rather than to
`eval_every`; a check writes no record and reads the model only (the same
`variables()` an evaluation reads), so the training is the same with and without it.
`finish()` writes `summary.json` and `curves.png`. Process 0 holds
the workdir (`files.WorkdirLock`, taken by `training.workdir.claim` before the run
starts) to the end of `finish()`, or of `abort()` after a failure, and writes every
file through `jaxsgd.training.files` (atomic, valid JSON, whole lines).
"""

import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tqdm

from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.data import Dataset
from jaxsgd.errors import NonFiniteLossError, Preempted
from jaxsgd.models import StagedModel
from jaxsgd.training import checkpoints as checkpoints_lib
from jaxsgd.training import files
from jaxsgd.training import outputs
from jaxsgd.training import plots
from jaxsgd.training import workdir as workdir_lib

CHECK_EVERY_STEPS = 16  # Look at the computed losses this often (no wait) ...
CHECK_EVERY_S = 1.0  # ... or after this many seconds,
WAIT_AFTER_STEPS = 128  # and wait for them when this many are still unchecked.
TARGET_RESOLUTION = 0.01  # Time to target is found to this fraction of the run's steps.
_BAR_DELAY = 1e-6  # s: any delay at all keeps tqdm from drawing the bar before its first update


def target_check_every(train_steps: int, period: int = 1) -> int:
  """Steps between two checks of the target: ceil(1 % of `train_steps`), made a multiple
  of `period` (the steps a data-parallel program runs at once: only at its end are the
  weights those of the step reported) where that stays within 1 %, else `period`."""
  every = max(1, math.ceil(TARGET_RESOLUTION * train_steps))
  return max(period, every // period * period)


class Run:
  """Collects what one training run reports; writes the workdir's files."""

  def __init__(
    self,
    config,
    workdir: str,
    dataset: Dataset,
    model: StagedModel,
    *,
    show_progress: bool = True,
    lock: files.WorkdirLock | None = None,
    checkpointer: checkpoints_lib.Checkpointer | None = None,
    resume: dict | None = None,
    preemption: checkpoints_lib.PreemptionWatch | None = None,
    program_period: int = 1,
  ):
    """See the class docstring; `resume` is the `meta` of the checkpoint to continue from
    (`checkpoints.latest_meta`): its metrics are written again and continued;
    `program_period`: the steps the algorithm runs as one program (`target_check_every`)."""
    self.config = config
    self.workdir = workdir
    self.dataset = dataset
    self.model = model
    # In a multi-process run (jax.distributed initialized before this) every process
    # trains and evaluates; only process 0 writes files and shows progress.
    self.is_primary = jax.process_index() == 0
    # Refuses a workdir another run is using before anything in it is touched
    # (`train_and_evaluate` has taken it already, with `training.workdir.claim`).
    if lock is None and self.is_primary:
      lock = files.WorkdirLock(workdir).acquire()
    self._lock = lock
    self.records: list[dict[str, Any]] = []
    self._pending: list[tuple[int, Any, str | None]] = []  # (step, loss, stage)
    self._checked: list[float] = []  # Host values of the first len(_checked) pending.
    self._last_check = time.monotonic()
    self._next_check = CHECK_EVERY_STEPS  # len(_pending) at which to check next.
    self._eval_step = stages_lib.make_eval_step(model.full().apply)
    self._start = time.perf_counter()
    self._checkpointer = checkpointer
    self._resume = resume
    self.preemption = preemption
    self._resumable = False  # The algorithm restores and saves checkpoints (`restore`).
    self._metrics_file = (
      files.JsonLinesWriter(os.path.join(workdir, 'metrics.jsonl'), 'w')
      if self.is_primary
      else None
    )
    self._tensorboard = _tensorboard_writer(config, workdir) if self.is_primary else None
    self._target = config.get('target_accuracy')
    self.time_to_target: dict[str, float] | None = None
    self.target_check_every = target_check_every(config.train_steps, program_period)
    self.target_checks = 0  # Checks of the target between evaluations (not recorded).
    self._progress = tqdm.tqdm(
      total=config.train_steps,
      unit='step',
      dynamic_ncols=True,
      disable=not (show_progress and self.is_primary),
      desc=config.algorithm.name,
      # Drawn at the first step, not before: what the run prints while it starts (the
      # lane processes it waits for) then has lines of its own, not the end of the bar's.
      delay=_BAR_DELAY,
    )
    if resume is not None:
      self._continue(resume)

  # --- checkpoints ------------------------------------------------------------------
  def _continue(self, meta: dict) -> None:
    """Takes up the metrics of a checkpoint: its records (written again, so that lines
    written after the checkpoint are dropped), the losses since its last evaluation,
    its wall time and time to target."""
    for record in meta['records']:
      self.records.append(record)
      if self._metrics_file is not None:
        self._metrics_file.write(record)
    self._pending = [(step, value, stage) for step, value, stage in meta['losses']]
    self._checked = [value for _, value, _ in meta['losses']]
    self._next_check = len(self._pending) + CHECK_EVERY_STEPS
    self._start -= meta['wall_time']
    self.time_to_target = meta['time_to_target']
    self._progress.update(meta['step'])

  def restore(self, template, streams=()) -> tuple[int, Any] | None:
    """The step and state to continue from, or None to start afresh.

    Calling it tells the run that the algorithm checkpoints (`maybe_save`). When the
    run resumes, the checkpoint's state comes back in `template`'s structure and
    shardings (`template` None: as it was saved, arrays on the devices they were on),
    and `streams` (the `BatchIterator`s the algorithm reads, in the order
    given to `maybe_save`) are moved to where they were.
    """
    self._resumable = True
    if self._resume is None:
      return None
    positions = self._resume['streams']
    if len(positions) != len(streams):
      raise ValueError(
        f'checkpoint: it holds {len(positions)} data streams, this run reads {len(streams)}.'
      )
    for stream, position in zip(streams, positions, strict=True):
      stream.seek(position)
    step = self._resume['step']
    return step, self._checkpointer.restore(step, template)

  def maybe_save(self, step: int, state, streams=(), *, steps: int = 1) -> None:
    """Saves a checkpoint of step `step` (after its `report`) when one is due: every
    `checkpoint_every` steps, at the last step, or after SIGTERM, when it then stops
    the run with `errors.Preempted`.

    Args:
      step: the steps done.
      state: every array the algorithm needs to continue (a pytree), or a function
        returning it (called only when a checkpoint is saved).
      streams: the data streams it reads (their positions are saved).
      steps: the steps of the program that ended at `step` (a whole period): a
        checkpoint due at any of them is saved now, at `step`.
    """
    preempted = self.preemption is not None and self.preemption.due(step)
    due = self._checkpointer is not None and any(
      self._checkpointer.due(t) for t in range(step - steps + 1, step + 1)
    )
    if self._checkpointer is None or not (preempted or due):
      return
    self.check_losses(wait=True)  # The losses since the last evaluation, as numbers.
    state = state() if callable(state) else state  # Built only when saved.
    meta = {
      'step': step,
      'streams': [stream.position for stream in streams],
      'records': self.records,
      'losses': [[s, value, where] for (s, _, where), value in zip(self._pending, self._checked)],
      'wall_time': time.perf_counter() - self._start,
      'time_to_target': self.time_to_target,
      'config': workdir_lib.as_json(self.config),
    }
    self._checkpointer.save(step, state, meta)
    if preempted:
      raise Preempted(
        f'SIGTERM: stopped after saving the checkpoint of step {step} in '
        f'{checkpoints_lib.directory(self.workdir)}; run again with the same config and '
        f'workdir to resume.'
      )

  # --- data -----------------------------------------------------------------
  def train_batches(
    self,
    worker: int = 0,
    num_workers: int = 1,
    *,
    batch_size: int | None = None,
    sharding: str = 'stream',
  ):
    """Worker `worker`'s deterministic batch stream (seeded by `config.seed`)."""
    return self.dataset.train_batches(
      batch_size or self.config.batch_size,
      seed=self.config.seed,
      worker=worker,
      num_workers=num_workers,
      sharding=sharding,
    )

  # --- reporting --------------------------------------------------------------
  def should_evaluate(self, step: int) -> bool:
    return step % self.config.eval_every == 0 or step >= self.config.train_steps

  def should_check_target(self, step: int) -> bool:
    """Whether step `step` checks the target's accuracy (no record): not yet reached,
    not an evaluation point (which checks it anyway), every `target_check_every` steps."""
    return (
      bool(self._target)
      and self.time_to_target is None
      and step % self.target_check_every == 0
      and not self.should_evaluate(step)
    )

  def report(
    self,
    step: int,
    *,
    loss,
    variables: Callable[[], Any] | Any,
    samples: int,
    sim_time: float | None = None,
    extra: Callable[[], dict] | dict | None = None,
    stage: str | None = None,
  ) -> None:
    """Records step `step`'s training loss; evaluates at evaluation points.

    Args:
      step: 1-based count of the algorithm's steps (updates of the model).
      loss: this step's training loss (a device scalar; never synced here).
      variables: the full model's variables, or a function returning them (only
        called at evaluation points).
      samples: training examples consumed so far (all workers).
      sim_time: simulated seconds so far (virtual clock), if any.
      extra: more metrics for the record (or a function returning them).
      stage: which stage/worker the loss came from, named if it is not finite.
    """
    self._pending.append((step, loss, stage))
    self._progress.update(step - self._progress.n)
    if self.preemption is not None and self.preemption.interrupt_lost():
      raise KeyboardInterrupt(f'Ctrl-C, its first KeyboardInterrupt lost; stopped at step {step}')
    if not self._resumable and self.preemption is not None and self.preemption.requested:
      raise Preempted(
        f'SIGTERM: stopped at step {step}; {self.config.algorithm.name} writes no '
        f'checkpoints yet, so a new run starts over.'
      )
    if self.should_check_target(step):
      self._check_target(step, variables, samples, sim_time)
    if not self.should_evaluate(step):
      if (
        len(self._pending) >= self._next_check
        or time.monotonic() - self._last_check >= CHECK_EVERY_S
      ):
        self.check_losses()
      return
    train_loss = self._drain_losses()
    variables = variables() if callable(variables) else variables
    record = {
      'step': step,
      'samples': int(samples),
      'epoch': samples / self.dataset.num_train,
      'wall_time': time.perf_counter() - self._start,
      'train_loss': train_loss,
      **self.evaluate(variables),
    }
    if 'test_perplexity' in record:
      record['train_perplexity'] = math.exp(train_loss)
    if sim_time is not None:
      record['sim_time'] = float(sim_time)
    record.update((extra() if callable(extra) else extra) or {})
    self._log(record)

  def _check_target(self, step, variables, samples, sim_time) -> None:
    """Evaluates step `step`'s model; records the time to target if it is reached. The
    evaluation runs on the host between two reports: the simulated time is the step's,
    and on a real clock the wall time includes the checks, as it includes evaluations."""
    self.target_checks += 1
    variables = variables() if callable(variables) else variables
    accuracy = self.evaluate(variables)['test_accuracy']
    record = {
      'step': step,
      'samples': int(samples),
      'wall_time': time.perf_counter() - self._start,
      'test_accuracy': float(accuracy),
    }
    if sim_time is not None:
      record['sim_time'] = float(sim_time)
    self._note_target(record)

  def _note_target(self, record) -> None:
    if self._target and self.time_to_target is None and record['test_accuracy'] >= self._target:
      self.time_to_target = {
        k: record[k]
        for k in ('step', 'samples', 'wall_time', 'sim_time', 'test_accuracy')
        if k in record
      }

  def check_losses(self, *, wait: bool = False) -> None:
    """Checks the pending losses already computed (all of them if `wait`, or if more than
    `WAIT_AFTER_STEPS` are unchecked) for NaN/inf, without waiting for the others.

    Raises:
      NonFiniteLossError: naming the first step whose loss is not finite.
    """
    self._last_check = time.monotonic()
    self._next_check = len(self._pending) + CHECK_EVERY_STEPS
    start = len(self._checked)
    unchecked = self._pending[start:]
    wait = wait or len(unchecked) > WAIT_AFTER_STEPS
    ready = len(unchecked) if wait else _ready_prefix([loss for _, loss, _ in unchecked])
    if not ready:
      return
    values = np.asarray(
      jax.device_get([loss for _, loss, _ in unchecked[:ready]]), np.float64
    ).reshape(ready)
    # A loss that a lost worker's lane took with it (`ProcessExecutor.deferred`) is NaN and
    # known as lost: left out of the checks and of the mean, not a divergence.
    lost = np.array([getattr(loss, 'lost', False) for _, loss, _ in unchecked[:ready]], bool)
    bad = np.flatnonzero(~np.isfinite(values) & ~lost)
    if bad.size:
      step, _, where = unchecked[bad[0]]
      place = f' at stage/worker {where}' if where is not None else ''
      raise NonFiniteLossError(
        f'training loss became {values[bad[0]]} at step {step}{place}; '
        f'lower optimizer.learning_rate or check the data.'
      )
    self._checked.extend(values.tolist())

  def _drain_losses(self) -> float:
    self.check_losses(wait=True)
    kept = [value for value in self._checked if not np.isnan(value)]  # (lost ones: NaN)
    mean = float(np.mean(kept)) if kept else math.nan
    self._pending.clear()
    self._checked.clear()
    self._next_check = CHECK_EVERY_STEPS
    return mean

  def evaluate(self, variables) -> dict[str, float]:
    """Test loss and accuracy of the full model over the whole test split; for a language
    model (`per_token`) also its perplexity, exp(loss per token)."""
    batch_size = self.config.get('eval_batch_size', 1000)
    totals = np.zeros(3)
    for batch, mask in self.dataset.test_batches(min(batch_size, self.dataset.num_test)):
      totals += np.asarray(jax.device_get(self._eval_step(variables, batch, mask)))
    metrics = {'test_loss': totals[0] / totals[2], 'test_accuracy': totals[1] / totals[2]}
    if getattr(self.model, 'per_token', False):  # a language model: its loss is nats per token
      metrics['test_perplexity'] = math.exp(metrics['test_loss'])
    return metrics

  def _log(self, record):
    record = {
      k: (float(v) if isinstance(v, (np.floating, np.integer)) else v) for k, v in record.items()
    }
    self.records.append(record)
    if self._metrics_file is not None:
      self._metrics_file.write(record)
    if self._tensorboard is not None:
      for key, value in record.items():
        if isinstance(value, (int, float)) and key != 'step':
          self._tensorboard.add_scalar(key, value, record['step'])
      self._tensorboard.flush()
    self._progress.set_postfix(
      loss=f'{record["train_loss"]:.3f}', acc=f'{100 * record["test_accuracy"]:.1f}%'
    )
    if record['step'] >= self.config.train_steps:  # the last: what the run logs after it
      self._progress.close()  # (a family's summary line) comes on a line of its own
    self._note_target(record)

  # --- the end ------------------------------------------------------------------
  def finish(self, extra_summary: dict | None = None) -> dict[str, Any]:
    """Writes `summary.json` and `curves.png`, releases the workdir; returns the summary."""
    self.close()
    final = self.records[-1] if self.records else {}
    summary = {
      'final': final,
      'best_test_accuracy': max((r['test_accuracy'] for r in self.records), default=math.nan),
      'time_to_target': self.time_to_target,
      'target_accuracy': self._target,
      # The time to target is exact to this many steps: checks and evaluations together.
      'target_resolution_steps': min(self.target_check_every, self.config.eval_every),
      'target_checks': self.target_checks,
      'config': self.config.to_dict(),
      **(extra_summary or {}),
    }
    summary.update(self._throughput(final, summary.get('sim_time', final.get('sim_time'))))
    if not self.is_primary:
      return summary
    try:
      files.write_json(os.path.join(self.workdir, 'summary.json'), summary)
      if self.records:
        with files.atomic_path(os.path.join(self.workdir, 'curves.png')) as path:
          plots.plot_curves(
            self.records,
            path,
            title=f'{self.config.algorithm.name} · {self.config.model.name}'
            f' · {self.config.dataset}',
            target=self._target,
          )
    finally:
      self._lock.release()
    return summary

  def _throughput(self, final: dict, sim_time: float | None) -> dict:
    """A language model's training tokens per second over the whole run, in wall time
    (to its last step: the evaluations before it included) and, on the virtual clock, in
    simulated time (`sim_time`: a scheduler run's makespan, else the last step's): every
    example is `input_shape` tokens, each predicted once."""
    if not getattr(self.model, 'per_token', False) or not final:
      return {}
    tokens = final['samples'] * math.prod(self.dataset.input_shape)
    rates = {'wall': tokens / final['wall_time']}
    if sim_time:
      rates['simulated'] = tokens / sim_time
    return {'tokens': tokens, 'tokens_per_second': rates}

  def abort(self, *, refused: bool = False) -> None:
    """After a failure: closes the files and releases the workdir (what was written
    stays, e.g. for a look at the metrics before the failure). `refused`: the input was
    refused (a `ValueError`: a placement, a profile, found bad once the run started);
    if nothing was recorded yet, the files this run opened are removed, so that the
    corrected command is not refused for them."""
    self.close()
    if refused and not self.records and self._resume is None and self.is_primary:
      for name in ('metrics.jsonl', 'tensorboard'):
        path = os.path.join(self.workdir, name)
        if os.path.isdir(path):
          shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
          os.unlink(path)
    if self._lock is not None:
      self._lock.release()

  # --- files an algorithm leaves ---------------------------------------------------
  def write_schedule_outputs(
    self,
    timeline,
    staleness: dict,
    *,
    cost_table: dict | None,
    epochs: float,
    title: str,
    extra: dict | None = None,
  ) -> dict:
    """`trace.json` and `staleness.png` of a scheduler run; returns its summary fields. A
    run priced by a hardware preset (`cost.device`) names its lanes by the preset's device."""
    return outputs.write_outputs(
      self.workdir,
      timeline,
      staleness,
      train_steps=self.config.train_steps,
      cost_table=cost_table,
      epochs=epochs,
      title=title,
      extra=extra,
      device=(self.config.get('cost') or {}).get('device'),
    )

  def write_arrays(self, name: str, arrays: dict) -> None:
    """`arrays` as `name` (an .npz file) in the workdir; only process 0 writes."""
    if self.is_primary:
      name = name if name.endswith('.npz') else f'{name}.npz'  # As np.savez names it.
      with files.atomic_open(os.path.join(self.workdir, name), 'wb') as f:
        np.savez(f, **arrays)

  def write_agreement(self, steps, cosines, title: str) -> None:
    """`grad_cosine.npz` (`steps`, `cosines` (measurements, K)) and `grad_cosine.png`."""
    self.write_arrays('grad_cosine', {'steps': steps, 'cosines': cosines})
    if self.is_primary:
      with files.atomic_path(os.path.join(self.workdir, 'grad_cosine.png')) as path:
        plots.plot_agreement(steps, cosines, path, title=title)

  def close(self) -> None:
    self._progress.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
    if self._metrics_file is not None:
      self._metrics_file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def _ready_prefix(losses) -> int:
  """How many of `losses`, from the first, are computed (never waits for one)."""
  for i, loss in enumerate(losses):
    is_ready = getattr(loss, 'is_ready', None)
    if is_ready is not None and not is_ready():
      return i
  return len(losses)


def _tensorboard_writer(config, workdir):
  """A standard TensorBoard event writer (tensorboardX) when `config.tensorboard`."""
  if not config.get('tensorboard', False):
    return None
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      "tensorboard: install the extra with pip install 'jaxsgd[tensorboard]'"
    ) from e
  return SummaryWriter(os.path.join(workdir, 'tensorboard'))
