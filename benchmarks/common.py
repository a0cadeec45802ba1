"""Helpers shared by the benchmarks: timing, table printing, synthetic data."""

import errno
import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
import psutil


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


_TICKS = os.sysconf('SC_CLK_TCK')


def thread_cpu_seconds(pid: int | str = 'self') -> dict[int, tuple[str, float]]:
  """Each thread of process `pid` (Linux, `/proc`): (its OS name, CPU seconds so far).
  This process's threads are read from their own CPU clocks (exact, whichever thread
  reads them); another process's from the scheduler's nanoseconds (`thread_seconds`:
  `schedstat`, up to a clock tick behind for a thread running as it is read), else from
  `stat`'s clock ticks (10 ms each: a window must hold seconds of a thread's CPU for its
  reading to mean much)."""
  threads = {}
  own = str(pid) in ('self', str(os.getpid()))
  for tid in os.listdir(f'/proc/{pid}/task'):
    try:
      with open(f'/proc/{pid}/task/{tid}/comm') as f:
        name = f.read().strip()
      used = _own_thread_seconds(int(tid)) if own else None
      if used is None:
        used = thread_seconds(f'/proc/{pid}/task/{tid}')
    except OSError:  # ended meanwhile
      continue
    threads[int(tid)] = (name, used)
  return threads


def thread_cpu_used(before: dict, after: dict) -> dict[int, tuple[str, float]]:
  """Each thread's (OS name, CPU seconds used) between two `thread_cpu_seconds`, those
  that used some; a thread new since `before`, counted from zero."""
  used = {}
  for tid, (name, seconds) in after.items():
    delta = seconds - before.get(tid, (name, 0.0))[1]
    if delta > 0:
      used[tid] = (name, delta)
  return used


def _own_thread_seconds(tid: int) -> float | None:
  """The CPU clock of thread `tid` of this process (Linux: the clock id the C library's
  `pthread_getcpuclockid` makes, `CPUCLOCK_SCHED` of that thread); None where the system
  has no such clock."""
  try:
    return time.clock_gettime(((~tid) << 3) | 6)
  except OSError as error:
    if error.errno == errno.EINVAL and os.path.exists(f'/proc/self/task/{tid}'):
      return None  # no per-thread clocks here: the caller reads /proc instead
    raise  # the thread ended meanwhile (its clock is gone): the caller leaves it out


def thread_seconds(path: str) -> float:
  """CPU seconds of the thread whose `/proc` directory is `path`: `schedstat`'s first
  field (nanoseconds), unless the system keeps none (no file, or all its fields 0: the
  scheduler's statistics switched off), then `stat`'s user and system clock ticks."""
  try:
    with open(f'{path}/schedstat') as f:
      fields = [int(field) for field in f.read().split()]
  except (OSError, ValueError):
    fields = []
  if any(fields):
    return fields[0] / 1e9
  with open(f'{path}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / _TICKS


def core_busy_seconds() -> list[float]:
  """Each core's busy seconds so far: its CPU time less idle and I/O wait (psutil)."""
  return [sum(t) - t.idle - getattr(t, 'iowait', 0.0) for t in psutil.cpu_times(percpu=True)]


def overlap(begin: float, end: float, start: float, stop: float) -> float:
  """Seconds of the interval [begin, end] inside the window [start, stop] (0 outside it)."""
  return max(0.0, min(end, stop) - max(begin, start))


def update_ends(updates: Iterable[tuple[int, int, float]]) -> dict[int, float]:
  """Per batch, the end of its last update (`updates`: (lane, batch, end) of update
  tasks), for the batches updated on as many lanes as any: a whole iteration of every
  updating lane. A pipeline that does not drain leaves the last batches out: DDG's stage
  k applies the gradients of the first `steps - (K-1-k)` batches only, so the last K-1
  batches' last updates (on stages 1..K-1) end with stage 0's last, in the same
  iteration; counted as iterations, they shortened its time per iteration by a factor
  of 1 - (K-1)/(iterations counted)."""
  lanes, ends = {}, {}
  for lane, batch, end in updates:
    lanes.setdefault(batch, set()).add(lane)
    ends[batch] = max(ends.get(batch, end), end)
  most = max((len(on) for on in lanes.values()), default=0)
  return {batch: ends[batch] for batch in sorted(ends) if len(lanes[batch]) == most}


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


def family_lanes(family: str, lanes: int, core=lambda k: k) -> list[str]:
  """The placement (`LanePlacement` text, one entry per lane) of scheduler family `family`
  with `lanes` (K) lanes, lane k on core `core(k)`; the parameter server, the shared model
  and the all-reduce beside lane 0. Families: `bp`/`ddg`/`local` (K stages), `asgd`/
  `dcasgd` (K workers), `pdasgd` (1 forward, K-1 backward workers), `lppsgd` (K replicas).
  Lane names are those `placement.lane_name` gives each family's cluster lanes."""
  if family in ('bp', 'ddg', 'local'):
    return [f'stage{k}@cores={core(k)}' for k in range(lanes)]
  if family in ('asgd', 'dcasgd'):
    return [f'server@cores={core(0)}'] + [f'worker{k}@cores={core(k)}' for k in range(lanes)]
  if family == 'pdasgd':
    backward = [f'backwardworker{k - 1}@cores={core(k)}' for k in range(1, lanes)]
    return [f'sharedmodel@cores={core(0)}', f'forwardworker0@cores={core(0)}', *backward]
  if family == 'lppsgd':
    replicas = [f'worker{k}.0@cores={core(k)}' for k in range(lanes)]
    return replicas + ([f'allreduce@cores={core(0)}'] if lanes > 1 else [])  # one: no average
  raise ValueError(f'family_lanes: unknown family {family!r}')


def unplaced_lanes(family: str, lanes: int) -> list[str]:
  """`family_lanes` of `family` with `lanes` lanes, none pinned to a core (each lane its
  name alone: a virtual run whose lanes share no core, or emulated lanes)."""
  return [lane.split('@')[0] for lane in family_lanes(family, lanes)]


def send_delays(lane_names: Mapping[int, str], tasks, kind: str = 'backward') -> list[float]:
  """Seconds from the end of each `kind` task to the start of the first copy its lane
  sent of the same batch after it. `tasks`: `(lane, kind, start, end, batch)` tuples of
  a run; a copy is a task on a link lane, named 'link <sender> → <receiver>'
  (`Cluster.link`). For an ASGD worker: from its gradient existing to its push leaving,
  which the process executor's driver sends only once it has heard that the backward
  ended (a worker waits for its backward: `asgd.RUN_AHEAD`). Tasks without a batch, or
  whose lane sent no copy of their batch after them, are left out."""
  copies = {}  # (sender, batch) -> the starts of its copies of that batch
  for lane, _, start, _, batch in tasks:
    name = lane_names[lane]
    if batch is not None and name.startswith('link ') and ' → ' in name:
      copies.setdefault((name[len('link ') :].split(' → ')[0], batch), []).append(start)
  delays = []
  for lane, task_kind, _, end, batch in tasks:
    if task_kind != kind or batch is None:
      continue
    later = [start for start in copies.get((lane_names[lane], batch), ()) if start >= end]
    if later:
      delays.append(min(later) - end)
  return delays
