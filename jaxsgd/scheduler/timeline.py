"""What ran where and when: task records, utilization, a Chrome/Perfetto trace.

Both clocks produce a `Timeline`: one `TaskRecord` per task (simulated or
measured seconds from the start of the run). `write_chrome_trace` writes the
Trace Event Format that https://ui.perfetto.dev and chrome://tracing open: one
row (tid) per lane, one complete ('X') slice per task, named `<kind> b<batch>`.
"""

import dataclasses
import json
from collections.abc import Sequence
from typing import NamedTuple


class TaskRecord(NamedTuple):
  """One task: its lane, kind, start and end (seconds), stage and batch; for a compute task
  of the process executor, or of the virtual clock with a simulated driver (`cost.host`),
  when the driver heard of its end (`heard`) and when it sent it (`dispatched`, never for
  a copy); else None. `start - dispatched` is the task's way to its lane and its wait
  there, `heard - end` the way back. `cpu`: the CPU seconds the lane's process used
  during a task of the process executor, less what its copy threads used meanwhile
  (`lanes.runtime.CopyCpu`), else None: `end - start` less it is the time its cores ran
  something else (its own copies too) or the process waited (an emulated task sleeps).
  A checkpoint keeps none of the three (`records_as_arrays`).

  A named tuple rather than a frozen dataclass: an executor makes one per task, and a
  tuple is built in a tenth of the time (~0.3 µs against ~3 µs here).
  """

  lane: int
  kind: str
  start: float  # seconds
  end: float
  stage: int | None = None
  batch: int | None = None
  heard: float | None = None  # seconds, on the run's clock
  dispatched: float | None = None  # seconds, on the run's clock
  cpu: float | None = None  # seconds of the lane process's CPU from start to end

  @property
  def duration(self) -> float:
    return self.end - self.start

  @property
  def label(self) -> str:
    return self.kind if self.batch is None else f'{self.kind} b{self.batch}'


@dataclasses.dataclass
class Timeline:
  """The tasks of one run, with the names of the lanes they ran on."""

  lane_names: Sequence[str]
  records: list[TaskRecord]
  clock: str  # 'real' or 'virtual'

  @property
  def makespan(self) -> float:
    return max((r.end for r in self.records), default=0.0)

  def tasks(self, lane: int | None = None, kind: str | None = None) -> list[TaskRecord]:
    """Records on `lane` and/or of `kind`, in start order."""
    found = [
      r
      for r in self.records
      if (lane is None or r.lane == lane) and (kind is None or r.kind == kind)
    ]
    return sorted(found, key=lambda r: (r.start, r.end))

  def busy(self, lane: int) -> float:
    return sum(r.duration for r in self.records if r.lane == lane)

  def utilization(self) -> dict[str, float]:
    """Busy time / makespan of every lane that ran a task."""
    span = self.makespan or 1.0
    used = sorted({r.lane for r in self.records})
    return {self.lane_names[lane]: self.busy(lane) / span for lane in used}

  def chrome_trace(self) -> dict:
    events = [
      {
        'name': 'process_name',
        'ph': 'M',
        'pid': 0,
        'args': {'name': f'jaxsgd ({self.clock} clock)'},
      }
    ]
    for lane in sorted({r.lane for r in self.records}):
      events.append(
        {
          'name': 'thread_name',
          'ph': 'M',
          'pid': 0,
          'tid': lane,
          'args': {'name': self.lane_names[lane]},
        }
      )
      events.append(
        {
          'name': 'thread_sort_index',
          'ph': 'M',
          'pid': 0,
          'tid': lane,
          'args': {'sort_index': lane},
        }
      )
    for r in self.records:
      events.append(
        {
          'name': r.label,
          'cat': r.kind,
          'ph': 'X',
          'pid': 0,
          'tid': r.lane,
          'ts': r.start * 1e6,
          'dur': r.duration * 1e6,
          'args': _args(r),
        }
      )
    return {'traceEvents': events, 'displayTimeUnit': 'ms'}

  def write_chrome_trace(self, path: str) -> None:
    with open(path, 'w') as f:
      json.dump(self.chrome_trace(), f)

  @classmethod
  def from_chrome_trace(cls, trace: dict) -> 'Timeline':
    """The timeline that `chrome_trace` made `trace` of, its times in seconds again (to
    measure a saved run anew); its records in the trace's order."""
    events = trace['traceEvents']
    names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
    (title,) = [e['args']['name'] for e in events if e.get('name') == 'process_name']
    records = [_record(e) for e in events if e.get('ph') == 'X']
    lane_names = [names.get(lane, f'lane {lane}') for lane in range(1 + max(names, default=-1))]
    return cls(lane_names, records, title.split('(')[-1].split()[0])


_TIMES = ('heard', 'dispatched', 'cpu')  # a record's times that may be None


def _record(event: dict) -> TaskRecord:
  """The record of a trace's slice (`chrome_trace`), in seconds."""
  args = event['args']
  start, end = event['ts'] / 1e6, (event['ts'] + event['dur']) / 1e6
  times = {name: args[name] / 1e6 for name in _TIMES if name in args}
  return TaskRecord(
    event['tid'], event['cat'], start, end, args.get('stage'), args.get('batch'), **times
  )


def _args(record: TaskRecord) -> dict:
  """A trace slice's arguments: stage and batch, and the driver's times and the lane's
  CPU time (µs) where known."""
  args = {'stage': record.stage, 'batch': record.batch}
  for name in _TIMES:
    if getattr(record, name) is not None:
      args[name] = getattr(record, name) * 1e6
  return args
