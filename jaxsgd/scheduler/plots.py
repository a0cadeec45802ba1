"""The staleness histogram of a run (`staleness.png`)."""

import matplotlib

matplotlib.use('Agg')  # Headless.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np


def plot_staleness(staleness_by_lane: dict[str, np.ndarray], path: str, title: str = '') -> None:
  """Counts of each staleness value, one bar group per lane (a heat map beyond 8 lanes)."""
  names = list(staleness_by_lane)
  largest = max((int(v.max()) for v in staleness_by_lane.values() if v.size), default=0)
  counts = np.zeros((len(names), largest + 1))
  for row, name in enumerate(names):
    values = staleness_by_lane[name]
    counts[row, :] = np.bincount(values, minlength=largest + 1) if values.size else 0
  fig, ax = plt.subplots(figsize=(7, 3.6))
  if len(names) <= 8:
    width = 0.8 / max(len(names), 1)
    for row, name in enumerate(names):
      ax.bar(np.arange(largest + 1) + row * width - 0.4 + width / 2, counts[row], width,
             label=name)
    ax.set(xlabel='staleness (writes between read and update)', ylabel='updates')
    ax.set_xticks(np.arange(largest + 1))
    ax.legend(fontsize='small')
  else:
    image = ax.imshow(counts, aspect='auto', origin='lower', cmap='viridis')
    fig.colorbar(image, ax=ax, label='updates')
    ax.set(xlabel='staleness (writes between read and update)', ylabel='lane')
  ax.set_title(title or 'staleness of applied gradients')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
