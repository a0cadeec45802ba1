r"""What a copy costs the lane it goes to: a task computing there while a copy arrives.

    python -m benchmarks.copy_receiver               # ~1 min on a 2-core CPU
    python -m benchmarks.copy_receiver --moves=socket

A lane process reads every message another lane sends it as it arrives, in a reader
thread of its own (`LaneRuntime._read_lane`), on the cores the lane is pinned to. Over a
socket (`--moves=socket`) a copy is a memory copy at both ends, and on a core where the
receiving lane computes, the reading takes its share of the core; within a host the
host path (`--moves=host`, the default) writes the bytes once into memory both lanes
share and the reader reads only the message naming them. The virtual clock, simulating
the process executor (`cost.host`, whose `moves` says which) with lanes placed on cores,
charges a copy's export on the sender's core and, over a socket, its link time on the
receiver's (`scheduler/shared_cores.py`): a task running alone on the receiver's core
while a copy arrives there is predicted to take that much longer.

Three lanes: `target` on core 1, and a source on core 0 (`other`) and one on core 1
(`same`, sharing the target's core). The link and export times of each size are the host
profile's lines (`link_timing.measure_process_links` on the same path, measured first, on
lanes of their own: latency + bytes / bandwidth). Then, interleaved, `--repeats` times
for each size and source: the target runs a task of ~45 ms (`heavy`, matrix products on
a 512 x 512 matrix) alone, and again while the source sends it a new value of that size
(asked for a few ms after the task's start, taken in by the target's next call). The
extra time of the task in the target's own timing, median over the repeats, against the
link time; the model's, in link times: from the other core 1 over a socket (the reading)
and 0 in shared memory, from the same core that plus the export over the link time (the
sending).
Not a test: speed is measured, not asserted. Results: benchmarks/results/copy_receiver.txt.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsgd.scheduler import link_timing
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe

SIZES_MB = (4, 16, 64)
SOURCES = {'other': 'another core', 'same': 'the same core'}  # the sending lane's place
START_AFTER = 0.003  # s into the target's task when the copy is asked for


def build_tasks():
  """`heavy(x)`: 40 products of a 512 x 512 matrix taken from `x` (CPU-bound, ~45 ms on
  one core); `make(x, seed)`: a new array of x's size; `first(v)`: v's first element."""

  def heavy(x):
    w = x[: 512 * 512].reshape(512, 512) * 1e-3
    return jax.lax.fori_loop(0, 40, lambda _, h: jnp.tanh(h @ w), w)[0, 0]

  return {
    'heavy': jax.jit(heavy),
    'make': jax.jit(lambda x, seed: jnp.full_like(x, seed)),
    'first': jax.jit(lambda v: v[0]),
  }


def _task_time(pool: LanePool, tasks: dict, x, copy=None, source: str = 'other') -> float:
  """Seconds of `heavy` on the target, in the target's timing; with `copy` (a
  value on `source`), a value of its size made anew there and sent to the target meanwhile."""
  if copy is None:
    pending = pool.start('target', tasks['heavy'], (x,))
    pool.wait_all([pending])
    return pending.ended - pending.started
  fresh = pool.start(source, tasks['make'], (copy, time.time() % 1))
  pool.wait_all([fresh])
  pending = pool.start('target', tasks['heavy'], (x,))
  time.sleep(START_AFTER)
  reader = pool.start('target', tasks['first'], (fresh.result(),))
  pool.wait_all([pending, reader])
  pool.settle()
  return pending.ended - pending.started


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=11)
  parser.add_argument('--moves', default='host', choices=('host', 'socket'), help='the path')
  args = parser.parse_args()
  if args.repeats < 1:
    parser.error(f'--repeats: at least 1; got {args.repeats}')
  from benchmarks import copy_receiver as this

  measured = link_timing.measure_process_links(moves=args.moves)
  (latency, bandwidth, _), (export_latency, export_bandwidth, _) = measured.link, measured.export
  reading = 0.0 if measured.shared else 1.0  # the receiver's part, in link times
  recipe = TaskRecipe.of(this.build_tasks)
  tasks = {name: Task(recipe, name) for name in ('heavy', 'make', 'first')}
  placement = LanePlacement.parse(
    '; '.join(
      f'{lane}@moves={args.moves}' for lane in ('other@cores=0', 'same@cores=1', 'target@cores=1')
    )
  )
  cases = [(mb, source) for source in SOURCES for mb in SIZES_MB]
  with LanePool(placement, verbose=False) as pool:
    x = pool.put('target', np.ones(1 << 20, np.float32))
    values = {
      (mb, source): pool.put(source, np.zeros(mb << 18, np.float32)) for mb, source in cases
    }
    for mb, source in cases:  # compiled everywhere, each copy's path warm
      _task_time(pool, tasks, x, values[mb, source], source)
    alone = {case: [] for case in cases}
    receiving = {case: [] for case in cases}
    for _ in range(args.repeats):
      for mb, source in cases:
        alone[mb, source].append(_task_time(pool, tasks, x))
        receiving[mb, source].append(_task_time(pool, tasks, x, values[mb, source], source))
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; jax '
    f'{jax.__version__}; moves={args.moves}; the link: {1e6 * latency:.0f} µs + bytes / '
    f'{bandwidth / 1e9:.2f} GB/s, the export {1e6 * export_latency:.0f} µs + bytes / '
    f'{export_bandwidth / 1e9:.2f} GB/s; median of {args.repeats} interleaved repeats'
  )
  print(
    f'{"copy":>6}  {"from":>14}  {"link ms":>8}  {"task alone ms":>13}  {"receiving ms":>12}  '
    f'{"extra ms":>8}  {"extra / link":>12}  {"model":>5}'
  )
  ratios, models = {source: [] for source in SOURCES}, {source: [] for source in SOURCES}
  for mb, source in cases:
    link = latency + (mb << 20) / bandwidth
    export = export_latency + (mb << 20) / export_bandwidth
    models[source].append(reading + (export / link if source == 'same' else 0.0))
    task, slowed = statistics.median(alone[mb, source]), statistics.median(receiving[mb, source])
    ratios[source].append((slowed - task) / link)
    print(
      f'{mb:>4}MB  {SOURCES[source]:>14}  {1e3 * link:8.2f}  {1e3 * task:13.2f}  '
      f'{1e3 * slowed:12.2f}  {1e3 * (slowed - task):8.2f}  {ratios[source][-1]:12.2f}  '
      f'{models[source][-1]:5.2f}'
    )
  print(
    "a copy from a lane of the receiver's own core, its time there over its link time: "
    f'{statistics.median(ratios["same"]):.2f} (the model: {statistics.median(models["same"]):.2f})'
  )
  print(
    f"a copy's time on its receiver's core, over its link time: "
    f'{statistics.median(ratios["other"]):.2f} (the model: {statistics.median(models["other"]):.2f})'
  )


if __name__ == '__main__':
  main()
