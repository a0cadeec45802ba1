"""Measuring moves between lane processes: a link and the receiving lane's take-in.

A move of a new value from one lane process to another, as a run pays it
(`measure_process_links`): its link (`link_latency`, `link_bandwidth`, `link_per_array`
of a host profile, `jaxsgd.scheduler.host`), the part of it the sending lane's export
thread spends (`export_latency`, `export_bandwidth`, `export_per_array`) and the
receiving lane's taking it in at the call that reads it (`take_in_latency`,
`take_in_bandwidth`, `take_in_per_array`); written by `python -m experiments.profile --host=processes` beside `lane_timing`'s
dispatch and driver figures.

Reference: docs/simulator.md (the process executor's host: copies on the sender, taking
in); tests/scheduler/test_profiles.py, tests/lanes/test_lanes.py.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxsgd.scheduler.lane_timing import dispatch_tasks


class Moves(NamedTuple):
  """A move between two lane processes, each part `(latency s, bandwidth B/s, seconds
  per array beyond a message's first)`: `link`, from the end of the task that made the
  value on the sending lane to its copy arriving on the receiving one (the export, the
  socket); `export`, the part of the link the sending lane's export thread spends, from
  the value existing to the copy's last frame written (`LaneRuntime.export_times`: the
  rest is the socket's and the receiver's); and `take_in`, what the receiving lane then
  spends making the copy its own — paid in front of the first call there that reads
  it, one call after another, however early the copy arrived (`LaneRuntime.take_in`);
  `shared`, whether the copies came in memory the two lanes share (`wire.Arena`), not
  over the socket."""

  link: tuple[float, float, float]
  take_in: tuple[float, float, float]
  export: tuple[float, float, float]
  shared: bool = False


RUN_LENGTH_PAUSE = 0.02  # s the sending lane waits before the task that makes a move's value


def measure_process_links(
  *,
  cores: Sequence[int] = (0, 1),
  address: str | None = None,
  sizes: Sequence[int] = (1 << 16, 1 << 24),
  arrays: int = 64,
  many_bytes: int = 1 << 20,
  reps: int = 31,
  warmup: int = 3,
  moves: str = 'host',
  gpu: float = 0.0,
) -> Moves:
  """A move between two lane processes (`LanePool.move`, lane to lane), pinned to
  `cores[0]` and `cores[1]` (with `gpu`: each with that share of a GPU instead), its
  values on the path `moves` names (`LaneSpec.moves`), as its `link` and its `take_in`
  (`Moves`), each measured as a run pays it. For each message, `reps` times: the sending lane waits a run's task
  length (`RUN_LENGTH_PAUSE`, an emulated task), then a task makes the message anew;
  the copy and the receiving lane's call that reads it are asked for before either
  runs, as a process running ahead asks for them. Its link is the time from that task's
  end to the copy's arrival (`LanePool.exported`), its take-in the time from the
  arrival to the reading task's start, less a call's own time from its start to its
  task's on a value already there (the profile's `dispatch` holds that); the messages
  interleaved, the median of each.

  Each part's latency and bandwidth are the line through one-array messages of the two
  `sizes` (`link_line`); its time per array is what a message of `arrays` arrays of
  `many_bytes` bytes in all takes beyond one array of those bytes, per array after the
  first (a lane process exports and takes in a message array by array: a pushed
  gradient of a 16-layer MLP is 34 arrays). Against one array of the same bytes, not the
  line, whose bandwidth's error the difference would carry.

  Why a run's way: a lane that has just ended a task replies to the driver, then its
  export thread copies the result in the same interpreter, and a call waiting for a copy
  wakes when it comes: both took about twice a copy of a value long made, read by a call
  sent after it came (`benchmarks/results/schedule_error.md`). A new value every time, as
  every message of a run is one. Medians: the minimum of a difference is not the
  difference of the minima."""
  from jaxsgd.scheduler.lanes import LanePool  # Ray only when asked for
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  make = Task(TaskRecipe.of(dispatch_tasks), 'add_one')
  first = Task(TaskRecipe.of(dispatch_tasks), 'first')
  placement = lane_pair(('source', 'target'), cores, moves, gpu)
  # (bytes, arrays): the line's two sizes, then the many arrays and one of their bytes
  messages = [(size, 1) for size in sizes] + [(many_bytes, arrays), (many_bytes, 1)]
  with LanePool(placement, address=address, verbose=False) as pool:
    pause = pool.put('source', np.zeros((), np.float32))
    here = pool.put('target', np.zeros((), np.float32))
    # A list: one value of `count` arrays, as a task's gradient or parameters (a tuple's
    # items would each be a value of their own, with a handle each: `LanePool`).
    sources = [
      pool.put('source', [np.zeros(size // 4 // count, np.float32) for _ in range(count)])
      for size, count in messages
    ]

    def moved(source) -> tuple[float, float, float]:  # (link, take-in, export) of one
      calls = [pool.start('source', make, (pause,), seconds=RUN_LENGTH_PAUSE)]
      calls.append(pool.start('source', make, (source,)))
      value = pool.early(calls[-1])
      if value is None:  # (its outline not known yet: the first time, a warm-up)
        pool.wait_any(calls[-1:])
        value = calls[-1].result()
      exports = []
      calls.append(pool.start('target', first, (pool.move(value, 'target', exports=exports),)))
      pool.wait_all(calls)
      pool.settle()
      arrival = pool.exported(exports)[1]
      export = pool.export_times('source', exports)[exports[0]]
      alone = pool.start('target', first, (here,))
      pool.wait_any([alone])
      pool.held('target')  # the copies freed there now, not inside the next call
      own = alone.started - alone.entered
      return arrival - calls[1].ended, calls[2].started - arrival - own, export

    for _ in range(warmup):  # warm: compiled, the outlines known, the first copies taken in
      for source in sources:
        moved(source)
    # Interleaved: a slow spell of the machine slows every message, not one message's
    # (which tilts the line).
    times = [[moved(source) for source in sources] for _ in range(reps)]
    shared = pool.lane_info('target')['shared_in'] > 0
  link, take_in, export = [
    _fit(sizes, arrays, [float(np.median([rep[i][part] for rep in times])) for i in range(4)])
    for part in (0, 1, 2)
  ]
  return Moves(link, take_in, export, shared)


def lane_pair(names, cores, moves: str = 'host', gpu: float = 0.0):
  """Two lanes named `names`, pinned to `cores[0]` and `cores[1]` (with `gpu`: each with
  that share of a GPU instead), their moves on the path `moves` (`LaneSpec.moves`)."""
  from jaxsgd.scheduler.lanes import LanePlacement  # Ray only when asked for

  where = [f'@gpu={gpu}' if gpu else f'@cores={core}' for core in cores]
  return LanePlacement.parse('; '.join(f'{n}{w}@moves={moves}' for n, w in zip(names, where)))


def _fit(sizes: Sequence[int], arrays: int, seconds: Sequence[float]) -> tuple[float, float, float]:
  """`(latency, bandwidth, seconds per array)` of a move's median times: the two one-array
  messages of `sizes` (`link_line`), then `arrays` arrays of some bytes in all, beyond one
  array of those bytes (at least 0)."""
  *one_array, many, one_of_many = seconds
  latency, bandwidth = link_line(sizes, one_array)
  return latency, bandwidth, max(many - max(one_of_many, 0.0), 0.0) / (arrays - 1)


def link_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
  """`(latency s, bandwidth B/s)` of the line through two sizes' move times (a negative
  time counts as 0): bandwidth `(n2 - n1) / (t2 - t1)` (infinite if the larger size was
  not slower), latency `t1 - n1 / bandwidth` (at least 0)."""
  (n1, n2), (t1, t2) = sizes, [max(t, 0.0) for t in seconds]
  bandwidth = (n2 - n1) / (t2 - t1) if t2 > t1 else math.inf
  return max(t1 - n1 / bandwidth, 0.0), bandwidth
