r"""Where lane processes lose time between their tasks: Ray's hand-over of each call,
imports, and the driver's round trip.

    python -m benchmarks.lane_overheads            # ~1 min on a 2-core CPU
    python -m benchmarks.lane_overheads --steps=60

What `real_speedup` and `simulator_accuracy` measure as a whole, taken apart, on this
machine's lane processes (`ProcessExecutor` over one `LanePool`):

1. Idle chains (`profiles.measure_dispatch`, one lane on core 0, nothing else running):
   200 tasks of a 4-byte add in a row, each on the previous one's result; wall time per
   task minus the JAX call itself. Run ahead (the driver sends each call as soon as it
   has the previous one's handles, so the lane finds it queued: what Ray costs between
   two queued calls), and waited for (`Compute(ahead=False)`: the driver hears of each
   task's end before it sends the next: the round trip). Their difference is the driver
   hearing of an end, which a process that waits for its task pays on top.
2. DDG K=2 of `real_speedup`'s model (stages on cores 0 and 1; the driver and Ray share
   those cores), per lane and per iteration of the steady state: busy (its tasks),
   waiting for imports (a call's entering the lane → its task's start: a copy from the
   other lane not there yet), and hand-over (a task's end → the next call's entering the
   lane); the driver's CPU per iteration by thread, and Ray's processes' (raylet, GCS).
3. ASGD M=2 of the same model (workers on cores 0 and 1, the server on core 0): from a
   worker's backward end to the start of its push's copy. A worker waits for its
   backward (`asgd.RUN_AHEAD` = 1: its pushes reach the server in the order their
   gradients exist), so the push goes once the driver has heard of that end.

The last line: `lane hand-over between calls in DDG K=2 (processes): <x> ms median (idle
chain: <y> ms)`. No timing is asserted anywhere; the figures are this machine's.

Measured here (2-core AMD EPYC VM, 2026-11-26, benchmarks/results/lane_overheads.txt):
what `simulator_accuracy` replays with the runs' own task costs still misses for ASGD at
small tasks is mostly the push delay of (3), which the virtual clock does not model.
"""

import argparse
import os
import statistics

import psutil

from benchmarks import common as bench_common
from benchmarks import real_speedup
from jaxsgd.algorithms import ddg
from jaxsgd.scheduler import profiles
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.process import ProcessExecutor


def idle_chains(pool: LanePool) -> dict[str, float]:
  """Seconds per task of the idle chains (module docstring, 1): run ahead, waited for."""
  make = {'processes': lambda: ProcessExecutor(pool=pool, verbose=False)}
  return {
    'run ahead': profiles.measure_dispatch(make, lane='stage0')['processes'],
    'waited for': profiles.measure_dispatch(make, lane='stage0', ahead=False)['processes'],
  }


class FinishedTasks:
  """Records every task `pool.wait_any` returns: (lane, entered, started, ended)."""

  def __init__(self, pool: LanePool):
    self.pool, self.tasks = pool, []
    self._wait_any = pool.wait_any

  def __enter__(self):
    def wait_any(pending, timeout=None):
      finished = self._wait_any(pending, timeout)
      if finished is not None and finished.entered is not None:
        self.tasks.append((finished.lane, finished.entered, finished.started, finished.ended))
      return finished

    self.pool.wait_any = wait_any
    return self

  def __exit__(self, *exc):
    del self.pool.wait_any  # the bound method again


