r"""Runs a paper's comparison suite and writes `report.md` with a table and plots.

    python -m experiments.compare --suite=ddg --workdir=experiments/results/ddg
    python -m experiments.compare --suite=dcasgd --workdir=/tmp/dc --seeds=0 --smoke

Each suite (`experiments/suites.py`) is a list of methods, each a config file plus
overrides, run for several seeds where noise matters. The report has, per method:
final test accuracy (mean ± spread over seeds), time to the suite's target accuracy
in simulated and real seconds, mean staleness; and plots of accuracy against
simulated time (all methods on one figure) and staleness histograms.
"""

from absl import app
from absl import flags

from experiments import suites

_SUITE = flags.DEFINE_enum('suite', None, list(suites.SUITES), 'Which comparison to run.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the runs and report.md go.')
_SEEDS = flags.DEFINE_list('seeds', None, "Seeds to run (default: the suite's).")
_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny runs (seconds each), for tests.')
_PROFILE = flags.DEFINE_string(
  'profile',
  None,
  'A cost profile (python -m experiments.profile) every simulated method takes its task '
  'costs from; without it each method uses the calibration kept where the data lives, '
  'shared by all methods of one model, batch and optimizer.',
)
_REUSE = flags.DEFINE_bool(
  'reuse',
  False,
  'Keep runs whose summary.json records the same '
  'config as the run would have (others are run again).',
)
flags.mark_flags_as_required(['suite', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  seeds = tuple(int(s) for s in _SEEDS.value) if _SEEDS.value else None
  path = suites.run_suite(
    _SUITE.value,
    _WORKDIR.value,
    seeds=seeds,
    smoke=_SMOKE.value,
    reuse=_REUSE.value,
    profile=_PROFILE.value,
  )
  print(f'report: {path}')


if __name__ == '__main__':
  app.run(main)
