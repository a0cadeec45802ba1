r"""The device path against the host path: a move between two lanes, and DDG K=2.

    python -m benchmarks.device_path
    python -m benchmarks.device_path --gpu      # the lanes sharing this host's GPU

A value moves lane to lane on one of two paths (`LaneSpec.moves`, lanes/device_path.py):
the host path (its leaves copied out of the device into numpy arrays and written to the
receiving lane's socket) or the device path (offered where they are, pulled by the
receiving lane through JAX's transfer servers). Measured here, each path on lanes of its
own, the two alternated so that a slow spell of the machine slows both:

1. A move, as the virtual clock's host profile prices it
   (`link_timing.measure_process_links`): its link (latency, bandwidth, time per array
   beyond a message's first) and the receiving lane's take-in; `--repeats` times each,
   medians.
2. DDG K=2 (`real_speedup`'s model and case) on two pools, one per path, in interleaved
   rounds: time per iteration, median over rounds, and the device path's over the host
   path's in each round (median).

CPU lanes are pinned to cores 0 and 1; with `--gpu` each lane takes a quarter of one GPU
(two pools of two lanes fit on it). The line before the elapsed time is the median over
rounds of part 2's ratio.
Not a test: speed is measured, not asserted.
"""

import argparse
import os
import statistics
import time

import jax

from benchmarks import common as bench_common
from benchmarks import real_speedup
from jaxsgd.algorithms import ddg
from jaxsgd.scheduler import link_timing
from jaxsgd.scheduler.lanes import LanePool, cluster

PATHS = ('host', 'device')
GPU_SHARE = 0.25  # four lanes on one GPU: two pools of two


def measure_moves(repeats: int, gpu: float) -> dict[str, list]:
  """Each path's `Moves`, measured `repeats` times, alternated."""
  moves = {path: [] for path in PATHS}
  for _ in range(repeats):
    for path in PATHS:
      moves[path].append(link_timing.measure_process_links(moves=path, gpu=gpu))
  return moves


def ddg_rounds(rounds: int, steps: int, warmup: int, gpu: float) -> dict[str, list]:
  """Seconds per iteration of DDG K=2 on each path's pool, in interleaved rounds."""
  times = {path: [] for path in PATHS}
  placements = {
    path: link_timing.lane_pair(('stage0', 'stage1'), (0, 1), path, gpu) for path in PATHS
  }
  with LanePool(placements['host']) as host_pool, LanePool(placements['device']) as device_pool:
    pools = {'host': host_pool, 'device': device_pool}
    for _ in range(rounds):
      for path in PATHS:
        seconds, *_ = real_speedup.run(pools[path], ddg.roles(2), steps, warmup)
        times[path].append(seconds)
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=3, help='measurements of a move per path')
  parser.add_argument('--rounds', type=int, default=5, help='DDG rounds per path')
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--warmup', type=int, default=4)
  parser.add_argument('--gpu', action='store_true', help='lanes on a quarter of a GPU each')
  args = parser.parse_args()
  if args.repeats < 1 or args.rounds < 1 or not 0 <= args.warmup < args.steps:
    parser.error('--repeats and --rounds: at least 1; --warmup: 0 <= warmup < steps')
  gpu = GPU_SHARE if args.gpu else 0.0
  if gpu:  # refused in one line before anything runs, as `real_speedup --gpu` does
    cluster.connect(None)
    try:
      cluster.check_gpus(link_timing.lane_pair(('source', 'target'), (0, 1), 'device', gpu).lanes)
    except ValueError as error:
      parser.error(f'--gpu: {error}')
    finally:
      cluster.shutdown()  # (each measurement's pool starts its own)
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'jax {jax.__version__}; lanes: {"a quarter of a GPU each" if gpu else "cores 0 and 1"}'
  )
  moves = measure_moves(args.repeats, gpu)
  header = ('path', 'link latency ms', 'link GB/s', 'link µs/array', 'take-in latency ms',
            'take-in GB/s', 'take-in µs/array')  # fmt: skip
  rows = []
  for path in PATHS:
    figures = []
    for part in ('link', 'take_in'):
      latency, bandwidth, per_array = (
        statistics.median(getattr(m, part)[i] for m in moves[path]) for i in range(3)
      )
      figures += [f'{1e3 * latency:.2f}', f'{bandwidth / 1e9:.2f}', f'{1e6 * per_array:.1f}']
    rows.append((path, *figures))
  bench_common.print_table(header, rows)
  print(
    f'(medians of {args.repeats} measurements each; a measurement: '
    'link_timing.measure_process_links, 31 moves of each message)'
  )
  times = ddg_rounds(args.rounds, args.steps, args.warmup, gpu)
  ratios = [d / h for d, h in zip(times['device'], times['host'])]
  rows = [
    (
      f'ddg K=2, {path} path',
      f'{1e3 * statistics.median(times[path]):.1f}',
      ' '.join(f'{1e3 * t:.1f}' for t in times[path]),
    )
    for path in PATHS
  ]
  bench_common.print_table(('case', 'ms / iteration', 'rounds (ms)'), rows)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  print(f'device path / host path, DDG K=2 time per iteration: {statistics.median(ratios):.2f}')


if __name__ == '__main__':
  t0 = time.time()
  main()
  print(f'({time.time() - t0:.0f} s)')
