"""What every scheduler run leaves behind: its trace, staleness plot and summary fields."""

import logging
import math
import os

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
) -> dict:
  """Writes `trace.json` and `staleness.png`; returns the run's summary fields.

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
  """
  files.write_json(os.path.join(workdir, 'trace.json'), timeline.chrome_trace(), indent=None)
  with files.atomic_path(os.path.join(workdir, 'staleness.png')) as path:
    plots.plot_staleness(staleness, path, title=title)
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
