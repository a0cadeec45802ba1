"""From settings to an executor: the one place where `cost` becomes a cost model.

    table = task_costs(shared, measure, kinds, num_stages)   # calibrated, or cost.compute
    model = cost_model(shared, table, lane_speeds)            # + links, stragglers, seed
    executor = make_executor(shared, measure, kinds, num_stages, lane_speeds=...)

`measure()` is the policy's own calibration (it times its real jitted tasks); it is
called only on the virtual clock with `cost.calibrate=True`.
"""

from collections.abc import Callable, Sequence

import jax

from jaxsgd.algorithms.settings import SharedSettings
from jaxsgd.scheduler import CostModel, Placement, RealExecutor, VirtualExecutor


def task_costs(
  shared: SharedSettings, measure: Callable[[], dict], kinds: Sequence[str], num_stages: int
) -> dict:
  """Seconds per `(stage, kind)`: measured by `measure()`, or given in `cost.compute`."""
  return measure() if shared.cost.calibrate else shared.cost.explicit(kinds, num_stages)


def cost_model(shared: SharedSettings, table: dict, lane_speeds: Sequence[float] = ()) -> CostModel:
  """The virtual clock's cost model: `table`, lane speeds, links, stragglers, seed."""
  cost = shared.cost
  return CostModel(
    compute=dict(table),
    device_speeds=tuple(lane_speeds),
    link_latency=cost.link_latency,
    link_bandwidth=cost.bandwidth,
    straggler_std=cost.straggler_std,
    seed=shared.cost_seed,
  )


def make_executor(
  shared: SharedSettings,
  measure: Callable[[], dict],
  kinds: Sequence[str],
  num_stages: int,
  *,
  lane_speeds: Sequence[float] = (),
  threads: bool = False,
  adjust: Callable[[dict], dict] = lambda table: table,
):
  """`(executor, measured table)`: the real clock (`threads`: a thread per process) and
  `{}`, or the virtual clock with a cost model of `adjust(table)`."""
  if not shared.virtual:
    return RealExecutor(threads=threads), {}
  table = task_costs(shared, measure, kinds, num_stages)
  return VirtualExecutor(cost_model(shared, adjust(table), lane_speeds)), table


def cost_table(executor) -> dict | None:
  """The (adjusted) seconds per task the virtual clock used; None on the real clock."""
  return dict(executor.cost_model.compute) if executor.clock == 'virtual' else None


def placement(shared: SharedSettings, num_stages: int) -> Placement:
  """Stage k's device, from `config.placement` (checked by `shared_settings`)."""
  devices = jax.devices()
  if shared.placement.devices is not None:
    devices = [devices[p] for p in shared.placement.devices]
  return Placement.create(num_stages, devices, shared.placement.stage_to_device)


def lane_devices(shared: SharedSettings, num_lanes: int) -> list[jax.Device]:
  """Real clock: lane i on `jax.devices()[i % n]`; virtual: every lane on the first
  (only simulated time depends on the lanes; the bits do not depend on the device)."""
  devices = jax.devices()
  if shared.virtual:
    return [devices[0]] * num_lanes
  return [devices[i % len(devices)] for i in range(num_lanes)]


def worker_speeds(
  shared: SharedSettings, num_workers: int, what: str = 'worker'
) -> tuple[float, ...]:
  """`cost.worker_speeds` (default all 1), one per worker."""
  speeds = shared.cost.worker_speeds or (1.0,) * num_workers
  if len(speeds) != num_workers:
    raise ValueError(f'cost.worker_speeds: {len(speeds)} values for {num_workers} {what}s.')
  return tuple(float(s) for s in speeds)


def failures(shared: SharedSettings, num_workers: int, what: str = 'worker') -> dict[int, float]:
  """`cost.failures` as worker -> the earliest (simulated or wall) second it fails."""
  result: dict[int, float] = {}
  for m, time in shared.cost.failures:
    if not 0 <= m < num_workers:
      raise ValueError(f'cost.failures: worker {m!r} is not a {what} in [0, {num_workers}).')
    result[m] = min(float(time), result.get(m, float('inf')))
  return result
