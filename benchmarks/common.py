"""Helpers shared by the benchmarks: timing and table printing."""

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
