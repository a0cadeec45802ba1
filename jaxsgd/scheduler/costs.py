"""How long tasks take on a simulated cluster: the virtual clock's cost model.

    duration(task on lane l) = base(stage, kind) / speed[l] · noise_l + dispatch
    duration(transfer of n bytes in a arrays) = link_latency + (a - 1) · link_per_array
                                                + n / link_bandwidth
    take_in(that message, on its receiving lane) = take_in latency + (a - 1) · per array
                                                    + n / take_in bandwidth
    export(that message, on its sending lane)    = the same with export's figures

`base` is given explicitly or measured by timing the real jitted functions once on this
machine (`task_timing.measure`: the median of their calls). `dispatch` is the host time
an executor spends per task on top of the JAX call that `base` already includes (0 by
default: the devices' time alone; a profile's measured figure when the simulation
predicts an executor, `cost.host`); it is host time, so neither the lane's speed nor the
noise scales it. `speed[l]` (default 1) makes some devices or workers faster or slower.
`noise_l = exp(σ z − σ²/2)`, `z ~ N(0, 1)` drawn from a generator seeded by `(seed, l)`,
is a mean-one log-normal straggler factor: the same seed gives the same durations, so
the same simulated run, bit for bit.
"""

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxsgd.scheduler import transfer

TRANSFER = 'transfer'


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Task durations in seconds.

  Attributes:
    compute: base durations keyed by `(stage, kind)` or by `kind` alone (a
      default for every stage), e.g. `{'forward': 1e-3, (3, 'backward'): 4e-3}`.
    device_speeds: speed factor of compute lane `l` (lanes beyond the list: 1).
    link_latency: seconds per transfer.
    link_bandwidth: bytes per second (`inf`: free).
    link_per_array: seconds per array of a message beyond its first (an executor that
      serializes and rebuilds each array of a message on its own: the process executor's
      moves, measured in its host profile; 0: a message costs its bytes alone).
    straggler_std: σ of the log-normal straggler factor (0: none).
    seed: seeds the straggler noise.
    dispatch: seconds of host overhead added to every compute task (not to transfers).
    driver: seconds of the driver's host thread per event it handles — a task or copy
      dispatched, a task's end heard — one event at a time, in the order they arrive
      (`VirtualExecutor`'s run-ahead schedule; 0: the driver takes no time).
    driver_latency: seconds a message between the driver and a lane takes, each way (a
      dispatched task reaching its lane, a task's end reaching the driver); messages do
      not queue behind one another.
    take_in: `(latency s, bandwidth B/s, seconds per array beyond the first)` of a lane
      taking in a message moved to it, before the first task there that reads it
      (`take_in_time`; the process executor's host profile; None: nothing).
    export: the same three figures of the part of a transfer its sending lane's export
      thread spends (`export_time`; the process executor's host profile; None: the
      whole transfer).
  """

  compute: Mapping[Any, float]
  device_speeds: Sequence[float] = ()
  link_latency: float = 0.0
  link_bandwidth: float = math.inf
  link_per_array: float = 0.0
  straggler_std: float = 0.0
  seed: int = 0
  dispatch: float = 0.0
  driver: float = 0.0
  driver_latency: float = 0.0
  take_in: tuple[float, float, float] | None = None
  export: tuple[float, float, float] | None = None

  def __post_init__(self):
    for key, value in self.compute.items():
      if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(
          f'cost.compute: the cost of {key!r} must be a finite number '
          f'of seconds >= 0, got {value!r}.'
        )
    for lane, speed in enumerate(self.device_speeds):
      if not speed > 0:
        raise ValueError(f'cost.speeds: must be > 0, got {speed!r} for lane {lane}.')
    if not self.link_latency >= 0:
      raise ValueError(f'cost.link_latency: must be >= 0, got {self.link_latency!r}.')
    if not self.link_bandwidth > 0:
      raise ValueError(f'cost.link_bandwidth: must be > 0, got {self.link_bandwidth!r}.')
    if not self.straggler_std >= 0:
      raise ValueError(f'cost.straggler_std: must be >= 0, got {self.straggler_std!r}.')
    if not 0 <= self.dispatch < math.inf:
      raise ValueError(
        f'cost.dispatch: must be a finite number of seconds >= 0, got {self.dispatch!r}.'
      )
    for field in ('driver', 'driver_latency', 'link_per_array'):
      value = getattr(self, field)
      if (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
      ):
        raise ValueError(f'cost.{field}: must be a finite number of seconds >= 0, got {value!r}.')
    for field in ('take_in', 'export'):
      figures = getattr(self, field)
      if figures is None:
        continue
      latency, bandwidth, per_array = figures
      if not (0 <= latency < math.inf and bandwidth > 0 and 0 <= per_array < math.inf):
        raise ValueError(
          f'{field}: (latency s >= 0, bandwidth B/s > 0, seconds per array >= 0), got {figures!r}.'
        )

  @property
  def prices_bytes(self) -> bool:
    """Whether a message's cost depends on its bytes (its link's or its take-in's)."""
    return math.isfinite(self.link_bandwidth) or self.take_in is not None

  @property
  def simulates_driver(self) -> bool:
    return bool(self.driver or self.driver_latency)

  def base(self, kind: str, stage: int | None) -> float:
    if (stage, kind) in self.compute:
      return self.compute[(stage, kind)]
    if kind in self.compute:
      return self.compute[kind]
    raise ValueError(
      f'cost.compute: no cost for {kind!r} tasks of stage {stage}; give '
      f'one (per stage or for every stage) or set cost.calibrate=True.'
    )

  def transfer_time(self, nbytes: int, arrays: int = 1) -> float:
    extra_arrays = max(arrays - 1, 0)
    return self.link_latency + extra_arrays * self.link_per_array + nbytes / self.link_bandwidth

  def take_in_time(self, nbytes: int, arrays: int = 1) -> float:
    """Seconds a lane takes to take in a message of `nbytes` bytes in `arrays` arrays."""
    return _move_part(self.take_in, nbytes, arrays, 0.0)

  def export_time(self, nbytes: int, arrays: int = 1) -> float:
    """Seconds the sending lane's export thread spends on a message of `nbytes` bytes in
    `arrays` arrays (without `export`: the whole transfer, `transfer_time`)."""
    return _move_part(self.export, nbytes, arrays, self.transfer_time(nbytes, arrays))

  def speed(self, lane: int) -> float:
    return self.device_speeds[lane] if lane < len(self.device_speeds) else 1.0

  def sampler(self) -> 'CostSampler':
    return CostSampler(self)


class CostSampler:
  """Draws task durations for one run (per-lane seeded straggler noise)."""

  def __init__(self, model: CostModel):
    self.model = model
    self._rngs: dict[int, np.random.Generator] = {}
    self._seconds: dict[tuple, float] = {}  # (kind, stage, lane) -> base / speed

  def duration(
    self, kind: str, stage: int | None, lane: int, nbytes: int = 0, arrays: int = 1
  ) -> float:
    if kind == TRANSFER:
      return self.model.transfer_time(nbytes, arrays)
    key = (kind, stage, lane)
    seconds = self._seconds.get(key)
    if seconds is None:
      seconds = self._seconds[key] = self.model.base(kind, stage) / self.model.speed(lane)
    sigma = self.model.straggler_std
    if sigma:
      seconds *= math.exp(sigma * self._rng(lane).standard_normal() - sigma * sigma / 2)
    return seconds + self.model.dispatch

  def _rng(self, lane: int) -> np.random.Generator:
    """Lane `lane`'s generator, seeded `[seed, lane]`, made at its first draw only: making
    one (a seed sequence hashed, a bit generator) costs ~100x a draw, and the emulated
    executor's driver draws at every dispatch, on the run's critical path."""
    rng = self._rngs.get(lane)
    if rng is None:
      rng = self._rngs[lane] = np.random.default_rng([self.model.seed, lane])
    return rng


def time_calls(calls: Mapping[Any, tuple[Callable, tuple]], reps: int = 3) -> dict[Any, float]:
  """Fastest of `reps` wall-clock timings of each `fn(*args)`, after one warm-up call.

  The minimum, not the mean: on a shared machine other processes only ever add
  time, so the fastest run is the most reproducible estimate of the task's cost.
  Blocks on every result: it runs once, before training.
  """
  costs = {}
  for key, (fn, args) in calls.items():
    transfer.wait(fn(*args))
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      transfer.wait(fn(*args))
      times.append(time.perf_counter() - start)
    costs[key] = min(times)
  return costs


def _move_part(figures, nbytes: int, arrays: int, without: float) -> float:
  """`latency + (arrays - 1) · per_array + nbytes / bandwidth` of `figures` (a move
  part's `(latency, bandwidth, per_array)`), or `without` where there are none."""
  if figures is None:
    return without
  latency, bandwidth, per_array = figures
  return latency + max(arrays - 1, 0) * per_array + nbytes / bandwidth
