"""`report.md` and its plots from a suite's finished runs."""

import os
from collections.abc import Sequence

from matplotlib.figure import Figure  # (no pyplot: no backend chosen, see training/plots.py)
import numpy as np

from jaxsgd.training import files


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


def language_model_rows(runs: dict[str, list[dict]]) -> list[list[str]]:
  """Per method of a language-model suite: final test perplexity (mean ± sd over the
  seeds), training tokens per second (simulated, and wall), and for the data-parallel
  methods the synchronizations of a run and the bytes of each (per worker: the peak a
  link carries). Empty if the runs are not of a language model."""
  if not all('test_perplexity' in r['summary']['final'] for rs in runs.values() for r in rs):
    return []
  rows = []
  for label, method_runs in runs.items():
    rates = [r['summary'].get('tokens_per_second') or {} for r in method_runs]
    sent = [r['summary'].get('communication') for r in method_runs]
    rows.append(
      [
        label,
        _mean_and_spread([r['summary']['final']['test_perplexity'] for r in method_runs]),
        _mean_or_dash([x.get('simulated') for x in rates], '{:,.0f}'),
        _mean_or_dash([x.get('wall') for x in rates], '{:,.0f}'),
        _mean_or_dash([x and x['synchronizations'] for x in sent], '{:,.0f}'),
        _mean_or_dash([x and x['bytes_per_synchronization'] / 1e6 for x in sent], '{:.3g}'),
      ]
    )
  return rows


LANGUAGE_MODEL_HEADER = [
  'method',
  'final test perplexity (per byte)',
  'tokens/s, simulated',
  'tokens/s, wall',
  'synchronizations',
  'MB per synchronization',
]


