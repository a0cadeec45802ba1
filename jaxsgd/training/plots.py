"""Plots made from a run's `metrics.jsonl`."""

import matplotlib

matplotlib.use('Agg')  # Headless: runs in CI and over ssh.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top


def plot_curves(records: list[dict], path: str, title: str = '') -> None:
  """Loss (train and test) and test accuracy against steps, side by side."""
  steps = [r['step'] for r in records]
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
  ax_loss.plot(steps, [r['train_loss'] for r in records], label='train')
  ax_loss.plot(steps, [r['test_loss'] for r in records], label='test')
  ax_loss.set(xlabel='step', ylabel='loss', yscale='log')
  ax_loss.legend()
  ax_acc.plot(steps, [100 * r['test_accuracy'] for r in records], color='C2')
  ax_acc.set(xlabel='step', ylabel='test accuracy (%)')
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
