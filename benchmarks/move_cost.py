r"""What a move between two lane processes costs, this checkout against an earlier one.

    python -m benchmarks.move_cost --before=/tmp/old       # ~4 min on a 2-core CPU
    python -m benchmarks.move_cost --rounds=5 --moves=socket

A move (a value sent from one lane to another, `LanePool.move`) as the virtual clock's
host profile prices it: `link_timing.measure_process_links` on two lanes pinned to
cores 0 and 1 — the link (the end of the task that made the value to its copy's
arrival), of it the sending lane's export (the value existing to its last frame
written), and the receiving lane's take-in; each as a latency and a time per array
beyond a message's first (a pushed gradient of a 16-layer MLP is 34 arrays). Each
round measures this checkout, then `--before`'s (if given), each in a process of its
own and on lanes of its own, so that a slow spell of the machine slows both. Medians
over rounds; the last line is the link's time per array, before over now (median of
the rounds' ratios), or this checkout's alone.
Not a test: speed is measured, not asserted.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import common as bench_common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ('link', 'export', 'take_in')
_MEASURE = """
import json, sys
from jaxsgd.scheduler import link_timing
moves = link_timing.measure_process_links(reps=int(sys.argv[1]), moves=sys.argv[2])
print('MOVES', json.dumps({part: list(getattr(moves, part)) for part in %r}))
""" % (PARTS,)


def measured(repo: str, reps: int, moves: str) -> dict[str, tuple[float, float, float]]:
  """`{part: (latency s, bandwidth B/s, s per array)}` of `repo`'s code, in a process of
  its own (its lanes import the code the driver does: `repo`'s)."""
  env = dict(os.environ, PYTHONPATH=repo)
  command = [sys.executable, '-c', _MEASURE, str(reps), moves]
  done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith('MOVES ')]
  if done.returncode or not lines:
    raise RuntimeError(f'{repo}: the measurement failed:\n{done.stderr[-3000:]}')
  return json.loads(lines[-1][len('MOVES ') :])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--reps', type=int, default=15, help='moves of each message a round')
  parser.add_argument('--moves', default='host', choices=('host', 'socket'))
  parser.add_argument('--before', default=None, help='a checkout of an earlier commit')
  args = parser.parse_args()
  print(f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start')
  ways = {'now': REPO, **({'before': args.before} if args.before else {})}
  results = {way: [] for way in ways}
  for round_ in range(args.rounds):
    for way, repo in ways.items():
      got = measured(repo, args.reps, args.moves)
      results[way].append(got)
      shown = '  '.join(
        f'{part} {1e6 * got[part][0]:.0f} + {1e6 * got[part][2]:.2f}/array' for part in PARTS
      )
      print(f'  round {round_ + 1} {way:6s} µs: {shown}', flush=True)
  print(f'load average {os.getloadavg()[0]:.1f} at end; µs, median of rounds:')
  median = lambda runs, part, i: 1e6 * statistics.median(r[part][i] for r in runs)  # noqa: E731
  bench_common.print_table(
    ('code', *(f'{part} {what}' for part in PARTS for what in ('latency', 'per array'))),
    [
      (way, *(median(runs, part, i) for part in PARTS for i in (0, 2)))
      for way, runs in results.items()
    ],
  )
  if args.before:
    ratios = [b['link'][2] / n['link'][2] for n, b in zip(results['now'], results['before'])]
    print(
      f'link time per array, before over now (median of rounds): {statistics.median(ratios):.2f}x'
    )
  else:
    print(f'link time per array: {median(results["now"], "link", 2):.2f} µs')


if __name__ == '__main__':
  main()
