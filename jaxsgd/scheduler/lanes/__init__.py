"""Lanes in their own OS processes, each with its own JAX runtime, on one host or many.

`LanePool` (pool.py) starts one process per lane of a `LanePlacement` (placement.py) on
a Ray cluster (cluster.py), runs named `tasks.Task`s there, keeps their results in the
lane (`Handle`s in the driver) and moves values lane to lane. runtime.py is the code
inside a lane process. See docs/engine.md.
"""

from jaxsgd.scheduler.lanes.placement import LanePlacement, LaneSpec
from jaxsgd.scheduler.lanes.pool import Handle, LaneError, LanePool, Pending, sigterm_received

__all__ = (
  'Handle',
  'LaneError',
  'LanePlacement',
  'LanePool',
  'LaneSpec',
  'Pending',
  'sigterm_received',
)
