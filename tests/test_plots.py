"""Plots: the trace Gantt chart draws one bar per task, on its lane's row, at its times; the
learning curves have a simulated-time panel on the virtual clock and the target line."""

import subprocess
import sys

import matplotlib
import numpy as np

from jaxsgd.scheduler import TaskRecord, Timeline
from jaxsgd.training.plots import curves_figure
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


def _records(simulated: bool) -> list[dict]:
  records = [
    {'step': s, 'train_loss': 1 / s, 'test_loss': 2 / s, 'test_accuracy': a}
    for s, a in ((10, 0.5), (20, 0.9), (30, 0.96))
  ]
  if simulated:
    for record, seconds in zip(records, (0.5, 1.25, 2.0), strict=True):
      record['sim_time'] = seconds
  return records


def test_curves_have_a_simulated_time_panel_and_the_target_line():
  fig = curves_figure(_records(simulated=True), target=0.95)
  loss, accuracy, simulated = fig.axes
  assert simulated.get_xlabel() == 'simulated time (s)'
  curve, target = simulated.get_lines()
  np.testing.assert_array_equal(curve.get_xdata(), [0.5, 1.25, 2.0])
  np.testing.assert_array_equal(curve.get_ydata(), [50.0, 90.0, 96.0])
  for ax in (accuracy, simulated):
    line = ax.get_lines()[-1]
    assert line.get_label() == 'target 95 %'
    np.testing.assert_array_equal(line.get_ydata(), [95.0, 95.0])
  assert target is simulated.get_lines()[-1] and len(loss.get_lines()) == 2


def test_curves_of_a_real_clock_run_without_a_target_are_two_panels():
  fig = curves_figure(_records(simulated=False))
  assert [ax.get_xlabel() for ax in fig.axes] == ['step', 'step']
  assert [len(ax.get_lines()) for ax in fig.axes] == [2, 1]


def test_importing_the_plotting_modules_leaves_the_backend_a_notebook_chose():
  """`jaxsgd.training.plots` and `experiments.report` draw files with `Figure`s, not
  pyplot: importing them switched every notebook that did to the Agg backend, and its
  figures no longer showed inline."""
  code = (
    'import matplotlib; matplotlib.use("svg"); '
    'import jaxsgd.training.plots, experiments.report; print(matplotlib.get_backend())'
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == 'svg', out.stderr[-2000:]
