r"""Where lane processes lose time between their tasks: Ray's hand-over of each call,
the driver, imports.

    python -m benchmarks.lane_overheads            # ~1 min on a 2-core CPU
    python -m benchmarks.lane_overheads --steps=60

What `real_speedup` and `simulator_accuracy` measure as a whole, taken apart, on this
machine's lane processes (`ProcessExecutor` over one `LanePool`). Each call to a lane is
stamped when the driver sent it (`Pending.sent`), when it entered the lane
(`entered`), when its task started there, its imports taken in (`started`), and when
the task ended (`ended`). Between two calls a, b of one lane:

    b sent before a ended:  hand-over = b.entered - a.ended   (Ray handing the lane its
                                                               next, queued call)
    b sent after a ended:   waiting for the driver = b.sent - a.ended,
                            hand-over = b.entered - b.sent

The hand-over is Ray's per-call work in the driver and in the lane, and whatever else
runs on the lane's core meanwhile (its own export thread copying a value out, the
driver, Ray's processes). Waiting for the driver is the lane idle with no call sent to
it: the driver had not got to it yet, or the policy had nothing to start there (a
stage waiting for the other stage's gradient).

1. Idle chains (`lane_timing.measure_dispatch`, one lane on core 0, nothing else running):
   200 tasks of a 4-byte add in a row, each on the previous one's result. Run ahead
   (the driver sends each call as soon as it has the previous one's handles) and waited
   for (`Compute(ahead=False)`: the driver hears of each task's end before it sends the
   next): wall time per task minus the JAX call (the fastest of 5 rounds), and the
   median hand-over of the run-ahead chain's queued calls (over its warm-up and 5
   rounds). The difference of the two per-task times is the driver hearing of an end.
2. DDG K=2 of `real_speedup`'s model (stages on cores 0 and 1; the driver and Ray share
   those cores), per lane, over the steady state, in ms per iteration: busy (its tasks),
   waiting for imports (entered -> started: a copy from the other lane not there yet),
   waiting for the driver, hand-overs (all, each interval clipped to the steady state, so
   the parts add up), and the median hand-over of a queued call; then the driver's and
   Ray's processes' CPU per iteration of the whole run (set-up and warm-up included),
   and the driver's Ray threads together (worker.io, nexting_thread, client.poll*,
   server.poll*).
3. ASGD M=2 of the same model (workers on cores 0 and 1, the server on core 0): from a
   worker's backward end to the start of its push's copy (`common.send_delays`). A
   worker waits for its backward (`asgd.RUN_AHEAD` = 1: its pushes reach the server in
   the order their gradients exist), so the push goes once the driver has heard of that
   end. The virtual clock sends it at once (`simulator_accuracy` prints both).

The last line: `lane hand-over between queued calls in DDG K=2 (processes): <x> ms median
(idle chain: <y> ms)`. No timing is asserted anywhere; the figures are this machine's
(benchmarks/results/lane_overheads.txt).
"""

import argparse
import math
import os
import statistics

import psutil

from benchmarks import common as bench_common
from benchmarks import real_speedup
from jaxsgd.algorithms import ddg
from jaxsgd.scheduler import lane_timing
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.process import ProcessExecutor


class FinishedTasks:
  """Records every task `pool.wait_any` returns: (lane, sent, entered, started, ended)
  (`time.time()`; moves, which have no call of their own, are left out)."""

  def __init__(self, pool: LanePool):
    self.pool, self.tasks = pool, []
    self._wait_any = pool.wait_any

  def __enter__(self):
    def wait_any(pending, timeout=None):
      finished = self._wait_any(pending, timeout)
      if finished is not None and finished.entered is not None:
        self.tasks.append(
          (finished.lane, finished.sent, finished.entered, finished.started, finished.ended)
        )
      return finished

    self.pool.wait_any = wait_any
    return self

  def __exit__(self, *exc):
    del self.pool.wait_any  # the bound method again


