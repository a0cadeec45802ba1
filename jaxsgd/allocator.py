"""The C allocator of a process that runs tasks: freed memory kept for the next task.

A lane process (`scheduler/lanes/runtime.py`) sets it at its start, before JAX starts
(nothing of JAX is imported here), and so does a process that measures task costs
(`experiments.profile`, `benchmarks/simulator_accuracy.py`): a task's cost must not depend
on where the C library happened to put its heap. Only glibc is tuned (`mallopt`); another
C library is left as it is.
"""

import ctypes

# glibc's `mallopt` parameters (malloc.h) and what a task process sets them to.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 64 << 20  # bytes: a buffer below this comes from memory freed before
TRIM_THRESHOLD = 128 << 20  # bytes: free memory kept for the next buffers
TOP_PAD = 64 << 20  # bytes: what the heap grows, and keeps, beyond what it needs


def keep_freed_memory() -> bool:
  """Makes this process's allocator serve buffers (below `MMAP_THRESHOLD`) from memory
  freed before, keeping up to `TRIM_THRESHOLD` of it and growing its heap by `TOP_PAD` at
  a time (glibc's `mallopt`); False where the C library has no `mallopt`.

  Why: every page of a fresh mapping faults at its first touch (what one costs:
  `benchmarks/results/ad_hoc_measurements.md`).
  glibc maps a large buffer afresh above a threshold that rises and falls with what was
  freed, and gives back the top of its heap: a copy of 1 MiB between two lane processes
  took 0.6 or 2.6 ms by spells, 0.55 ms with the thresholds set
  (`benchmarks/results/schedule_error.md`); a whole MLP's forward (its residuals, ~24-44
  MB) faulted 5-11 thousand pages at every call in 5 of 9 fresh processes with the
  thresholds alone (36-47 ms against 29-30), in none of 12 with the top pad too
  (`benchmarks/results/ad_hoc_measurements.md`)."""
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  settings = (
    (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    (_M_TOP_PAD, TOP_PAD),
  )
  return all([mallopt(parameter, value) for parameter, value in settings])
