"""Plots of a run: learning curves (`metrics.jsonl`), staleness histograms, task timelines
(`trace.json`)."""

import json

import numpy as np


def _figure(width: float, height: float):
  """A new figure of `width` x `height` inches. It is a `Figure`, not pyplot's: no backend
  is chosen for it, so a notebook's inline figures stay on (and a script stays headless).
  matplotlib is imported here, when the first figure is drawn at a run's end, not while a
  run starts: it is most of a second of every driver's start otherwise. Laid out when
  drawn (constrained): `tight_layout` took ~0.15 s more of each run's curves."""
  from matplotlib.figure import Figure

  return Figure(figsize=(width, height), layout='constrained')


def plot_curves(
  records: list[dict], path: str, title: str = '', target: float | None = None
) -> None:
  """`curves_figure(records, title, target)` saved as `path`."""
  fig = curves_figure(records, title, target)
  fig.savefig(path, dpi=120)


def curves_figure(records: list[dict], title: str = '', target: float | None = None):
  """Loss (train and test) and test accuracy against steps, side by side; on the virtual
  clock (every record has a `sim_time`), test accuracy against simulated time beside them.
  `target` (a fraction, `config.target_accuracy`) is drawn on every accuracy panel."""
  steps = [r['step'] for r in records]
  accuracy = [100 * r['test_accuracy'] for r in records]
  simulated = bool(records) and all('sim_time' in r for r in records)
  fig = _figure(15 if simulated else 10, 3.6)
  axes = fig.subplots(1, 3 if simulated else 2)
  ax_loss, ax_acc = axes[:2]
  ax_loss.plot(steps, [r['train_loss'] for r in records], label='train')
  ax_loss.plot(steps, [r['test_loss'] for r in records], label='test')
  ax_loss.set(xlabel='step', ylabel='loss', yscale='log')
  ax_loss.legend()
  ax_acc.plot(steps, accuracy, color='C2')
  ax_acc.set(xlabel='step', ylabel='test accuracy (%)')
  accuracy_axes = [ax_acc]
  if simulated:
    ax_sim = axes[2]
    ax_sim.plot([r['sim_time'] for r in records], accuracy, color='C2')
    ax_sim.set(xlabel='simulated time (s)', ylabel='test accuracy (%)')
    accuracy_axes.append(ax_sim)
  if target is not None:
    for ax in accuracy_axes:
      ax.axhline(100 * target, color='0.4', ls='--', lw=1, label=f'target {100 * target:g} %')
      ax.legend(loc='lower right')
  for ax in axes:
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  return fig


def plot_staleness(staleness_by_lane: dict[str, np.ndarray], path: str, title: str = '') -> None:
  """Counts of each staleness value, one bar group per lane (a heat map beyond 8 lanes)."""
  names = list(staleness_by_lane)
  largest = max((int(v.max()) for v in staleness_by_lane.values() if v.size), default=0)
  counts = np.zeros((len(names), largest + 1))
  for row, name in enumerate(names):
    values = staleness_by_lane[name]
    counts[row, :] = np.bincount(values, minlength=largest + 1) if values.size else 0
  fig = _figure(7, 3.6)
  ax = fig.subplots()
  if len(names) <= 8:
    width = 0.8 / max(len(names), 1)
    for row, name in enumerate(names):
      ax.bar(np.arange(largest + 1) + row * width - 0.4 + width / 2, counts[row], width, label=name)
    ax.set(xlabel='staleness (writes between read and update)', ylabel='updates')
    ax.set_xticks(np.arange(largest + 1))
    ax.legend(fontsize='small')
  else:
    image = ax.imshow(counts, aspect='auto', origin='lower', cmap='viridis')
    fig.colorbar(image, ax=ax, label='updates')
    ax.set(xlabel='staleness (writes between read and update)', ylabel='lane')
  ax.set_title(title or 'staleness of applied gradients')
  fig.savefig(path, dpi=110)


KIND_COLORS = {'forward': 'C0', 'backward': 'C1', 'update': 'C2', 'transfer': 'C7'}


def plot_trace(trace: dict | str, ax=None, *, until: float | None = None):
  """A Gantt chart of a `trace.json` (a path or its dict): one row per lane.

  Slices are coloured by task kind (forward, backward, update, transfer, other);
  `until` (seconds) shows only the start of a long run.

  Returns:
    The matplotlib axes.
  """
  if isinstance(trace, str):
    with open(trace) as f:
      trace = json.load(f)
  events = trace['traceEvents']
  names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
  rows = {tid: row for row, tid in enumerate(sorted(names))}
  if ax is None:
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (to be shown: a notebook's)

    _, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
  seen = set()
  for e in events:
    if e.get('ph') != 'X' or (until is not None and e['ts'] * 1e-6 > until):
      continue
    kind = e.get('cat', 'compute')
    ax.broken_barh(
      [(e['ts'] * 1e-6, e['dur'] * 1e-6)],
      (rows[e['tid']] - 0.4, 0.8),
      color=KIND_COLORS.get(kind, 'C4'),
      label=None if kind in seen else kind,
    )
    seen.add(kind)
  ax.set_yticks(list(rows.values()), [names[t] for t in rows])
  ax.invert_yaxis()
  ax.set_xlabel('time (s)')
  ax.legend(fontsize='small', loc='upper right')
  return ax


def plot_agreement(steps, cosines, path: str, title: str = '') -> None:
  """Cosine of each block's local gradient with the backprop gradient, per measurement."""
  fig = _figure(7, 3.6)
  ax = fig.subplots()
  for k in range(cosines.shape[1]):
    ax.plot(steps, cosines[:, k], label=f'block {k}')
  ax.axhline(0, color='0.6', lw=0.8)
  ax.set(
    xlabel='batch t (each block at the weights of its forward)',
    ylabel='cos(local gradient, backprop gradient)',
    title=f'{title}: gradient agreement per block',
  )
  ax.legend(fontsize='small')
  ax.grid(alpha=0.3)
  fig.savefig(path, dpi=110)