def between_calls(calls: list, start: float = -math.inf, end: float = math.inf) -> dict:
  """Where one lane's time went between `start` and `end` (`time.time()`): `calls` are
  its calls' (sent, entered, started, ended), in any order; each interval is clipped
  to the window, so the parts add up to the time the calls span there. Busy (tasks),
  imports (entered -> started), waiting for the driver and hand-overs (module
  docstring), the number of calls that entered in the window, and `queued`: each
  hand-over of a call sent before the previous one ended that entered in the window,
  whole (a distribution, not a sum)."""
  calls = sorted(calls, key=lambda call: call[1])  # the order the lane took them in
  clip = lambda a, b: bench_common.overlap(a, b, start, end)
  parts = {'busy': 0.0, 'imports': 0.0, 'driver': 0.0, 'hand-overs': 0.0}
  for _, entered, started, ended in calls:
    parts['busy'] += clip(started, ended)
    parts['imports'] += clip(entered, started)
  queued = []
  for (_, _, _, ended), (sent, entered, _, _) in zip(calls, calls[1:]):
    if entered < ended - _SKEW:
      raise ValueError(f'a call entered the lane at {entered} before the last ended at {ended}')
    if sent <= ended:
      parts['hand-overs'] += clip(ended, entered)
      if start <= entered <= end:
        queued.append(entered - ended)
    else:
      parts['driver'] += clip(ended, sent)
      parts['hand-overs'] += clip(sent, entered)
  calls_in = sum(1 for _, entered, _, _ in calls if start <= entered <= end)
  return {**parts, 'calls': calls_in, 'queued': queued}


_SKEW = 1e-3  # s: stamps of one host's processes (`time.time()`) agree far better


def idle_chains(pool: LanePool) -> dict[str, float]:
  """The idle chains (module docstring, 1): seconds per task run ahead and waited for,
  and the run-ahead chain's median hand-over between queued calls."""
  make = {'processes': lambda: ProcessExecutor(pool=pool, verbose=False)}
  with FinishedTasks(pool) as finished:
    ahead = lane_timing.measure_dispatch(make, lane='stage0')['processes']
  waited = lane_timing.measure_dispatch(make, lane='stage0', ahead=False)['processes']
  queued = between_calls([t[1:] for t in finished.tasks if t[0] == 'stage0'])['queued']
  return {'run ahead': ahead, 'waited for': waited, 'hand-over': _median(queued)}


def _median(values: list) -> float:
  return statistics.median(values) if values else math.nan


def thread_cpu() -> dict[str, float]:
  """CPU seconds of this process's threads so far, summed by thread name (Linux)."""
  seconds = {}
  for name, used in bench_common.thread_cpu_seconds().values():
    seconds[name] = seconds.get(name, 0.0) + used
  return seconds


# The threads Ray's core worker runs in a driver (`thread_cpu` names).
_RAY_THREADS = (
  'driver worker.io',
  'driver nexting_thread',
  'driver client.poll',
  'driver server.poll',
)


def ray_cpu() -> dict[str, float]:
  """CPU seconds so far of Ray's own processes started by this one (raylet, GCS, ...),
  by name; the lane processes are left out (their tasks are measured apart)."""
  seconds = {}
  for child in psutil.Process().children(recursive=True):
    try:
      name, times = child.name(), child.cpu_times()
    except psutil.Error:
      continue
    if 'LaneRuntime' not in name and 'ray::' not in name:
      seconds[name] = seconds.get(name, 0.0) + times.user + times.system
  return seconds


def ddg_lanes(pool: LanePool, steps: int, warmup: int) -> tuple[dict, dict, float]:
  """DDG K=2 (module docstring, 2): `between_calls` of each lane over the steady state;
  the driver's and Ray's CPU seconds over the run, by thread ('driver <name>') or
  process ('<name> process'); and the run's seconds per iteration."""
  real_speedup.run(pool, ddg.roles(2), warmup + 2, 2)  # every lane compiled its tasks
  cpu, ray_before = thread_cpu(), ray_cpu()
  with FinishedTasks(pool) as finished:
    seconds = real_speedup.run(pool, ddg.roles(2), steps, warmup)[0]
  used = {f'driver {n}': s - cpu.get(n, 0.0) for n, s in thread_cpu().items()}
  used.update({f'{n} process': s - ray_before.get(n, 0.0) for n, s in ray_cpu().items()})
  run = real_speedup.LAST_RUN
  start, end, _ = real_speedup.steady_window(run['timeline'], warmup)
  lanes = {
    lane: between_calls(
      [t[1:] for t in finished.tasks if t[0] == lane], run['t0'] + start, run['t0'] + end
    )
    for lane in sorted({t[0] for t in finished.tasks})
  }
  return lanes, {n: s for n, s in used.items() if s > 0}, seconds


