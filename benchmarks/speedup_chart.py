r"""A bar chart of `benchmarks.real_speedup`'s measured speed-ups against the lane count.

    python -m benchmarks.speedup_chart   # reads benchmarks/results/real_speedup.txt

Each bar is a case's speed-up over BP in the latest run in the file (the first table:
the file is newest first); the dots are the same case in every earlier run of the same
model and batch, and the
dashed line the ideal speed-up (the lane count). A case's lanes are the cores its label
lists, e.g. `ddg K=2 (cores 0, 1)`.
"""

import argparse
import os
import re

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')
_ROW = re.compile(
  r'^(?P<case>\S.*?\((?:\d+ lanes?, )?cores? (?P<cores>[\d, ]+)\))\s+[\d.]+\s+(?P<speedup>[\d.]+)'
)


def parse_runs(text: str) -> list[tuple[str, dict[str, tuple[int, float]]]]:
  """Every table of the file, in its order: `(setting, {case: (lanes, speed-up over bp)})`,
  the setting being the model and batch of the `machine:` line above the table."""
  runs, setting = [], ''
  for line in text.splitlines():
    found = re.search(r'MLP [\d-]+, batch \d+', line) if line.startswith('machine:') else None
    setting = found[0] if found else setting
    if line.startswith('case '):
      runs.append((setting, {}))
      continue
    match = _ROW.match(line)
    if match and runs:
      case = re.sub(r' \((?:\d+ lanes?, )?cores? [\d, ]+\)$', '', match['case']).strip()
      case = re.sub(r' K=2$', '', case) if case.startswith('pdasgd') else case  # one name
      lanes = len(match['cores'].split(','))
      runs[-1][1][case] = (lanes, float(match['speedup']))
  return [run for run in runs if run[1]]


def plot(runs, path: str) -> None:
  """The latest run as bars (grouped by lane count), the earlier runs of the same
  setting as dots."""
  setting, latest = runs[0]
  runs = [run for s, run in runs if s == setting]
  cases = sorted(latest, key=lambda c: (latest[c][0], c))
  fig, ax = plt.subplots(figsize=(7.5, 4.2))
  for i, case in enumerate(cases):
    lanes, speedup = latest[case]
    ax.bar(i, speedup, color=f'C{lanes - 1}', label=f'{lanes} lane{"s" * (lanes > 1)}')
    ax.text(i, speedup + 0.03, f'{speedup:.2f}', ha='center', fontsize=8)
    earlier = [run[case][1] for run in runs[1:] if case in run]
    ax.plot([i] * len(earlier), earlier, '.', color='0.25', ms=4)
    ax.hlines(lanes, i - 0.4, i + 0.4, color='0.4', ls='--', lw=1)
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles, strict=True))
  ax.legend(unique.values(), unique.keys(), fontsize=8, loc='upper left')
  ax.set_xticks(range(len(cases)), cases, rotation=20, ha='right', fontsize=8)
  ax.set(
    ylabel='speed-up over BP (wall clock)',
    ylim=(0, 1.15 * max(lanes for lanes, _ in latest.values())),
  )
  ax.set_title(
    f'real_speedup, {setting}\nlatest run (bars), {len(runs) - 1} earlier (dots), '
    'ideal = lanes (dashes)',
    fontsize=9,
  )
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--results', default=os.path.join(RESULTS, 'real_speedup.txt'))
  parser.add_argument('--out', default=os.path.join(RESULTS, 'real_speedup.png'))
  args = parser.parse_args(argv)
  with open(args.results) as f:
    runs = parse_runs(f.read())
  plot(runs, args.out)
  print(f'{args.out}: {len(runs)} runs; the latest, {runs[0][0]}: {runs[0][1]}')


if __name__ == '__main__':
  main()
