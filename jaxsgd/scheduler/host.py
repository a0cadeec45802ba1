"""An executor's host, simulated from one measured host profile (`cost.host`).

A device computes a task; the executor's host decides when the device gets it and hears
when it ended. A *host profile* is what one executor's host adds to the devices' time,
measured on the machine it describes by

    python -m experiments.profile --host=processes --out=host.json    # or in_process, threads

and read by `cost.host=host.json`. Without one (the default) the virtual clock prices the
devices' time alone, as on hardware whose host keeps every device fed: a process goes on
when its task ends, and lanes on one device take it first in, first out.

File format (JSON, `FORMAT`; seconds and bytes/s):

    {"format": "jaxsgd-host-profile/1", "executor": "processes", "cores": 2,
     "platform": "cpu", "jax_version": "0.10.2", "date": "...",
     "dispatch": 5e-4, "dispatch_loaded": 7.5e-4,
     "driver": 3e-5, "driver_latency": 3.8e-4,
     "driver_loaded": 4e-5, "driver_latency_loaded": 1.2e-3, "upkeep": 0.03,
     "link_latency": 1.5e-3, "link_bandwidth": 1.0e9, "link_per_array": 3e-5,
     "take_in_latency": 5e-4, "take_in_bandwidth": 1.1e10, "take_in_per_array": 7e-5,
     "export_latency": 4e-4, "export_bandwidth": 3e9, "export_per_array": 1e-5,
     "moves": "host"}

What each figure is, and how the virtual clock uses it (`SimulatedHost`):

  dispatch        host seconds per task that its lane waits for, added to every task:
                  for 'in_process' and 'threads' the real clock's bookkeeping per task,
                  for 'processes' a lane process's time between two queued calls after
                  tasks of a run's length (`lane_timing.measure_call_gap`).
  driver          'processes': the driver thread's CPU seconds per event (a task or a
                  copy dispatched, a task's end heard), simulated as one FIFO resource;
  driver_latency  and each message's way between the driver and a lane.
  link_*          'processes': a move of a new value between two lane processes
                  (`link_timing.measure_process_links`), from the end of the task
                  that made the value on the sending lane to its copy arriving (as a
                  run pays it: the copy asked for before): latency and bandwidth of a
                  one-array message, and the time each further array of a message
                  adds (a lane process exports a message array by array); the run's
                  links unless `cost.link_latency` / `cost.link_bandwidth` describe
                  others.
  export_*        'processes': the same three figures of the part of a link the sending
                  lane's export thread spends, from the value existing to the copy's
                  last frame written (`LaneRuntime.export_times`): the time a copy
                  holds its sender's copies and take-ins (one interpreter); the rest of
                  the link (the socket, the receiver's reading) holds neither.
  take_in_*       'processes': the same three figures of the receiving lane taking the
                  copy in (array by array), which it does at the first call that reads
                  it, before that call's task and after the calls before it, however
                  early the copy arrived: time on the receiving lane, on any link, and
                  in its interpreter, which its exports share (one at a time).
  moves           'processes': the path the lanes' values took when the links were
                  measured (`LaneSpec.moves`): `host`, within a host through memory the
                  two lane processes share (the receiver reads none of a copy's bytes);
                  `socket`, over a socket (the receiving lane's reader copies them out, on
                  its cores, for the copy's time). A profile without it was measured
                  before the host path shared memory: `socket`.
  *_loaded        the same figures measured with a busy lane on every core; they apply
                  where the run's compute lanes take every core of the host (as many
                  lanes as `cores`), so the driver and Ray run only when they preempt one.
  upkeep          'processes': cores of CPU that the executor's own processes take while
                  no task runs (Ray's daemons, the idle lanes' and the driver's threads;
                  a lane on every core, `lane_timing.measure_upkeep`). Where the
                  lanes take every core it comes out of theirs: while each core that
                  placed lanes time-slice runs a task, each gives them 1 - upkeep /
                  cores of itself; while one has none, it runs there (`shared_cores`).

The process executor's schedule follows from what it is, not from settings: a process
goes on at its task's dispatch while its lane has at most the executor's bound of
unfinished tasks (`executor.RUN_AHEAD`; a parameter server's workers 1), a lane process
makes its own copies (in an export thread, one at a time, on the cores it is placed on,
taking turns with its take-ins in one interpreter) — the receiving lane reading each on
its own cores (a reader thread, for the same time: `shared_cores`) where the values cross
a socket (`moves`) —, and lanes that
`placement.lanes` puts on the same cores share them as an operating system shares a core
between processes (time slices). `docs/simulator.md` says how well this predicts runs.
"""

