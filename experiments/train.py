r"""Trains one configuration: the only place flags are defined.

    python -m experiments.train --config=experiments/configs/default.py --workdir=runs/demo
    python -m experiments.train --config=experiments/configs/default.py:smoke \
        --workdir=/tmp/smoke --config.dataset=digits
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxsgd.training import train_and_evaluate

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where metrics, plots and the summary go.')
_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'An ml_collections config file.', lock_config=True
)
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  final = summary['final']
  logging.info(
    'Done: step %d, test accuracy %.4f, test loss %.4f, wall %.1f s.',
    final['step'],
    final['test_accuracy'],
    final['test_loss'],
    final['wall_time'],
  )
  print(
    f'final test accuracy {final["test_accuracy"]:.4f} at step {final["step"]} '
    f'({final["wall_time"]:.1f} s); results in {_WORKDIR.value}'
  )


if __name__ == '__main__':
  app.run(main)
