"""Runs that cannot fit are refused before they start: memory per worker, threads.

An asynchronous run keeps state per worker: its data stream (a shuffled index array
of the training split, and the index range it shuffles), the weights it pulled, the
gradient it sends, the activations its forward keeps for the backward, and for
DC-ASGD the server's backup of the weights that worker read; replicas (LPP-SGD) and
stacked data-parallel workers add weights and optimizer state each. `estimate` adds
these up from the shapes of the model's variables and of its optimizer state
(`jax.eval_shape`: nothing is computed or compiled), and `check` refuses a run whose
estimate exceeds the memory available now (`MemAvailable` of /proc/meminfo, else
`os.sysconf`), naming the field that sets the worker count and the estimate.

The constants are measured, and kept below the measurement so that what is refused
surely cannot fit: `asgd` on the virtual clock, mnist1d/5k, 4,000 steps, peak RSS
growth between two worker counts: an MLP 64-64-64 (46 KB of
weights) costs 636 KB per worker, an MLP 256-256-256 (579 KB) 2.45 MB per worker,
i.e. ~475 KB + 3.5 x the weights; the estimate charges the data stream (64 KB here)
+ `WEIGHT_COPIES` (3) x the weights + `PER_WORKER_OVERHEAD` (256 KiB): 458 KB and
2.06 MB, 72-82 % of the measured.

On the real clock the asynchronous algorithms run one thread per worker (and one for
a server); more than `MAX_THREADS` is refused: they would only take turns on this
machine's cores. The virtual clock simulates any number of workers in one thread.
"""

import dataclasses
import os

import jax
import numpy as np

from jaxsgd import optimizers

MAX_THREADS = 512
INDEX_BYTES = 8  # The data streams' index arrays are int64.
WEIGHT_COPIES = 3  # Per worker: pulled weights, gradient, activations (measured ~3.5x).
PER_WORKER_OVERHEAD = 256 * 1024  # Python and XLA objects of a worker (measured ~400 KB).


@dataclasses.dataclass(frozen=True)
class Footprint:
  """What one run keeps: `workers` data streams and worker states, `replicas` copies
  of the weights and optimizer state; `threads` on the real clock."""

  field: str  # The config field(s) that set the worker count.
  workers: int
  per_worker: int  # Bytes each worker holds beyond its data stream.
  streams: int  # Data streams (one per worker that reads data).
  replicas: int  # Copies of weights + optimizer state (server, replicas, stacked).
  threads: int  # Real-clock threads (0: none of their own).


def tree_bytes(tree) -> int:
  return int(
    sum(
      np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
      for x in jax.tree_util.tree_leaves(tree)
    )
  )


def model_bytes(model, shared) -> tuple[int, int, int]:
  """`(variables, params, optimizer state)` bytes of `model`, from shapes alone."""
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0)))
  tx = optimizers.make_optimizer(shared.optimizer, shared.train_steps)
  opt_state = jax.eval_shape(tx.init, variables['params'])
  return tree_bytes(variables), tree_bytes(variables['params']), tree_bytes(opt_state)


def footprint(name: str, settings, sizes: tuple[int, int, int]) -> Footprint | None:
  """The per-worker state of algorithm `name` with `settings`; None if it keeps none."""
  variables, params, opt_state = sizes
  real = not settings.shared.virtual
  if name in ('asgd', 'dcasgd'):
    workers = settings.server.num_workers
    backup = params if name == 'dcasgd' else 0
    return Footprint(
      'workers', workers, WEIGHT_COPIES * variables + backup, workers, 1, workers + 1 if real else 0
    )
  if name == 'lppsgd':
    workers = settings.devices * settings.workers_per_device
    return Footprint(
      'algorithm.devices x algorithm.workers_per_device',
      workers,
      WEIGHT_COPIES * variables,
      workers,
      settings.devices,
      workers if real else 0,
    )
  if name == 'pdasgd':
    workers = settings.n_fwd + settings.n_bwd
    return Footprint(
      'algorithm.n_fwd + algorithm.n_bwd',
      workers,
      WEIGHT_COPIES * variables,
      settings.n_fwd,
      1,
      workers + 1 if real else 0,
    )
  if name in ('ssgd', 'local_sgd', 'dasgd', 'diloco'):
    workers = settings.workers
    replicas = workers if settings.stacked else 1
    return Footprint('workers', workers, params if settings.stacked else 0, workers, replicas, 0)
  return None


def estimate(name: str, settings, model, num_train: int) -> tuple[Footprint, int] | None:
  """`(footprint, bytes)` of algorithm `name`'s per-worker state; None if it keeps none."""
  sizes = model_bytes(model, settings.shared)
  fp = footprint(name, settings, sizes)
  if fp is None:
    return None
  variables, _, opt_state = sizes
  stream = 2 * INDEX_BYTES * num_train  # The shuffled order and the range it shuffles.
  total = (
    fp.streams * stream
    + fp.workers * (fp.per_worker + PER_WORKER_OVERHEAD)
    + fp.replicas * (variables + opt_state)
  )
  return fp, total


def available_bytes() -> int:
  """Memory available to a new allocation now (bytes)."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def check(name: str, settings, model, dataset) -> None:
  """Refuses a run of algorithm `name` that cannot fit (see the module docstring)."""
  result = estimate(name, settings, model, dataset.num_train)
  if result is None:
    return
  fp, total = result
  if fp.threads > MAX_THREADS:
    raise ValueError(
      f'{fp.field}: {fp.workers} workers on the real clock would run '
      f'{fp.threads} threads (one per worker), more than {MAX_THREADS}; '
      f'use clock=virtual to simulate that many workers, or fewer workers.'
    )
  available = available_bytes()
  if total > available:
    raise ValueError(
      f'{fp.field}: {fp.workers} workers need at least {_gib(total)} of '
      f'per-worker state (data streams, weights, gradients and activations in flight'
      f'{", backups" if name == "dcasgd" else ""}, replicas), more than the '
      f'{_gib(available)} of memory available; use fewer workers, a smaller '
      f'model or dataset.'
    )


def _gib(nbytes: int) -> str:
  return f'{nbytes / 2**30:.1f} GiB'
