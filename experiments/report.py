"""`report.md` and its plots from a suite's finished runs."""

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from jaxsgd.training import files  # pylint: disable=g-import-not-at-top


def load_run(run_dir: str) -> dict:
  """A finished run: its summary and its metric records."""
  summary = files.read_json(os.path.join(run_dir, 'summary.json'))
  records = files.read_json_lines(os.path.join(run_dir, 'metrics.jsonl'))
  return {'dir': run_dir, 'summary': summary, 'records': records}


def mean_staleness(run: dict) -> float | None:
  """The run's mean staleness over all applied updates, if it has one."""
  value = run['summary'].get('mean_staleness')
  return None if value is None else float(value)


def staleness_histogram(run: dict) -> dict[int, int]:
  """`{staleness: count}` over every applied update of the run (empty if none)."""
  hist = run['summary'].get('staleness_histogram') or {}
  return {int(k): int(v) for k, v in hist.items()}


def _time_axis(records) -> tuple[str, list[float]]:
  if all('sim_time' in r for r in records):
    return 'simulated time (s)', [r['sim_time'] for r in records]
  return 'wall time (s)', [r['wall_time'] for r in records]


def _spread(values) -> str:
  values = np.asarray(values, float)
  if len(values) == 1:
    return f'{100 * values[0]:.2f}'
  return f'{100 * values.mean():.2f} ± {100 * values.std(ddof=1):.2f}'


def _mean_or_dash(values, fmt='{:.2f}') -> str:
  values = [v for v in values if v is not None]
  return fmt.format(float(np.mean(values))) if values else '—'


def _mean_and_spread(values, fmt='{:.3g}') -> str:
  """Mean ± sample standard deviation of the values given (None: not reached/absent)."""
  values = [float(v) for v in values if v is not None]
  if len(values) < 2:
    return _mean_or_dash(values, fmt)
  return f'{fmt.format(np.mean(values))} ± {np.std(values, ddof=1):.2g}'


def _time_to_target(run, key):
  hit = run['summary'].get('time_to_target')
  return None if not hit else hit.get(key)


def table_rows(runs: dict[str, list[dict]]) -> list[list[str]]:
  rows = []
  for label, method_runs in runs.items():
    finals = [r['summary']['final']['test_accuracy'] for r in method_runs]
    reached = sum(_time_to_target(r, 'step') is not None for r in method_runs)
    rows.append(
      [
        label,
        str(len(method_runs)),
        _spread(finals),
        f'{reached}/{len(method_runs)}',
        _mean_and_spread([_time_to_target(r, 'sim_time') for r in method_runs]),
        _mean_or_dash([_time_to_target(r, 'wall_time') for r in method_runs], '{:.1f}'),
        _mean_or_dash([mean_staleness(r) for r in method_runs]),
        _mean_and_spread([r['records'][-1].get('sim_time') for r in method_runs]),
        _mean_or_dash([r['records'][-1]['wall_time'] for r in method_runs], '{:.1f}'),
      ]
    )
  return rows


HEADER = [
  'method',
  'seeds',
  'final test acc. (%)',
  'reached target',
  'time to target, simulated (s)',
  'time to target, wall (s)',
  'mean staleness',
  'total simulated time (s)',
  'total wall time (s)',
]


def plot_accuracy(runs, path, target):
  fig, ax = plt.subplots(figsize=(7, 4.2))
  xlabel = 'time (s)'
  for i, (label, method_runs) in enumerate(runs.items()):
    for j, run in enumerate(method_runs):
      xlabel, times = _time_axis(run['records'])
      acc = [100 * r['test_accuracy'] for r in run['records']]
      ax.plot(
        times,
        acc,
        color=f'C{i % 10}',
        alpha=0.85 if j == 0 else 0.35,
        label=label if j == 0 else None,
      )
  ax.axhline(100 * target, color='gray', ls=':', lw=1, label='target')
  ax.set(xlabel=xlabel, ylabel='test accuracy (%)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_staleness(runs, path) -> bool:
  hists = {
    label: _merge([staleness_histogram(r) for r in method_runs])
    for label, method_runs in runs.items()
  }
  hists = {k: v for k, v in hists.items() if v}
  if not hists:
    return False
  fig, ax = plt.subplots(figsize=(7, 4.2))
  width = 0.8 / len(hists)
  for i, (label, hist) in enumerate(hists.items()):
    keys = np.array(sorted(hist))
    total = sum(hist.values())
    ax.bar(keys + i * width, [hist[k] / total for k in keys], width=width, label=label)
  ax.set(xlabel='staleness (updates between read and write)', ylabel='fraction of updates')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _merge(hists):
  merged = {}
  for hist in hists:
    for k, v in hist.items():
      merged[k] = merged.get(k, 0) + v
  return merged


def write_report(
  suite,
  runs: dict[str, list[dict]],
  workdir: str,
  *,
  profile: str | None = None,
  diverged: Sequence[tuple[str, int, str]] = (),
) -> str:
  """Writes `report.md`, `accuracy.png` and (if any) `staleness.png` into `workdir`;
  `profile`: the cost profile every simulated method took its costs from; `diverged`:
  (method, seed, error) of the runs whose loss became NaN (listed, not in the table)."""
  runs = {label: method_runs for label, method_runs in runs.items() if method_runs}
  os.makedirs(workdir, exist_ok=True)
  plot_accuracy(runs, os.path.join(workdir, 'accuracy.png'), suite.target_accuracy)
  has_staleness = plot_staleness(runs, os.path.join(workdir, 'staleness.png'))
  seeds = sorted({r['summary']['config']['seed'] for method in runs.values() for r in method})
  lines = [
    f'# {suite.title}',
    '',
    f'Paper: {suite.claim}',
    '',
    f'Target test accuracy: {100 * suite.target_accuracy:.0f} %. '
    f'Regenerate: `python -m experiments.compare --suite={suite.name} '
    f'--workdir={workdir} --seeds={",".join(map(str, seeds))}'
    + (f' --profile={profile}`.' if profile else '`.'),
    '',
    'Simulated times: mean ± standard deviation over the seeds that reached the target '
    '(time to target) or over all seeds (total).'
    + (
      f' Every simulated method whose costs are measured took them from one profile, `{profile}`.'
      if profile
      else ''
    ),
    '',
    '| ' + ' | '.join(HEADER) + ' |',
    '|' + '---|' * len(HEADER),
  ]
  lines += ['| ' + ' | '.join(row) + ' |' for row in table_rows(runs)]
  if diverged:
    lines += ['', '**Diverged** (not in the table; their seeds are missing from its counts):', '']
    lines += [f'- {label}, seed {seed}: {error}' for label, seed, error in diverged]
  lines += ['', '![accuracy against time](accuracy.png)']
  if has_staleness:
    lines += ['', '![staleness histograms](staleness.png)']
  if runs:
    first = next(iter(runs.values()))[0]['summary']['config']
    lines += [
      '',
      f'Dataset `{first["dataset"]}`, model `{first["model"]["name"]}`, '
      f'{first["train_steps"]} steps of batch {first["batch_size"]}'
      f'{" per worker" if first.get("workers", 1) > 1 else ""}.',
      '',
    ]
  path = os.path.join(workdir, 'report.md')
  files.atomic_write(path, '\n'.join(lines))
  return path
