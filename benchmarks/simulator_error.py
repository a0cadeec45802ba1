r"""The simulator's error in its parts, in one command.

    python -m benchmarks.simulator_error                      # ~55 min on 2 cores
    python -m benchmarks.simulator_error --schedule="--families=ddg,asgd --lanes=2,4 --workers=" \
        --accuracy="--families=ddg,asgd --repeats=1"          # a few minutes

Two benchmarks, one after the other, each printing its own tables (their docstrings say
how each is measured):

  part 1, the schedule and executor model   `benchmarks.schedule_error`: every family at
          K = 2, 4, 8, 16 lanes (ASGD, DC-ASGD also M = 32) with emulated tasks — each
          task waits exactly its price on the process executor, every message moves its
          real payload — against the virtual clock with the same prices and the host
          profile measured at the start: time per iteration, staleness histograms;
  part 2, the task costs                    `benchmarks.simulator_accuracy`'s tables per
          family: each lane's task kinds, their priced cost (the cost profile measured
          at the start) against their durations in a real-compute run (median, p10, p90);
  part 3, end to end                        `benchmarks.simulator_accuracy`: real compute
          on lane processes (K = 2 by default) against the virtual clock's prediction.

`--schedule` and `--accuracy` pass their arguments on (one string each). The last two
lines are the two benchmarks' headline figures, in this order:

    simulator schedule error, emulated tasks, K=2..<K>: <x>%
    simulator max error across families: <x>%

(the first from part 1: its largest error over every family and K; the second from part
3). A benchmark that fails stops this one, with its exit status.
"""

import argparse
import re
import shlex
import subprocess
import sys

SCHEDULE_LINE = re.compile(r'^simulator schedule error, emulated tasks, .*$', re.MULTILINE)
END_TO_END_LINE = re.compile(r'^simulator max error across families: .*$', re.MULTILINE)


def run_part(module: str, arguments: str) -> str:
  """Runs `python -m benchmarks.<module> <arguments>`, its output passed through as it
  comes; returns the output. Exits with the benchmark's status if it fails."""
  command = [sys.executable, '-m', f'benchmarks.{module}', *shlex.split(arguments)]
  print(f'$ {shlex.join(command[1:])}', flush=True)
  lines = []
  with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
    for line in p.stdout:
      print(line, end='', flush=True)
      lines.append(line)
  if p.returncode:
    raise SystemExit(f'benchmarks.{module} failed (exit {p.returncode}); stopped.')
  return ''.join(lines)


def last_match(pattern: re.Pattern, text: str, module: str) -> str:
  found = pattern.findall(text)
  if not found:
    raise SystemExit(f'benchmarks.{module} printed no line matching {pattern.pattern!r}.')
  return found[-1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--schedule', default='', help='arguments for benchmarks.schedule_error')
  parser.add_argument('--accuracy', default='', help='arguments for benchmarks.simulator_accuracy')
  args = parser.parse_args()
  schedule = run_part('schedule_error', args.schedule)
  accuracy = run_part('simulator_accuracy', args.accuracy)
  print(last_match(SCHEDULE_LINE, schedule, 'schedule_error'))
  print(last_match(END_TO_END_LINE, accuracy, 'simulator_accuracy'))


if __name__ == '__main__':
  main()
