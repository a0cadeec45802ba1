r"""What a run's own Ray cluster costs the machine while its lanes idle, process by process.

    python -m benchmarks.idle_cluster                # ~1.5 min: 3 rounds, 2 lanes, 20 s each
    python -m benchmarks.idle_cluster --lanes=4 --seconds=30 --rounds=2

A lane process that waits for its next call uses no CPU; what a cluster costs between
tasks is Ray's: its daemons (GCS, raylet, its agents) and its worker processes (the lane
host that forks the lanes, any worker left idle). On a host whose every core holds a
lane, that CPU comes out of the lanes' cores for the whole run. Per round, and per way
(interleaved):
  now        a cluster as `LanePool` starts one (`cluster.connect(None)`)
  idle kept  the same with Ray's default for idle workers (`RAY_num_workers_soft_limit`
             -1: the raylet keeps the worker it started ahead for each CPU; the way
             before `cluster._without_idle_workers`)
it opens a pool of `--lanes` forked lanes (one core each, round-robin) on a cluster of
its own, waits 3 s (the raylet ends an idle worker once it has idled a second), reads
every process's CPU (the lanes, forked from the lane host, are its children) for
`--seconds`, then
closes the pool and stops the cluster. The table: ms of CPU a second, median over
rounds, by process name (Ray's workers by their title: `ray::LaneHost`, `ray::IDLE`;
this process: `driver`) and in all. Not a test: speed is measured, not asserted. The last line:
`idle cluster, <n> lanes: <x> ms of CPU a second (<y> with idle workers kept)`.
"""

import argparse
import os
import statistics
import time

import psutil

from benchmarks import common as bench_common
from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster

SETTLE_S = 3.0  # after the pool is up: the raylet ends idle workers a second after they idle
WAYS = {'now': None, 'idle kept': '-1'}  # way -> `cluster.IDLE_WORKERS_VAR`'s value


def cpu_seconds() -> dict[str, float]:
  """CPU seconds so far of every process this one started, by name, and of this one."""
  used = {'driver': time.process_time()}
  for child in psutil.Process().children(recursive=True):
    try:
      times = child.cpu_times()
      name = child.name()
    except psutil.Error:  # ended meanwhile
      continue
    used[name] = used.get(name, 0.0) + times.user + times.system
  return used


def one_round(lanes: int, seconds: float, idle_workers: str | None) -> dict[str, float]:
  """ms of CPU a second of each process (by name) of a cluster of its own, `lanes` lanes
  idle; `idle_workers`: `cluster.IDLE_WORKERS_VAR` set to that (None: as `LanePool`)."""
  users = os.environ.get(cluster.IDLE_WORKERS_VAR)  # (put back after: the run's own way)
  if idle_workers is not None:
    os.environ[cluster.IDLE_WORKERS_VAR] = idle_workers
  try:
    placement = LanePlacement.spread([f'lane{k}' for k in range(lanes)])
    with LanePool(placement, verbose=False):  # its lanes idle
      time.sleep(SETTLE_S)
      before = cpu_seconds()
      time.sleep(seconds)
      after = cpu_seconds()
  finally:
    os.environ.pop(cluster.IDLE_WORKERS_VAR, None)
    if users is not None:
      os.environ[cluster.IDLE_WORKERS_VAR] = users
    cluster.shutdown()
  used = {name: (after[name] - before.get(name, 0.0)) / seconds * 1e3 for name in after}
  return {name: ms for name, ms in used.items() if ms > 0.0}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--lanes', type=int, default=2, help='lanes of the pool (forked, idle)')
  parser.add_argument('--seconds', type=float, default=20.0, help='seconds read per round')
  parser.add_argument('--rounds', type=int, default=3, help='rounds, each way once')
  args = parser.parse_args()
  if args.lanes < 1 or args.seconds <= 0 or args.rounds < 1:
    parser.error('--lanes, --seconds and --rounds: positive numbers')
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'{args.lanes} idle lanes, {args.seconds:g} s a read, {args.rounds} rounds'
  )
  by_way = {way: [] for way in WAYS}
  for r in range(args.rounds):
    for way, value in WAYS.items():
      used = one_round(args.lanes, args.seconds, value)
      by_way[way].append(used)
      print(f'  round {r + 1} {way:9s} {sum(used.values()):6.1f} ms/s: ' + _describe(used))
  print(f'load average {os.getloadavg()[0]:.1f} at end; ms of CPU a second, median of rounds:')
  names = sorted({name for rounds in by_way.values() for used in rounds for name in used})
  median = lambda way, name: statistics.median(u.get(name, 0.0) for u in by_way[way])
  totals = {way: statistics.median(sum(u.values()) for u in by_way[way]) for way in WAYS}
  rows = [(name, *(median(way, name) for way in WAYS)) for name in names]
  rows.append(('all', *totals.values()))
  bench_common.print_table(('process', *WAYS), rows)
  print(
    f'idle cluster, {args.lanes} lanes: {totals["now"]:.1f} ms of CPU a second '
    f'({totals["idle kept"]:.1f} with idle workers kept)'
  )


def _describe(used: dict[str, float]) -> str:
  return ', '.join(f'{name} {ms:.1f}' for name, ms in sorted(used.items(), key=lambda x: -x[1]))


if __name__ == '__main__':
  main()