def thread_cpu() -> dict[str, float]:
  """CPU seconds of this process's threads so far, summed by thread name (Linux)."""
  seconds = {}
  for tid in os.listdir('/proc/self/task'):
    try:
      with open(f'/proc/self/task/{tid}/comm') as f:
        name = f.read().strip()
      with open(f'/proc/self/task/{tid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:  # ended meanwhile
      continue
    seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
  return seconds


_TICKS = os.sysconf('SC_CLK_TCK')


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
  """DDG K=2 (module docstring, 2): per lane, ms per iteration busy, waiting for imports
  and in hand-overs (with the hand-overs' median), and the driver's and Ray's CPU ms per
  iteration by thread ('driver <name>') or process ('<name> process'); and the run's
  seconds per iteration."""
  real_speedup.run(pool, ddg.roles(2), warmup + 2, 2)  # every lane compiled its tasks
  cpu, ray_before = thread_cpu(), ray_cpu()
  with FinishedTasks(pool) as finished:
    seconds = real_speedup.run(pool, ddg.roles(2), steps, warmup)[0]
  used = {f'driver {n}': s - cpu.get(n, 0.0) for n, s in thread_cpu().items()}
  used.update({f'{n} process': s - ray_before.get(n, 0.0) for n, s in ray_cpu().items()})
  timeline = real_speedup.LAST_RUN['timeline']
  start, end = real_speedup.steady_window(timeline, steps, warmup)
  t0 = real_speedup.LAST_RUN['executor']._t0  # pylint: disable=protected-access
  iterations = steps - warmup
  lanes = {}
  for lane in sorted({task[0] for task in finished.tasks}):
    tasks = sorted(t[1:] for t in finished.tasks if t[0] == lane)
    tasks = [t for t in tasks if start <= t[0] - t0 and t[2] - t0 <= end]
    handovers = [b[0] - a[2] for a, b in zip(tasks, tasks[1:])]
    lanes[lane] = {
      'busy': sum(t[2] - t[1] for t in tasks) / iterations,
      'imports': sum(t[1] - t[0] for t in tasks) / iterations,
      'hand-overs': sum(handovers) / iterations,
      'calls': len(tasks) / iterations,
      'hand-over median': statistics.median(handovers),
    }
  per_iteration = {n: s / steps for n, s in used.items() if s > 0}  # whole run, warm-up too
  return lanes, per_iteration, seconds


def asgd_push_delays(pool: LanePool, steps: int, warmup: int) -> list[float]:
  """ASGD M=2 (module docstring, 3): seconds from each steady-state backward's end to
  the start of its push's copy."""
  real_speedup.run_asgd(pool, 2, warmup + 2, 2)
  real_speedup.run_asgd(pool, 2, steps, warmup)
  timeline = real_speedup.LAST_RUN['timeline']
  names = timeline.lane_names
  start, _ = real_speedup.steady_window(timeline, steps, warmup)
  copies = {}
  for task in timeline.records:
    name = names[task.lane]
    if name.startswith('link worker') and task.kind == 'transfer':
      worker = name[len('link ') :].split(' (')[0]
      copies[worker, task.batch] = min(copies.get((worker, task.batch), task.start), task.start)
  delays = []
  for task in timeline.tasks(kind='backward'):
    copy = copies.get((names[task.lane].split(' (')[0], task.batch))
    if task.start >= start and copy is not None:
      delays.append(copy - task.end)
  return delays


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
    lanes, driver, seconds = ddg_lanes(pool, args.steps, args.warmup)
    delays = asgd_push_delays(pool, args.steps, args.warmup)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  print('\n1. idle chains, one lane (ms per task, the JAX call taken out)')
  bench_common.print_table(
    ('chain', 'ms / task'), [(name, f'{1e3 * s:.3f}') for name, s in chains.items()]
  )
  print(
    f'the driver hearing of an end: {1e3 * (chains["waited for"] - chains["run ahead"]):.3f} ms'
  )
  print(f'\n2. DDG K=2, {1e3 * seconds:.1f} ms per iteration (ms per iteration of each lane)')
  bench_common.print_table(
    ('lane', 'calls', 'busy', 'waiting for imports', 'hand-overs', 'hand-over median ms'),
    [
      (
        lane,
        f'{v["calls"]:.1f}',
        f'{1e3 * v["busy"]:.1f}',
        f'{1e3 * v["imports"]:.1f}',
        f'{1e3 * v["hand-overs"]:.1f}',
        f'{1e3 * v["hand-over median"]:.2f}',
      )
      for lane, v in lanes.items()
    ],
  )
  top = sorted(driver.items(), key=lambda item: -item[1])[:8]
  print(
    'driver and Ray, CPU ms per iteration (the whole run): '
    + ', '.join(f'{name} {1e3 * s:.1f}' for name, s in top)
  )
  print("\n3. ASGD M=2: a backward's end -> its push's copy starts (ms)")
  bench_common.print_table(
    ('pushes', 'median', 'mean', 'p90'),
    [
      (
        len(delays),
        f'{1e3 * statistics.median(delays):.2f}',
        f'{1e3 * statistics.mean(delays):.2f}',
        f'{1e3 * sorted(delays)[int(0.9 * (len(delays) - 1))]:.2f}',
      )
    ],
  )
  handover = statistics.median(v['hand-over median'] for v in lanes.values())
  print(
    f'lane hand-over between calls in DDG K=2 (processes): {1e3 * handover:.2f} ms median '
    f'(idle chain: {1e3 * chains["run ahead"]:.2f} ms)'
  )


if __name__ == '__main__':
  main()