import dataclasses
import datetime
import functools
import json
import math
import os

import jax

FORMAT = 'jaxsgd-host-profile/1'
EXECUTORS = ('in_process', 'threads', 'processes')
# The figures each executor's profile must hold (>= 0 seconds, or bytes/s > 0).
FIGURES = {
  'in_process': ('dispatch',),
  'threads': ('dispatch',),
  'processes': (
    'dispatch',
    'dispatch_loaded',
    'driver',
    'driver_latency',
    'driver_loaded',
    'driver_latency_loaded',
    'upkeep',
    'link_latency',
    'link_bandwidth',
    'link_per_array',
    'take_in_latency',
    'take_in_bandwidth',
    'take_in_per_array',
    'export_latency',
    'export_bandwidth',
    'export_per_array',
  ),
}
# A move's figures, each of its parts: `link_*`, `take_in_*`, `export_*` (`link_timing.Moves`).
MOVE_FIGURES = ('latency', 'bandwidth', 'per_array')
_ABOUT = ('format', 'executor', 'cores', 'platform', 'jax_version', 'date', 'moves')
MOVES = ('host', 'socket')  # a process executor's profile's `moves`


class HostProfileError(ValueError):
  """A host profile that cannot be used, in one line naming the file and the field."""


@dataclasses.dataclass(frozen=True)
class HostProfile:
  """One executor's measured host figures on a machine of `cores` cores."""

  executor: str
  cores: int
  figures: tuple[tuple[str, float], ...]
  platform: str = 'cpu'
  jax_version: str = ''
  date: str = ''
  moves: str = 'socket'  # (the process executor) the path its links were measured on

  def figure(self, name: str) -> float:
    return dict(self.figures)[name]


@dataclasses.dataclass(frozen=True)
class SimulatedHost:
  """What the virtual clock simulates of a host, for a run of `compute_lanes` lanes.

  Attributes:
    run_ahead: a process goes on at its task's dispatch (the process executor), not at
      its end.
    dispatch: host seconds added to every task.
    driver, driver_latency: the process executor's driver (0: none).
    copies_on_sender: the sending lane's process makes its copies, one at a time, on
      the cores it is placed on.
    receiver_reads: the receiving lane's process reads a copy's bytes on its cores
      (values over a socket), else none of them (memory the two processes share).
    time_sliced: lanes placed on the same cores share them in time slices.
    core_share: the share of each such core its lanes get while all of them run a task
      (the rest is `upkeep`'s).
    link: `(latency, bandwidth, seconds per array beyond a message's first)` of the
      executor's moves between lanes, or None.
    take_in: the same three figures of a lane taking in a message sent to it, at the
      call that reads it, or None.
    export: the same three figures of the part of a move its sending lane's export
      thread spends (the time a copy holds the sender's copies and take-ins), or None.
  """

  run_ahead: bool = False
  dispatch: float = 0.0
  driver: float = 0.0
  driver_latency: float = 0.0
  copies_on_sender: bool = False
  receiver_reads: bool = True
  time_sliced: bool = False
  core_share: float = 1.0
  link: tuple[float, float, float] | None = None
  take_in: tuple[float, float, float] | None = None
  export: tuple[float, float, float] | None = None


def simulated(profile: HostProfile | None, compute_lanes: int) -> SimulatedHost:
  """What `profile` makes the virtual clock simulate for a run of `compute_lanes` lanes
  (module docstring); no profile: the devices' time alone."""
  if profile is None:
    return SimulatedHost()
  if profile.executor != 'processes':
    return SimulatedHost(dispatch=profile.figure('dispatch'))
  every_core = compute_lanes >= profile.cores
  loaded = '_loaded' if every_core else ''
  return SimulatedHost(
    run_ahead=True,
    dispatch=profile.figure('dispatch' + loaded),
    driver=profile.figure('driver' + loaded),
    driver_latency=profile.figure('driver_latency' + loaded),
    copies_on_sender=True,
    receiver_reads=profile.moves == 'socket',
    time_sliced=True,
    core_share=1 - profile.figure('upkeep') / profile.cores if every_core else 1.0,
    link=tuple(profile.figure(f'link_{f}') for f in MOVE_FIGURES),
    take_in=tuple(profile.figure(f'take_in_{f}') for f in MOVE_FIGURES),
    export=tuple(profile.figure(f'export_{f}') for f in MOVE_FIGURES),
  )


