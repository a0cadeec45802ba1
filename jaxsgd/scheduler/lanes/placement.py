"""Where each lane process runs: host, CPU cores, GPU — one setting, printed at start.

    placement = LanePlacement.parse('stage0@cores=0; stage1@cores=1')
    placement = LanePlacement.spread(['server', 'worker0', 'worker1'])  # cores round-robin
    print(placement.describe())

A lane is a name (a pipeline stage's device, an asynchronous worker, the parameter
server...). `host` is the IP address of a Ray node (None: the driver's node). `cores` pins
the lane process and XLA's intra-op threads to those cores of its host (None: not pinned).
`copies` puts the lane's copy threads — the readers of its connections and its export
thread: the values it takes in and sends — on other cores of its host than its tasks (None:
its own cores, with everything else of the process): a lane that is a pipeline's bottleneck
can leave those copies to a core whose lane waits. `gpu=1` gives the lane one GPU of its
host to itself: Ray assigns it and sets `CUDA_VISIBLE_DEVICES`, so there is one process per
GPU, and JAX picks its backend (`JAX_PLATFORMS` empty: a driver run with
`JAX_PLATFORMS=cpu`, as it should be on a host whose GPUs its lanes use, does not pass that
on); the other lanes run JAX's CPU backend (`JAX_PLATFORMS=cpu`). A fraction, `gpu=0.5`, is
a share of one GPU (Ray's fractional GPUs): lanes whose shares add up to 1 run on the same
GPU, each process taking that share of JAX's memory pool (`XLA_PYTHON_CLIENT_MEM_FRACTION`)
instead of JAX's default 75 % of the GPU's memory, which the second process could not get.

`moves` is the path a lane's values take to and from other lanes (device_path.py):
`device` — as device buffers through JAX's transfer servers, between two lanes that both
have it on; `host` — as numpy arrays, written once into memory shared with a lane (or the
driver) of the same host, over the socket to another host; `socket` — the host path over
the socket within a host too (copied into the kernel and out: the way to compare);
`auto` (the default) — the device path on a GPU lane, the host path on a CPU lane.

The text form, one lane per `;`: `name[@key=value[,value...][@...]]` with keys
`host`, `cores` and `copies` (`0,1` or `0-3`), `gpu` (`1`, `0` or a share such as `0.5`)
and `moves` (`auto`, `device`, `host` or `socket`), e.g.
`server@host=10.0.0.1@cores=0; worker0@host=10.0.0.2@gpu=1; stage1@cores=1@copies=0`.
"""

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence

from jaxsgd.scheduler.lanes.device_path import MOVES

# The lane process's variable naming its copy threads' cores (`LaneSpec.copy_cores`).
COPY_CORES_VARIABLE = 'JAXSGD_LANE_COPY_CORES'


