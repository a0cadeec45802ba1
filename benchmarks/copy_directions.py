r"""Two copies at once: between four lanes, or one into and one out of the same lane process.

    python -m benchmarks.copy_directions        # ~1 min on a 2-core CPU

A lane process sends its copies in an export thread and reads the copies sent to it in a
reader thread (`LaneRuntime._read_lane`), both in its one Python interpreter. The virtual
clock simulating the process executor (`cost.host`) lets a copy's export hold its
sender's interpreter (`cost.export`) and the rest of the copy (the socket, the
receiver's reading) hold nothing (`scheduler/virtual_processes.py`): with lanes that share
no core, two copies at once take each its price, whichever lanes they join. A parameter
server's lane does this at every update: the new parameters go out to one worker while
the next worker's gradient comes in.

Four lanes, none pinned to a core. Interleaved, `--repeats` times, each case a message of
`--arrays` arrays of `--mb` MB in all made anew on its sending lane(s), the copies asked
for before the values exist (as a process running ahead asks) and read by a call on the
receiving lane:
  alone      a -> b
  disjoint   a -> b and c -> d at once (four processes: only the cores are shared)
  shared     a -> b and b -> a at once (b reads one copy while it exports the other)
  relay      c -> a and a -> b at once (a reads one copy while it exports the other)
Each copy's time from its value existing on its sender to its arrival (`LanePool.exported`),
median over the repeats, beside the link's price from the host profile's figures
(`link_timing.measure_process_links`, measured first: from the end of the task that made
the value, so it holds the lane's reply too). The last two lines: how much longer the
copies of `shared` and of `relay` take than the two of `disjoint` (per repeat, the mean
of the two copies' differences; the median); the last, `relay`'s, is a parameter
server's case.
Not a test: speed is measured, not asserted. Results: benchmarks/results/copy_directions.txt.
"""

import argparse
import os
import statistics

import jax
import numpy as np

from benchmarks import common as bench_common
from jaxsgd.scheduler import link_timing
from jaxsgd.scheduler.lane_timing import dispatch_tasks
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe

CASES = {
  'alone': (('a', 'b'),),
  'disjoint': (('a', 'b'), ('c', 'd')),
  'shared': (('a', 'b'), ('b', 'a')),
  'relay': (('c', 'a'), ('a', 'b')),
}


def copy_seconds(pool: LanePool, pairs, sources: dict) -> list[float]:
  """Each of `pairs`' copies (sender, receiver) at once: seconds from its value existing
  on its sender (made anew there by a task) to its arrival."""
  make = Task(TaskRecipe.of(dispatch_tasks), 'add_one')
  first = Task(TaskRecipe.of(dispatch_tasks), 'first')
  made = {sender: pool.start(sender, make, (sources[sender],)) for sender, _ in pairs}
  values = {sender: pool.early(call) for sender, call in made.items()}
  if any(value is None for value in values.values()):  # (outline not known yet: warm-up)
    pool.wait_all(list(made.values()))
    values = {sender: call.result() for sender, call in made.items()}
  exports, calls = {}, list(made.values())
  for sender, receiver in pairs:
    exports[sender] = []
    moved = pool.move(values[sender], receiver, exports=exports[sender])
    calls.append(pool.start(receiver, first, (moved,)))
  pool.wait_all(calls)
  pool.settle()
  spans = [pool.exported(exports[sender]) for sender, _ in pairs]
  return [end - start for start, end in spans]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=41)
  parser.add_argument('--arrays', type=int, default=34)  # a 16-layer MLP's gradient
  parser.add_argument('--mb', type=float, default=1.0)
  args = parser.parse_args()
  for name in ('repeats', 'arrays'):
    if getattr(args, name) < 1:
      parser.error(f'--{name}: at least 1; got {getattr(args, name)}')
  if not args.mb > 0:
    parser.error(f'--mb: more than 0; got {args.mb}')
  moves = link_timing.measure_process_links()
  nbytes = int(args.mb * (1 << 20))
  latency, bandwidth, per_array = moves.link
  price = latency + (args.arrays - 1) * per_array + nbytes / bandwidth
  size = nbytes // 4 // args.arrays
  times = {case: [] for case in CASES}
  with LanePool(LanePlacement.parse('a; b; c; d'), verbose=False) as pool:
    sources = {
      lane: pool.put(lane, [np.zeros(size, np.float32) for _ in range(args.arrays)])
      for lane in 'abcd'
    }
    for _ in range(3):  # compiled, the outlines known, each path warm
      for pairs in CASES.values():
        copy_seconds(pool, pairs, sources)
    for _ in range(args.repeats):
      for case, pairs in CASES.items():
        times[case].append(copy_seconds(pool, pairs, sources))
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; jax '
    f'{jax.__version__}; {args.arrays} arrays, {args.mb:g} MB in all; the priced link '
    f'(host profile measured first): {1e3 * price:.2f} ms; median of {args.repeats} '
    'interleaved repeats'
  )
  rows = []
  for case, pairs in CASES.items():
    for i, (sender, receiver) in enumerate(pairs):
      median = statistics.median(repeat[i] for repeat in times[case])
      rows.append((case, f'{sender} -> {receiver}', 1e3 * median, 1e3 * price))
  bench_common.print_table(('case', 'copy', 'ms', 'priced ms'), rows)
  for case in ('shared', 'relay'):
    extra = [
      statistics.mean(s - d for s, d in zip(both, disjoint))
      for both, disjoint in zip(times[case], times['disjoint'])
    ]
    print(
      f'{case}: a copy while a lane process of it moves another the other way, over two '
      f'copies between four lanes: {1e3 * statistics.median(extra):+.2f} ms (the model: +0)'
    )


if __name__ == '__main__':
  main()