def make(
  executor: str, figures: dict, *, cores: int | None = None, moves: str = 'socket'
) -> HostProfile:
  """A host profile of `executor` measured on this machine now (checked as `load` does);
  `moves`: the path the process executor's links were measured on."""
  profile = HostProfile(
    executor=executor,
    cores=os.cpu_count() if cores is None else cores,
    figures=tuple(sorted((k, float(v)) for k, v in figures.items())),
    platform=jax.devices()[0].platform,
    jax_version=jax.__version__,
    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    moves=moves,
  )
  return from_json(to_json(profile), 'the measured figures')


def to_json(profile: HostProfile) -> dict:
  return {
    'format': FORMAT,
    'executor': profile.executor,
    'cores': profile.cores,
    'platform': profile.platform,
    'jax_version': profile.jax_version,
    'date': profile.date,
    **({'moves': profile.moves} if profile.executor == 'processes' else {}),
    **dict(profile.figures),
  }


def save(profile: HostProfile, path: str) -> None:
  with open(path, 'w') as f:
    json.dump(to_json(profile), f, indent=1)
    f.write('\n')


def load(path: str) -> HostProfile:
  """The host profile at `path`; a file that is missing or not one is refused in one line.
  Read once per version of the file (a run asks for it wherever it decides the schedule)."""
  try:
    version = os.stat(os.path.expanduser(path)).st_mtime_ns
  except OSError:
    version = None
  return _load(path, version)


@functools.lru_cache(maxsize=16)
def _load(path: str, version) -> HostProfile:
  del version  # the cache's key only
  where = f'cost.host: {path!r}'
  try:
    with open(os.path.expanduser(path)) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise HostProfileError(
      f'{where}: no such file; measure one with python -m experiments.profile '
      f'--host=processes (or in_process, threads) --out={path}.'
    ) from None
  except (OSError, ValueError) as e:
    raise HostProfileError(f'{where}: not a readable JSON file ({e}).') from None
  return from_json(data, where)


def from_json(data, where: str) -> HostProfile:
  """A `HostProfile` from its JSON form, every field checked (errors name `where`)."""
  if not isinstance(data, dict) or data.get('format') != FORMAT:
    raise HostProfileError(f'{where}: not a host profile (its "format" is not {FORMAT!r}).')
  executor = data.get('executor')
  if executor not in EXECUTORS:
    raise HostProfileError(f'{where}: executor {executor!r}; allowed: {", ".join(EXECUTORS)}.')
  cores = data.get('cores')
  if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
    raise HostProfileError(f'{where}: cores must be a positive integer, got {cores!r}.')
  unknown = sorted(set(data) - set(_ABOUT) - set(FIGURES[executor]))
  if unknown:
    raise HostProfileError(
      f'{where}: unknown field {unknown[0]!r} for executor {executor!r}; its figures: '
      f'{", ".join(FIGURES[executor])}.'
    )
  figures = {}
  for name in FIGURES[executor]:
    value = data.get(name)
    if value is None:
      raise HostProfileError(
        f'{where}: no {name} (written by an older jaxsgd?); measure the host again: '
        f'python -m experiments.profile --host={executor} --out=FILE.'
      )
    figures[name] = _checked(name, value, cores, where)
  moves = data.get('moves', 'socket')  # (measured before the host path shared memory)
  if moves not in MOVES:
    raise HostProfileError(f'{where}: moves must be one of {", ".join(MOVES)}, got {moves!r}.')
  return HostProfile(
    executor=executor,
    cores=cores,
    figures=tuple(sorted(figures.items())),
    platform=str(data.get('platform', '')),
    jax_version=str(data.get('jax_version', '')),
    date=str(data.get('date', '')),
    moves=moves,
  )


def _checked(name: str, value, cores: int, where: str) -> float:
  """Figure `name` of a host profile of `cores` cores as a float, or refused in one line:
  seconds >= 0, bytes/s > 0 (`*_bandwidth`), or cores in [0, cores) (`upkeep`)."""
  number = not isinstance(value, bool) and isinstance(value, (int, float))
  if name == 'upkeep':
    need, good = f'cores >= 0 and < {cores}', number and 0 <= value < cores
  elif name.endswith('_bandwidth'):
    need, good = 'bytes/s > 0 (inf: free)', number and value > 0
  else:
    need, good = 'seconds >= 0', number and 0 <= value < math.inf
  if not good:
    raise HostProfileError(f'{where}: {name} must be {need}, got {value!r}.')
  return float(value)