@dataclasses.dataclass(frozen=True)
class LaneSpec:
  """One lane: its name and where its process runs."""

  name: str
  host: str | None = None
  cores: tuple[int, ...] | None = None
  gpu: float = 0.0  # 1: a GPU to itself; 0 < share < 1: that share of one; 0: none
  moves: str = 'auto'  # the path of its values to other lanes: auto, device, host, socket
  copy_cores: tuple[int, ...] | None = None  # its copy threads' cores; None: `cores`

  def __post_init__(self):
    if not self.name or any(c in self.name for c in ';@= '):
      raise ValueError(
        f'placement: lane name {self.name!r}: a non-empty name without '
        "';', '@', '=' or spaces expected."
      )
    for field, given in (('cores', self.cores), ('copy_cores', self.copy_cores)):
      if given is None:
        continue
      cores = tuple(given)
      if not cores or any(not isinstance(c, int) or c < 0 for c in cores):
        raise ValueError(
          f'placement: lane {self.name!r}: {field} must be a non-empty list '
          f'of core numbers >= 0, got {given!r}.'
        )
      object.__setattr__(self, field, cores)
    if isinstance(self.gpu, str) or not 0 <= self.gpu <= 1:
      raise ValueError(
        f'placement: lane {self.name!r}: gpu must be 0, 1 or a share of one GPU between '
        f'them, got {self.gpu!r}.'
      )
    object.__setattr__(self, 'gpu', float(self.gpu))
    if self.moves not in MOVES:
      raise ValueError(
        f'placement: lane {self.name!r}: moves must be one of {", ".join(MOVES)}, '
        f'got {self.moves!r}.'
      )

  def describe_copies(self) -> str:
    """' copies=0,2' where the copy threads are placed apart, else ''."""
    return '' if self.copy_cores is None else f' copies={",".join(map(str, self.copy_cores))}'

  def environment(self) -> dict[str, str]:
    """Variables the lane process needs before JAX starts.

    A lane without a GPU uses JAX's CPU backend only (it must not take a share of the
    host's GPUs: each GPU belongs to one lane process). A GPU lane lets JAX choose (empty
    is JAX's default: every platform it finds, the GPU first), whatever the driver's
    `JAX_PLATFORMS`: lane processes inherit the driver's environment otherwise. A pinned
    lane's intra-op threads are limited to its cores. A lane with a share of a GPU takes
    that share of the three quarters of its memory JAX would take alone. Its copy threads'
    cores, if placed apart, are `COPY_CORES_VARIABLE` (`runtime.LaneRuntime` reads it).
    """
    variables = {'JAX_PLATFORMS': '' if self.gpu else 'cpu'}
    if 0 < self.gpu < 1:
      variables['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{0.75 * self.gpu:.3f}'
    if self.copy_cores is not None:
      variables[COPY_CORES_VARIABLE] = ','.join(map(str, self.copy_cores))
    if self.cores is None:
      return variables
    threads = str(len(self.cores))
    return {
      **variables,
      'OMP_NUM_THREADS': threads,
      'MKL_NUM_THREADS': threads,
      'OPENBLAS_NUM_THREADS': threads,
      # One core: no Eigen thread pool, XLA's intra-op work runs on the caller.
      'XLA_FLAGS': ('--xla_cpu_multi_thread_eigen=false' if len(self.cores) == 1 else ''),
    }


@dataclasses.dataclass(frozen=True)
class LanePlacement:
  """The lanes of a run, in order; names are unique."""

  lanes: tuple[LaneSpec, ...]

  def __post_init__(self):
    names = [lane.name for lane in self.lanes]
    if not names:
      raise ValueError('placement: at least one lane expected.')
    if len(set(names)) != len(names):
      raise ValueError(f'placement: lane names must be unique, got {names}.')

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(lane.name for lane in self.lanes)

  def check_run(
    self, lanes: Sequence[str], *, every_lane: bool, others_allowed: bool = False
  ) -> None:
    """Refuses this placement for a run whose lanes (placement names) are `lanes`, in one
    line naming `placement.lanes`: a placed name that is none of them (unless
    `others_allowed`: a pool shared by several runs), and with `every_lane` (lane
    processes: the placement starts each one) a lane it leaves out."""
    unknown = [name for name in self.names if name not in lanes]
    if unknown and not others_allowed:
      raise ValueError(
        f'placement.lanes: no lane of this run is named {", ".join(map(repr, unknown))}; '
        f'its lanes: {", ".join(lanes)}.'
      )
    missing = [name for name in lanes if name not in self.names]
    if missing and every_lane:
      raise ValueError(
        f'placement.lanes: no lane for {", ".join(missing)}; this run needs lanes named '
        f'{", ".join(lanes)}.'
      )

  def __getitem__(self, name: str) -> LaneSpec:
    for lane in self.lanes:
      if lane.name == name:
        return lane
    raise KeyError(f'placement: no lane {name!r}; lanes: {list(self.names)}.')

  @classmethod
  def spread(
    cls,
    names: Iterable[str],
    cores: Sequence[int] | None = None,
    cores_per_lane: int = 1,
    host: str | None = None,
  ) -> 'LanePlacement':
    """Lanes on one host, `cores_per_lane` cores each, round-robin over `cores`.

    `cores` defaults to the cores this process may run on. With more lanes than
    cores, lanes share cores (they are still separate processes).
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if cores_per_lane < 1 or cores_per_lane > len(cores):
      raise ValueError(
        f'placement: cores_per_lane must be in 1..{len(cores)}, got {cores_per_lane}.'
      )
    lanes = []
    for i, name in enumerate(names):
      start = (i * cores_per_lane) % len(cores)
      mine = tuple(cores[(start + j) % len(cores)] for j in range(cores_per_lane))
      lanes.append(LaneSpec(name, host=host, cores=mine))
    return cls(tuple(lanes))

  @classmethod
  def parse(cls, text: str) -> 'LanePlacement':
    """The text form (module docstring); refuses bad input with one line naming it."""
    return cls(tuple(_parse_lane(part.strip()) for part in text.split(';') if part.strip()))

  def describe(self) -> str:
    """One line per lane, as printed at start."""
    rows = []
    for lane in self.lanes:
      cores = 'any' if lane.cores is None else ','.join(map(str, lane.cores))
      moves = '' if lane.moves == 'auto' else f' moves={lane.moves}'
      copies = lane.describe_copies()
      rows.append(
        f'  {lane.name}: host={lane.host or "driver"} cores={cores}{copies} '
        f'gpu={_describe_gpu(lane.gpu)}{moves}'
      )
    return 'placement:\n' + '\n'.join(rows)


def copies_toward_idle(
  loads: Mapping[str, tuple[float, float]], cores: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
  """Where to run lanes' copy threads so that the busiest cores shed them: `{lane: cores}`
  for the lanes whose copies should leave their own cores (the rest keep them).

  `loads[lane]`: (its tasks' CPU, its copy threads' CPU), measured over the same span (a
  round of a run, per iteration); `cores[lane]`: its cores. Lanes on the same cores form
  a group, its load the sum of theirs, compared per core (a group on two cores at 120 %
  of one core is busy 60 % of each). Groups are taken busiest first; each, of load B on
  n cores, gives its lanes' copies, c, to the least busy group, of load L on m cores, if
  (L + c) / m <= (B - c) / n: its load falls by c and the taker's stays no more than
  its own. A move that would make the taker the busier of the two is not made: the two
  would gain less than c, and copies onto a core that then computes nearly all the time
  wait there for it, on the path of whatever waits for them. A group that takes copies
  keeps its own; one that gives takes none. E.g. PD-ASGD 1:1 on two cores: the backward
  worker's core 110.8 + 4.4 ms an iteration (tasks + copies), the forward worker's and
  the shared model's (61.0 + 9.1) + (3.9 + 5.8) = 79.8: 79.8 + 4.4 <= 110.8, the
  backward worker's copies go.
  """
  groups: dict[tuple[int, ...], list[str]] = {}
  for lane in loads:
    if cores.get(lane) is not None:
      groups.setdefault(tuple(cores[lane]), []).append(lane)
  load = {group: sum(sum(loads[lane]) for lane in lanes) for group, lanes in groups.items()}
  copies = {group: sum(loads[lane][1] for lane in lanes) for group, lanes in groups.items()}

  def per_core(group, more=0.0):
    return (load[group] + more) / len(group)

  moved, gave, took = {}, set(), set()
  for group in sorted(groups, key=lambda g: (-per_core(g), g)):
    others = [g for g in groups if g != group and g not in gave]
    if group in took or not others:
      continue
    target = min(others, key=lambda g: (per_core(g), g))
    if per_core(target, copies[group]) <= per_core(group, -copies[group]):
      load[target] += copies[group]
      load[group] -= copies[group]
      gave.add(group)
      took.add(target)
      moved.update({lane: target for lane in groups[group]})
  return moved


def driver_toward_idle(
  loads: Mapping[str, tuple[float, float]],
  cores: Mapping[str, tuple[int, ...] | None],
  moved: Mapping[str, tuple[int, ...]],
  driver: float,
  allowed: Iterable[int],
) -> tuple[int, ...] | None:
  """The cores to pin the driver's threads to, so that the busiest cores shed their share
  of its CPU; None: left where the OS runs them.

  `loads`, `cores`: as `copies_toward_idle`'s, for the lanes of the driver's host, and
  `moved` where their copies went (its result); `driver`: the driver process's CPU over
  the same span (every thread of it: the dispatch, hearing the lanes, the policy, its
  connections' readers and writer); `allowed`: the cores the driver may run on. Lanes on
  the same cores form a group, whose load is their tasks' and the copies it kept or took;
  the cores of `allowed` that none of these lanes computes on form one more, of load 0
  (another process's cores, or an idle lane's of a pool this run does not use, count as
  free: the run cannot see them). The driver
  goes to the least busy group that shares no core with the busiest, of load L on m
  cores, if (L + d) / m <= B / n for the busiest, of load B on n cores (and d > 0): the
  busiest no longer runs part of it, and the taker
  stays no busier than the busiest is without it. Left to the OS, the driver's threads
  wake on whichever core is free at that moment, the bottleneck's too. Nothing is pinned
  where a lane of the host is not pinned itself (no core is known to be free of it). E.g.
  on two cores, the driver at 6 % of a core: PD-ASGD 1:1's backward worker's core 88 %
  busy after its copies went, the other's 55 + 5 (the forward worker and the shared
  model, and those copies): 60 + 6 <= 88, the driver goes there; DDG K=2's stages at 91
  % and 93 %: 91 + 6 > 93, it stays unpinned; staged BP on one core, the other free: 0 +
  6 <= 97, it goes to the free core.
  """
  if any(cores.get(lane) is None for lane in loads):
    return None
  load: dict[tuple[int, ...], float] = {}
  for lane, (tasks, copies) in loads.items():
    group = tuple(cores[lane])
    load[group] = load.get(group, 0.0) + tasks + (0.0 if lane in moved else copies)
    if lane in moved:
      taker = tuple(moved[lane])
      load[taker] = load.get(taker, 0.0) + copies
  allowed = set(allowed)
  spare = tuple(sorted(allowed - {core for group in load for core in group}))
  if spare:
    load[spare] = 0.0
  if not load:
    return None

  def per_core(group, more=0.0):
    return (load[group] + more) / len(group)

  busiest = max(load, key=lambda g: (per_core(g), g))
  takers = [g for g in load if not set(g) & set(busiest) and set(g) <= allowed]
  if driver <= 0 or not takers:  # (nothing to shed; pinned on a core of the busiest)
    return None
  target = min(takers, key=lambda g: (per_core(g), g))
  return target if per_core(target, driver) <= per_core(busiest) else None


def describe_copy_loads(
  loads: Mapping[str, tuple[float, float]],
  cores: Mapping[str, tuple[int, ...] | None],
  moved: Mapping[str, tuple[int, ...]],
  unit: tuple[float, int, str],
) -> str:
  """'stage0 on 0: 80.1 + 4.0 ms, stage1 on 1: ...; copies of stage1 to 0': each lane's
  tasks + copies (`copies_toward_idle`'s `loads`, times `unit`'s scale, with its digits
  and name: `(1e3, 1, 'ms')`) and what moved."""
  scale, digits, name = unit
  each = ', '.join(
    f'{lane} on {"unpinned" if cores[lane] is None else ",".join(map(str, cores[lane]))}: '
    f'{scale * loads[lane][0]:.{digits}f} + {scale * loads[lane][1]:.{digits}f} {name}'
    for lane in sorted(loads)
  )
  where = '; '.join(f'copies of {lane} to {",".join(map(str, c))}' for lane, c in moved.items())
  return f'{each}; {where or "each lane keeps its copies"}'


def describe_driver_load(
  driver: float, pinned: tuple[int, ...] | None, unit: tuple[float, int, str]
) -> str:
  """'the driver 4 %, pinned to 0' (`driver_toward_idle`'s `driver`, times `unit`'s scale,
  with its digits and name, and where it went)."""
  scale, digits, name = unit
  where = 'unpinned' if pinned is None else f'pinned to {",".join(map(str, pinned))}'
  return f'the driver {scale * driver:.{digits}f} {name}, {where}'


def _parse_lane(text: str) -> LaneSpec:
  name, *fields = text.split('@')
  settings = {}
  for field in fields:
    key, sep, value = field.partition('=')
    if not sep or key not in ('host', 'cores', 'copies', 'gpu', 'moves'):
      raise ValueError(
        f'placement: lane {name!r}: {field!r} is not host=..., cores=..., copies=..., '
        'gpu=... or moves=...'
      )
    settings[key] = value.strip()
  cores, copies = (settings.get(key) for key in ('cores', 'copies'))
  cores = None if cores is None else _parse_cores(name, cores)
  copies = None if copies is None else _parse_cores(name, copies, 'copies')
  gpu = settings.get('gpu', '0')
  try:
    share = float(gpu)
  except ValueError:
    share = -1.0  # refused below, with the text given
  if not 0 <= share <= 1:
    raise ValueError(
      f'placement: lane {name!r}: gpu must be 0, 1 or a share of one GPU between them '
      f'(0.5), got {gpu!r}.'
    )
  moves = settings.get('moves', 'auto')
  return LaneSpec(name.strip(), settings.get('host') or None, cores, share, moves, copies)


def _describe_gpu(share: float) -> str:
  return 'yes' if share == 1 else 'no' if share == 0 else f'{share:g} of one'


def _parse_cores(name: str, text: str, key: str = 'cores') -> tuple[int, ...]:
  cores = []
  try:
    for part in text.split(','):
      low, _, high = part.partition('-')
      cores.extend(range(int(low), int(high or low) + 1))
  except ValueError:
    raise ValueError(
      f"placement: lane {name!r}: {key} like '0,1' or '0-3' expected, got {text!r}."
    ) from None
  return tuple(cores)
