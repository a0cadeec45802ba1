"""What every scheduler run leaves behind: its trace, staleness plot and summary fields."""

import dataclasses
import logging
import math
import os
import re

import numpy as np

from jaxsgd.training import files
from jaxsgd.training import plots


def write_outputs(
  workdir: str,
  timeline,
  staleness: dict[str, np.ndarray],
  *,
  train_steps: int,
  cost_table: dict | None,
  epochs,
  title: str,
  extra: dict | None = None,
  device: str | None = None,
) -> dict:
  """Writes `trace.json`, `staleness.png` and its data, `staleness.npz` (every update's
  staleness, per group, in the order applied); returns the run's summary fields.

  Args:
    workdir: where the files go.
    timeline: what the executor ran.
    staleness: the staleness of every applied update, per stage, layer or worker.
    train_steps: the run's steps (for the time per step).
    cost_table: the seconds per `(stage, kind)` the virtual clock or the emulated tasks
      used (None: tasks computed on the real clock).
    epochs: epochs of data consumed.
    title: the staleness plot's title.
    extra: more summary fields.
    device: the hardware preset that priced the tasks (`cost.device`), if any: the lanes
      are named by it (`stage 0 (h100)`), not by the device that ran them here.
  """
  if device is not None:
    timeline = dataclasses.replace(
      timeline, lane_names=[priced_lane_name(n, device) for n in timeline.lane_names]
    )
  files.write_json(os.path.join(workdir, 'trace.json'), timeline.chrome_trace(), indent=None)
  with files.atomic_path(os.path.join(workdir, 'staleness.png')) as path:
    plots.plot_staleness(staleness, path, title=title)
  with files.atomic_open(os.path.join(workdir, 'staleness.npz'), 'wb') as f:
    np.savez(f, **staleness)  # every update's staleness, per group, in the order applied
  every = np.concatenate([v for v in staleness.values()] or [np.zeros(0, np.int64)])
  values, counts = np.unique(every, return_counts=True)
  summary = {
    'clock': timeline.clock,
    'epochs': epochs,
    'makespan': timeline.makespan,
    'mean_staleness': float(every.mean()) if every.size else math.nan,
    'staleness_histogram': {int(v): int(n) for v, n in zip(values, counts)},
    'time_per_step': timeline.makespan / train_steps,
    'utilization': timeline.utilization(),
    'staleness': {
      name: {
        'mean': float(v.mean()) if v.size else math.nan,
        'max': int(v.max()) if v.size else 0,
        'updates': int(v.size),
      }
      for name, v in staleness.items()
    },
    **(extra or {}),
  }
  if timeline.clock == 'virtual':
    summary['sim_time'] = timeline.makespan
  if timeline.clock == 'virtual' or cost_table is not None:  # (emulated tasks: their prices)
    summary['cost_model_ms'] = {
      f'stage {k} {kind}': 1e3 * seconds for (k, kind), seconds in (cost_table or {}).items()
    }
  logging.info(
    '%s: makespan %.3f s (%s clock), mean staleness %.2f.',
    title,
    timeline.makespan,
    timeline.clock,
    summary['mean_staleness'],
  )
  return summary


# A JAX device as a lane name shows it (`str(jax.Device)`): `cpu:0`, `cuda:1`.
_DEVICE = re.compile(r'\b(?:cpu|cuda|gpu|rocm|tpu):\d+\b')


def priced_lane_name(name: str, device: str) -> str:
  """`name` with each device this machine ran it on as the preset `device` it was priced
  as: `link stage 0 (cpu:0) → stage 1 (cpu:0)` → `link stage 0 (h100) → stage 1 (h100)`."""
  return _DEVICE.sub(device, name)
