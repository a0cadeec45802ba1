"""Helpers shared by the benchmarks: timing, table printing, synthetic data."""

import itertools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np


def median_time(step: Callable[[], object], *, warmup: int = 3, repeats: int = 20) -> float:
  """Median seconds of `step()` (its outputs waited for), after `warmup` calls."""
  for _ in range(warmup):
    jax.block_until_ready(step())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
  """A plain aligned text table."""
  cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  for i, row in enumerate(cells):
    print('  '.join(c.rjust(w) for c, w in zip(row, widths)))
    if i == 0:
      print('  '.join('-' * w for w in widths))


def _fmt(value) -> str:
  if isinstance(value, float):
    return f'{value:.3f}' if abs(value) < 100 else f'{value:.1f}'
  return str(value)


def cycled_batches(shape, classes, batch_size, seed=0, distinct=4):
  """An endless cycle of `distinct` random host batches, made once: drawing each step's
  batch afresh would make a benchmark measure the data (a 512 x 1536 batch took the
  driver 8.8 ms of CPU here, `real_speedup`)."""
  rng = np.random.default_rng(seed)
  return itertools.cycle(
    [
      {
        'image': rng.standard_normal((batch_size,) + tuple(shape)).astype(np.float32),
        'label': rng.integers(0, classes, batch_size).astype(np.int32),
      }
      for _ in range(distinct)
    ]
  )