def asgd_push_delays(pool: LanePool, steps: int, warmup: int) -> list[float]:
  """ASGD M=2 (module docstring, 3): seconds from each steady-state backward's end to
  the start of its push's copy."""
  real_speedup.run_asgd(pool, 2, warmup + 2, 2)
  real_speedup.run_asgd(pool, 2, steps, warmup)
  timeline = real_speedup.LAST_RUN['timeline']
  start, *_ = real_speedup.steady_window(timeline, warmup)
  tasks = [(r.lane, r.kind, r.start, r.end, r.batch) for r in timeline.records if r.start >= start]
  return bench_common.send_delays(dict(enumerate(timeline.lane_names)), tasks)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--warmup', type=int, default=8)
  args = parser.parse_args()
  if args.steps < args.warmup + 5:
    parser.error(f'--steps: at least --warmup + 5 = {args.warmup + 5}; got {args.steps}')
  cores = sorted(os.sched_getaffinity(0))
  core = lambda k: cores[k % len(cores)]
  placement = LanePlacement.parse(
    '; '.join(entry for f in ('bp', 'asgd') for entry in bench_common.family_lanes(f, 2, core))
  )
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'MLP {real_speedup.FEATURES}-{"-".join(map(str, real_speedup.HIDDEN))}-'
    f'{real_speedup.CLASSES}, batch {real_speedup.BATCH}; {args.steps} steps '
    f'({args.warmup} warm-up)'
  )
  with LanePool(placement) as pool:
    chains = idle_chains(pool)
    lanes, used, seconds = ddg_lanes(pool, args.steps, args.warmup)
    delays = asgd_push_delays(pool, args.steps, args.warmup)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  ms = lambda s: f'{1e3 * s:.3f}'
  print('\n1. idle chains, one lane (ms per task, the JAX call taken out)')
  bench_common.print_table(
    ('chain', 'ms / task'), [(name, ms(chains[name])) for name in ('run ahead', 'waited for')]
  )
  print(
    f'the driver hearing of an end: {ms(chains["waited for"] - chains["run ahead"])} ms; '
    f'hand-over between queued calls (median): {ms(chains["hand-over"])} ms'
  )
  iterations = args.steps - args.warmup
  print(f'\n2. DDG K=2, {1e3 * seconds:.1f} ms per iteration (per lane: ms per iteration)')
  bench_common.print_table(
    (
      'lane',
      'calls',
      'busy',
      'waiting for imports',
      'waiting for the driver',
      'hand-overs',
      'queued hand-over median ms',
    ),
    [
      (
        lane,
        f'{v["calls"] / iterations:.1f}',
        f'{1e3 * v["busy"] / iterations:.1f}',
        f'{1e3 * v["imports"] / iterations:.1f}',
        f'{1e3 * v["driver"] / iterations:.1f}',
        f'{1e3 * v["hand-overs"] / iterations:.1f}',
        ms(_median(v['queued'])),
      )
      for lane, v in lanes.items()
    ],
  )
  top = sorted(used.items(), key=lambda item: -item[1])[:8]
  print(
    'driver and Ray, CPU ms per iteration of the whole run (set-up and warm-up included): '
    + ', '.join(f'{name} {1e3 * s / args.steps:.1f}' for name, s in top)
  )
  ray_threads = sum(s for name, s in used.items() if name.startswith(_RAY_THREADS))
  print(f"the driver's Ray threads together: {1e3 * ray_threads / args.steps:.1f} ms per iteration")
  print("\n3. ASGD M=2: a backward's end -> its push's copy starts (ms)")
  cells = ('-', '-', '-')
  if delays:
    ordered = sorted(delays)
    cells = (
      ms(statistics.median(delays)),
      ms(statistics.mean(delays)),
      ms(ordered[int(0.9 * (len(ordered) - 1))]),
    )
  bench_common.print_table(('pushes', 'median', 'mean', 'p90'), [(len(delays), *cells)])
  queued = [d for v in lanes.values() for d in v['queued']]
  print(
    f'lane hand-over between queued calls in DDG K=2 (processes): '
    f'{1e3 * _median(queued):.2f} ms median (idle chain: '
    f'{1e3 * chains["hand-over"]:.2f} ms)'
  )


if __name__ == '__main__':
  main()
