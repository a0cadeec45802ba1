r"""Start-up of a training run on lane processes: where its first seconds go.

    python -m benchmarks.startup               # ~2 min: 3 rounds of 2 runs, DDG smoke
    python -m benchmarks.startup --rounds=5 --config=asgd.py:smoke
    python -m benchmarks.startup --set=stages=2 --before=/tmp/old   # an A/B, 2 lanes

Runs `python -m experiments.train --config=experiments/configs/CONFIG --config.clock=real
--config.executor=processes` as a user would, reading its terminal as it prints, in two
ways per round (interleaved):
  own      the run starts a Ray cluster of its own (no `cluster_address`)
  running  the run joins a cluster already running on this machine
           (`--config.cluster_address=auto`; the benchmark starts it with `ray start
           --head`, token authentication on, before the rounds and stops it after)
Per run, seconds from the command's start to: the line saying the lanes are starting
(`lanes: starting N lane processes`: the driver's own set-up is done), the lane
placement printed (every lane process is up: the first task is dispatched then), the
first training step on the progress bar (the lanes' first tasks compiled and ran), and
the exit; and how many of the machine's cores were busy, on average, from the command to
the first task (`/proc/stat`: every process's CPU, Ray's and other jobs' too): near the
core count, the start is bound by CPU and only less of it helps; well below, by waits
that overlap could fill. Medians over rounds; the last line is the median time to the
first task of a run with a cluster of its own. `--set=FIELD=VALUE` passes
`--config.FIELD=VALUE` to every run; `--before` adds a checkout's runs both ways
("before", "before running"), interleaved.
Not a test: speed is measured, not asserted.
"""

import argparse
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import common as bench_common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MILESTONES = ('lanes starting', 'first task', 'first step', 'exit')
BUSY = 'busy cores to first task'
_FIRST_STEP = re.compile(r'\|\s*[1-9]\d*/\d+ \[')


def timed_run(
  config: str,
  workdir: str,
  data_dir: str | None,
  address: str | None,
  repo: str,
  env: dict,
  fields: tuple[str, ...] = (),
) -> dict:
  """Seconds from the command's start to each of `MILESTONES` (None if not seen), and
  `BUSY`: the machine's busy cores over that first stretch (`core_busy_seconds`); `fields`:
  `FIELD=VALUE`s given as `--config.FIELD=VALUE`."""
  command = [
    sys.executable,
    '-m',
    'experiments.train',
    f'--config=experiments/configs/{config}',
    f'--workdir={workdir}',
    '--overwrite',
    '--config.clock=real',
    '--config.executor=processes',
    *(f'--config.{field}' for field in fields),
  ]
  if data_dir:
    command.append(f'--config.data_dir={data_dir}')
  if address:
    command.append(f'--config.cluster_address={address}')
  seen = dict.fromkeys((*MILESTONES, BUSY))
  busy_at_start = sum(bench_common.core_busy_seconds())
  start = time.monotonic()
  process = subprocess.Popen(
    command,
    cwd=repo,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    bufsize=1,
  )
  for line in process.stdout:
    now = time.monotonic() - start
    for part in line.replace('\r', '\n').splitlines():
      if seen['lanes starting'] is None and 'lanes: starting' in part:
        seen['lanes starting'] = now
      if seen['first task'] is None and 'lanes (one process each' in part:
        seen['first task'] = now
        seen[BUSY] = (sum(bench_common.core_busy_seconds()) - busy_at_start) / now
      if seen['first step'] is None and _FIRST_STEP.search(part):
        seen['first step'] = now
  status = process.wait()
  seen['exit'] = time.monotonic() - start
  if status != 0:
    raise SystemExit(f'the run exited with {status}: {" ".join(command)}')
  return seen


def _median(values) -> float | str:
  seen = [v for v in values if v is not None]
  return round(statistics.median(seen), 2) if seen else '-'


def start_head() -> dict:
  """A Ray cluster on this machine (`ray start --head`, with Ray's token authentication,
  its default, here a token of this benchmark's own rather than `~/.ray/auth_token`):
  the environment for the runs that join it, which hold the token and leave
  `RAY_AUTH_MODE` unset, as a user's shell after `ray start --head` (the run turns
  authentication on where the cluster asks for it: `cluster.check_joinable`)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('RAY_AUTH_')}
  env.update(RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED='0')
  ray = os.path.join(os.path.dirname(sys.executable), 'ray')
  with socket.socket() as probe:  # a port nothing listens on now
    probe.bind(('127.0.0.1', 0))
    port = str(probe.getsockname()[1])
  subprocess.run(
    [ray, 'start', '--head', f'--port={port}', '--include-dashboard=false'],
    env={**env, 'RAY_AUTH_MODE': 'token'},
    check=True,
    capture_output=True,
  )
  return env


def stop_head(env: dict) -> None:
  ray = os.path.join(os.path.dirname(sys.executable), 'ray')
  subprocess.run([ray, 'stop', '--force'], env=env, capture_output=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='ddg.py:smoke', help='experiments/configs/...')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--data-dir', default=None, help='config.data_dir (default: tfds)')
  parser.add_argument(
    '--set', action='append', default=[], help='FIELD=VALUE: --config.FIELD=VALUE for every run'
  )
  parser.add_argument(
    '--before',
    default=None,
    help='a checkout of an earlier commit: its runs with a cluster of their own are '
    'interleaved with the others as "before" (and the ratio printed)',
  )
  args = parser.parse_args()
  print(f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start')
  fields = tuple(args.set)
  shown = ' '.join([args.config, *fields])
  print(f'{shown} on lane processes, {args.rounds} rounds (own, running: interleaved)')
  ways = ('own', 'running') + (('before', 'before running') if args.before else ())
  results = {way: [] for way in ways}
  head_env = start_head()
  try:
    with tempfile.TemporaryDirectory(prefix='startup-') as folder:
      for round_ in range(args.rounds):
        for way in ways:
          running = way.endswith('running')
          env = head_env if running else dict(os.environ)
          address = 'auto' if running else None
          repo = args.before if way.startswith('before') else REPO
          workdir = os.path.join(folder, way.replace(' ', '_'))
          seen = timed_run(args.config, workdir, args.data_dir, address, repo, env, fields)
          results[way].append(seen)
          shown = '  '.join(
            f'{m} {seen[m]:.2f}' for m in (*MILESTONES, BUSY) if seen[m] is not None
          )
          print(f'  round {round_ + 1} {way:14s} {shown}', flush=True)
  finally:
    stop_head(head_env)
  print(f'load average {os.getloadavg()[0]:.1f} at end; seconds from the command, median:')
  columns = (*MILESTONES, BUSY)
  bench_common.print_table(
    ('cluster', *columns),
    [(way, *(_median(r[m] for r in runs) for m in columns)) for way, runs in results.items()],
  )
  own = statistics.median(r['first task'] for r in results['own'])
  if args.before:
    for now, before in (('own', 'before'), ('running', 'before running')):
      ratios = [b['first task'] / o['first task'] for o, b in zip(results[now], results[before])]
      print(
        f'time to the first task, {before} over {now} (median of rounds): '
        f'{statistics.median(ratios):.2f}x'
      )
  print(f'seconds to the first task on lane processes, own cluster: {own:.2f}')


if __name__ == '__main__':
  main()
