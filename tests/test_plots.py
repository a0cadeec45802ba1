"""The trace Gantt chart draws one bar per task, on its lane's row, at its times."""

import matplotlib
import numpy as np

from jaxsgd.scheduler import TaskRecord, Timeline
from jaxsgd.training.plots import plot_trace

matplotlib.use('Agg')


def test_plot_trace_draws_each_task_where_it_ran(tmp_path):
  records = [
    TaskRecord(0, 'forward', 0.0, 1.0, 0, 0),
    TaskRecord(1, 'forward', 1.0, 2.0, 1, 0),
    TaskRecord(1, 'backward', 2.0, 4.0, 1, 0),
    TaskRecord(0, 'backward', 4.0, 6.0, 0, 0),
  ]
  timeline = Timeline(['stage 0', 'stage 1'], records, 'virtual')
  timeline.write_chrome_trace(tmp_path / 'trace.json')
  ax = plot_trace(str(tmp_path / 'trace.json'))
  bars = [
    (tuple(np.round(c.get_paths()[0].vertices.min(0), 6)), c.get_label()) for c in ax.collections
  ]
  # (x start, y bottom): lane 0 is row 0, lane 1 row 1; bars are 0.8 high around the row.
  assert sorted(b for b, _ in bars) == [(0.0, -0.4), (1.0, 0.6), (2.0, 0.6), (4.0, -0.4)]
  assert [t.get_text() for t in ax.get_yticklabels()] == ['stage 0', 'stage 1']
  assert len(plot_trace(str(tmp_path / 'trace.json'), until=1.5).figure.axes[0].collections) == 2