def seed_band(
  runs_of_method, value=lambda record: 100 * record['test_accuracy']
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(times, mean, min, max) of the seeds' `value` (test accuracy in %) on the union of
  their evaluation times, each seed interpolated linearly between its own evaluations,
  over the span every seed covers."""
  curves = [_time_axis(run['records'])[1] for run in runs_of_method]
  accuracies = [[value(r) for r in run['records']] for run in runs_of_method]
  lo, hi = max(c[0] for c in curves), min(c[-1] for c in curves)
  times = np.unique(np.concatenate([np.asarray(c, float) for c in curves]))
  times = times[(times >= lo) & (times <= hi)]
  values = np.array([np.interp(times, c, a) for c, a in zip(curves, accuracies, strict=True)])
  return times, values.mean(0), values.min(0), values.max(0)


def plot_accuracy(runs, path, target):
  """Test accuracy against simulated time (wall time on a real clock): one line per
  method (the seeds' mean), its seeds' min–max as a band, and where each seed reached
  the target (×)."""
  fig = Figure(figsize=(7, 4.2))
  ax = fig.subplots()
  xlabel = 'time (s)'
  for i, (label, method_runs) in enumerate(runs.items()):
    xlabel = _time_axis(method_runs[0]['records'])[0]
    times, mean, low, high = seed_band(method_runs)
    color = f'C{i % 10}'
    ax.plot(times, mean, color=color, label=label)
    ax.fill_between(times, low, high, color=color, alpha=0.2, lw=0)
    key = 'sim_time' if xlabel.startswith('simulated') else 'wall_time'
    hits = [r['summary'].get('time_to_target') or {} for r in method_runs]
    hits = [h for h in hits if key in h]
    ax.plot([h[key] for h in hits], [100 * target] * len(hits), 'x', color=color, ms=6)
  ax.axhline(100 * target, color='gray', ls=':', lw=1, label=f'target {100 * target:g} %')
  ax.set(xlabel=xlabel, ylabel='test accuracy (%)', title='mean of the seeds, band: min–max')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_perplexity(runs, path) -> None:
  """A language model's test perplexity against simulated time (wall time on a real
  clock), log scale: one line per method (the seeds' mean), the seeds' min–max as a band."""
  fig = Figure(figsize=(7, 4.2))
  ax = fig.subplots()
  for i, (label, method_runs) in enumerate(runs.items()):
    times, mean, low, high = seed_band(method_runs, lambda r: r['test_perplexity'])
    ax.plot(times, mean, color=f'C{i % 10}', ls='-' if i < 10 else '--', label=label)
    ax.fill_between(times, low, high, color=f'C{i % 10}', alpha=0.2, lw=0)
  xlabel = _time_axis(next(iter(runs.values()))[0]['records'])[0]
  ax.set(xlabel=xlabel, ylabel='test perplexity (per byte)', yscale='log')
  ax.set_title('mean of the seeds, band: min–max', fontsize=9)
  ax.grid(alpha=0.3, which='both')
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_staleness(runs, path) -> bool:
  hists = {
    label: _merge([staleness_histogram(r) for r in method_runs])
    for label, method_runs in runs.items()
  }
  hists = {k: v for k, v in hists.items() if v}
  if not hists:
    return False
  fig = Figure(figsize=(7, 4.2))
  ax = fig.subplots()
  width = 0.8 / len(hists)
  for i, (label, hist) in enumerate(hists.items()):
    keys = np.array(sorted(hist))
    total = sum(hist.values())
    ax.bar(keys + i * width, [hist[k] / total for k in keys], width=width, label=label)
  ax.set(xlabel='staleness (updates between read and write)', ylabel='fraction of updates')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def _merge(hists):
  merged = {}
  for hist in hists:
    for k, v in hist.items():
      merged[k] = merged.get(k, 0) + v
  return merged


def _stats(values) -> dict | None:
  """Mean, sample standard deviation (0 for one value) and the values; None if none."""
  values = [float(v) for v in values if v is not None]
  if not values:
    return None
  sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  return {'mean': float(np.mean(values)), 'sd': sd, 'n': len(values), 'values': values}


def resolution(run: dict) -> dict:
  """How exactly the run's time to target is known: `steps` between two looks at the
  accuracy (checks and evaluations), of `train_steps`; `checked` False for a run made
  before the checks, whose time to target is its first evaluation at the target."""
  summary, config = run['summary'], run['summary']['config']
  steps = summary.get('target_resolution_steps')
  checked = steps is not None
  return {
    'steps': int(steps if checked else config['eval_every']),
    'train_steps': int(config['train_steps']),
    'checked': checked,
  }


def method_data(method_runs: list[dict]) -> dict:
  """What report.json keeps of one method: accuracies (fractions), times (s), steps."""
  hits = [r['summary'].get('time_to_target') or {} for r in method_runs]
  res = [resolution(r) for r in method_runs]
  return {
    'seeds': [r['summary']['config']['seed'] for r in method_runs],
    'final_accuracy': _stats([r['summary']['final']['test_accuracy'] for r in method_runs]),
    'final_perplexity': _stats([r['summary']['final'].get('test_perplexity') for r in method_runs]),
    'reached_target': sum('step' in h for h in hits),
    'time_to_target_sim': _stats([h.get('sim_time') for h in hits]),
    # Per seed: its simulated time to target, or (never reached) its whole run's, which
    # its time to target would exceed: what a speed-up's bounds need (results_table).
    'seed_times_sim': [_seed_time(h, r) for h, r in zip(hits, method_runs, strict=True)],
    'time_to_target_wall': _stats([h.get('wall_time') for h in hits]),
    'steps_to_target': _stats([h.get('step') for h in hits]),
    'total_sim_time': _stats([r['records'][-1].get('sim_time') for r in method_runs]),
    'mean_staleness': _stats([mean_staleness(r) for r in method_runs]),
    'resolution_steps': max(r['steps'] for r in res),
    'train_steps': max(r['train_steps'] for r in res),
    'resolution_checked': all(r['checked'] for r in res),
  }


def _seed_time(hit: dict, run: dict) -> dict:
  """One seed's simulated time to target if it reached it, else its whole run's (None
  without a virtual clock)."""
  if 'step' in hit:
    return {'reached': True, 'time': hit.get('sim_time')}
  return {'reached': False, 'time': run['records'][-1].get('sim_time')}


def report_data(suite, runs, *, profile=None, diverged=()) -> dict:
  """report.json: the suite, its target and every method's figures (`method_data`)."""
  return {
    'suite': suite.name,
    'title': suite.title,
    'claim': suite.claim,
    'target_accuracy': suite.target_accuracy,
    'profile': profile,
    'methods': {label: method_data(method_runs) for label, method_runs in runs.items()},
    'diverged': [{'method': m, 'seed': seed, 'error': e} for m, seed, e in diverged],
  }


def _steps(n: int) -> str:
  return 'step' if n == 1 else f'{n} steps'


def resolution_sentence(methods: dict) -> str:
  """The report's line on how exactly its times to target are known."""
  if not methods:
    return ''
  if not all(m['resolution_checked'] for m in methods.values()):
    every = sorted({m['resolution_steps'] for m in methods.values()})
    return (
      'Time to target is *sampled*: the first evaluation at or above the target, '
      f'evaluations every {" / ".join(map(str, every))} steps (runs made before the checks).'
    )
  worst = max(m['resolution_steps'] / m['train_steps'] for m in methods.values())
  pairs = sorted({(m['resolution_steps'], m['train_steps']) for m in methods.values()})
  every = ', '.join(f'{_steps(s)} of a {n:,}-step run' for s, n in pairs)
  return (
    'Time to target is *measured*: until a run reaches the target its test accuracy is '
    f'checked every {every}, so the step and time it first reaches it are known '
    f'to {100 * worst:.2g} % of the run or better (checks write no record; the curves show '
    'the evaluations).'
  )


def write_report(
  suite,
  runs: dict[str, list[dict]],
  workdir: str,
  *,
  profile: str | None = None,
  diverged: Sequence[tuple[str, int, str]] = (),
) -> str:
  """Writes `report.md`, `report.json` (`report_data`), `accuracy.png` and (if any)
  `staleness.png` into `workdir`;
  `profile`: the cost profile every simulated method took its costs from; `diverged`:
  (method, seed, error) of the runs whose loss became NaN (listed, not in the table)."""
  runs = {label: method_runs for label, method_runs in runs.items() if method_runs}
  os.makedirs(workdir, exist_ok=True)
  data = report_data(suite, runs, profile=profile, diverged=diverged)
  files.write_json(os.path.join(workdir, 'report.json'), data)
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
    resolution_sentence(data['methods']),
    '',
    '| ' + ' | '.join(HEADER) + ' |',
    '|' + '---|' * len(HEADER),
  ]
  lines += ['| ' + ' | '.join(row) + ' |' for row in table_rows(runs)]
  lm_rows = language_model_rows(runs)
  if lm_rows:
    lines += [
      '',
      'Language model: perplexity is exp(test loss in nats per byte); tokens per second '
      'over the whole run (evaluations included in the wall figure); synchronizations '
      'are the all-reduces of a data-parallel run, each of the MB given per worker.',
      '',
      '| ' + ' | '.join(LANGUAGE_MODEL_HEADER) + ' |',
      '|' + '---|' * len(LANGUAGE_MODEL_HEADER),
    ]
    lines += ['| ' + ' | '.join(row) + ' |' for row in lm_rows]
    plot_perplexity(runs, os.path.join(workdir, 'perplexity.png'))
    lines += ['', '![test perplexity against time](perplexity.png)']
  if diverged:
    lines += ['', '**Diverged** (not in the table; their seeds are missing from its counts):', '']
    lines += [f'- {label}, seed {seed}: {error}' for label, seed, error in diverged]
  lines += [
    '',
    "Time to accuracy: the seeds' mean, their min–max as a band, × where a seed reached "
    'the target.',
    '',
    '![accuracy against time](accuracy.png)',
  ]
  if has_staleness:
    lines += ['', '![staleness histograms](staleness.png)']
  else:
    lines += [
      '',
      'No staleness plot: no method of this suite records a staleness histogram (its '
      'updates are synchronous, or their delay is fixed by the config).',
    ]
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


def _fill_from_record(args, parser) -> None:
  """The error flags not given: the schedule error on record, read only when needed (a
  `--help` or a bad flag reads no file); one line if it cannot be read."""
  from experiments import results_table  # pylint: disable=g-import-not-at-top

  names = ('error_median', 'error_max', 'error_source', 'error_by_family')
  if all(getattr(args, name) is not None for name in names):
    return
  try:
    record = results_table.schedule_error_on_record()
  except (OSError, ValueError) as error:
    flags = ', '.join(f'--{name}' for name in names if getattr(args, name) is None)
    parser.error(f'the schedule error on record: {error}; or pass {flags}')
  by_family = ','.join(f'{name}={value}' for name, value in record.by_family)
  defaults = (record.median, record.largest, record.source, by_family)
  for name, default in zip(names, defaults):
    if getattr(args, name) is None:
      setattr(args, name, default)


def main(argv=None) -> None:
  """`python -m experiments.report --results`: RESULTS.md's table from the suites'
  report.json (`experiments.results_table`)."""
  import argparse  # pylint: disable=g-import-not-at-top

  from experiments import results_table  # pylint: disable=g-import-not-at-top
  from experiments import suites  # pylint: disable=g-import-not-at-top

  on_record = 'by default: the schedule error on record (benchmarks/results/schedule_error.txt)'
  parser = argparse.ArgumentParser(description=main.__doc__.split('\n')[0])
  parser.add_argument('--results', action='store_true', help="write RESULTS.md's table")
  parser.add_argument('--results_md', default='RESULTS.md')
  parser.add_argument('--results_dir', default='experiments/results')
  parser.add_argument('--error_median', type=float, help=on_record)
  parser.add_argument('--error_max', type=float, help=on_record)
  parser.add_argument('--error_source', help=f'where the error is from; {on_record}')
  parser.add_argument(
    '--error_by_family',
    help=f'the largest error per family, NAME=X,...; a family not named takes --error_max; '
    f'{on_record}',
  )
  args = parser.parse_args(argv)
  if not args.results:
    parser.error('nothing to do: pass --results (a suite report is written by experiments.compare)')
  _fill_from_record(args, parser)
  try:
    by_family = tuple(
      (name.strip(), float(value))
      for name, value in (item.split('=') for item in args.error_by_family.split(',') if item)
    )
  except ValueError:
    by_family = None
  if by_family is None or not all(name and 0 <= x < 1 for name, x in by_family):
    parser.error(
      f'--error_by_family: NAME=X,... with X a fraction in [0, 1); got {args.error_by_family!r}'
    )
  error = results_table.SimulatorError(
    args.error_median, args.error_max, args.error_source, by_family
  )
  print(
    results_table.write_results(
      args.results_md, args.results_dir, list(suites.SUITES.values()), error
    )
  )


if __name__ == '__main__':
  main()
