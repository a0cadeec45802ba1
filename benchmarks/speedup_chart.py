r"""A bar chart of `benchmarks.real_speedup`'s measured speed-ups against the lane count.

    python -m benchmarks.speedup_chart   # reads benchmarks/results/real_speedup.txt

    python -m benchmarks.speedup_chart \
        --results=benchmarks/results/real_speedup_16cores.txt \
        --out=benchmarks/results/real_speedup_16cores.png   # K = 2, 4, 8

Each bar is a case's speed-up over BP where it first appears among the tables of the
file's latest model and batch (the file is newest first); the dots are the same case in
the later tables of that setting (earlier runs), and the
dashed line the ideal speed-up (the lane count). A case's lanes are the cores its label
lists, e.g. `ddg K=2 (cores 0, 1)`.
"""

import argparse
import itertools
import os
import re

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')
_CORES = r'\((?:\d+ lanes?, )?cores? (?P<cores>[\d, -]+)\)'
_ROW = re.compile(rf'^(?P<case>\S.*?) {_CORES}\s+[\d.]+\s+(?P<speedup>[\d.]+)')


def _lanes(cores: str) -> int:
  """Lanes of a case: one per core listed ('0, 1' or '0-7')."""
  count = 0
  for part in cores.split(','):
    first, _, last = part.strip().partition('-')
    count += int(last or first) - int(first) + 1
  return count


# A line of a results file below which its tables were measured with `real_speedup`'s
# earlier window, which overstated DDG's speed-up (`real_speedup.steady_window`): the
# chart leaves them out.
EARLIER_WINDOW = '# --- earlier window'
# What `real_speedup --copies` prints above its tables (`real_speedup.COPIES_APART`, not
# imported: that module starts JAX): its lanes are placed otherwise.
COPIES_APART = 'copy threads apart:'
# What `real_speedup --copies=auto` prints above its tables (`real_speedup.BY_LOAD_LINE`):
# each case's copy threads placed by the load it measured, another placement too.
BY_LOAD_LINE = 'copy threads by load'


def parse_runs(text: str) -> list[tuple[str, dict[str, tuple[int, float]]]]:
  """Every table of the file above `EARLIER_WINDOW`, in its order: `(setting, {case:
  (lanes, speed-up over bp)})`, the setting being the model and batch of the `machine:`
  line above the table, and the `COPIES_APART` line below that if any, or
  `BY_LOAD_LINE`."""
  runs, setting = [], ''
  for line in text.splitlines():
    if line.startswith(EARLIER_WINDOW):
      break
    found = re.search(r'MLP [\d-]+, batch \d+', line) if line.startswith('machine:') else None
    setting = found[0] if found else setting
    if line.startswith(COPIES_APART):  # another placement: another setting
      setting = f'{setting}; {line}'
    elif line.startswith(BY_LOAD_LINE):
      setting = f'{setting}; {BY_LOAD_LINE}'
    if line.startswith('case '):
      runs.append((setting, {}))
      continue
    match = _ROW.match(line)
    if match and runs:
      case = re.sub(r' K=\d+$', '', match['case']) if ':' in match['case'] else match['case']
      runs[-1][1][case.strip()] = (_lanes(match['cores']), float(match['speedup']))
  return [run for run in runs if run[1]]


def short(setting: str) -> str:
  """'MLP 1024-1024-1024-10, batch 256' as 'MLP 1024x3-10, batch 256'."""
  widths = re.search(r'MLP ([\d-]+)', setting)
  if not widths:
    return setting
  groups = [(w, len(list(g))) for w, g in itertools.groupby(widths[1].split('-'))]
  layers = '-'.join(w if n == 1 else f'{w}x{n}' for w, n in groups)
  return setting.replace(widths[1], layers)


def latest_and_earlier(runs) -> tuple[str, dict, dict]:
  """The first table's setting; each case's figure where it first appears among that
  setting's tables (the file is newest first), and its later appearances."""
  setting = runs[0][0]
  latest, earlier = {}, {}
  for _, table in (run for run in runs if run[0] == setting):
    for case, (lanes, speedup) in table.items():
      if case in latest:
        earlier.setdefault(case, []).append(speedup)
      else:
        latest[case] = (lanes, speedup)
  return setting, latest, earlier


def plot(runs, path: str) -> None:
  """Bars: each case's latest speed-up, grouped by method and coloured by lane count;
  dots: its earlier runs of the same setting; dashes: the ideal (the lane count)."""
  setting, latest, earlier = latest_and_earlier(runs)
  families = list(dict.fromkeys(case.split()[0] for case in latest))
  cases = sorted(latest, key=lambda c: (families.index(c.split()[0]), latest[c][0]))
  colours = {n: f'C{i}' for i, n in enumerate(sorted({lanes for lanes, _ in latest.values()}))}
  fig, ax = plt.subplots(figsize=(max(7.5, 0.55 * len(cases)), 4.2))
  x, previous = -1.0, None
  for case in cases:
    x += 1.0 if case.split()[0] == previous else 1.6
    previous = case.split()[0]
    lanes, speedup = latest[case]
    ax.bar(x, speedup, color=colours[lanes], label=f'{lanes} lane{"s" * (lanes > 1)}')
    ax.text(x, speedup + 0.03, f'{speedup:.2f}', ha='center', fontsize=7)
    dots = earlier.get(case, [])
    ax.plot([x] * len(dots), dots, '.', color='0.25', ms=4)
    ax.hlines(lanes, x - 0.4, x + 0.4, color='0.4', ls='--', lw=1)
    ax.text(
      x,
      -0.02,
      case,
      rotation=30,
      ha='right',
      va='top',
      fontsize=7,
      transform=ax.get_xaxis_transform(),
    )
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles, strict=True))
  ax.legend(unique.values(), unique.keys(), fontsize=8, loc='upper left')
  ax.set_xticks([])
  ax.set(
    ylabel='speed-up over BP (wall clock)',
    ylim=(0, 1.15 * max(lanes for lanes, _ in latest.values())),
  )
  ax.set_title(
    f'real_speedup, {short(setting)}\nlatest (bars), earlier runs (dots), ideal = lanes (dashes)',
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
  setting, latest, _ = latest_and_earlier(runs)
  print(f'{args.out}: {setting}: {latest}')


if __name__ == '__main__':
  main()
