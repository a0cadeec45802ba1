"""The scheduler (layers 3–4 of the design): policies of tasks on lanes, two clocks.

A policy is a set of *processes* (generators) on the *lanes* of a `Cluster`. A
process yields `Compute` (a jitted JAX call, a task on a lane), `Send` (a copy
over a link), `Put` and `Get` (FIFO channels); it reads `VersionedStore`s at a
task's start and writes them at its end. An executor runs the processes:

- `RealExecutor()`: real devices, asynchronous dispatch from one thread, timings
  measured off the hot path; `RealExecutor(threads=True)`: a thread per process.
- `VirtualExecutor(cost_model)`: a deterministic discrete-event simulation in
  which every task still runs its real computation; `LaneProcessModel` simulates the
  process executor's schedule on it, and `virtual.make` picks one for a run's settings.

Both are small subclasses of `Executor` (`executor.py`), which writes what the ops
mean once; a clock overrides only when tasks run and when processes go on (its
docstring is the contract for a further executor). Every executor returns a
`Timeline` (`trace.json` for Perfetto, per-lane utilization).
`pipeline` runs the stage-per-lane policies (BP, DDG, local parallelism) given
one `StageRole` per stage.

Asynchronous workers (ASGD/Hogwild!, DC-ASGD, PD-ASGD) are processes too: a
server lane owning a `VersionedStore` and M worker lanes. A worker reads the
store at its task's start (`snap = store.read()`), yields a gradient `Compute`,
and `Send`s `(snap.version, g)` to the server's channel; the server `Get`s it,
applies it and `store.write(..., read_version=version)` records the staleness.
Worker speeds and stragglers come from `CostModel.device_speeds` and
`straggler_std` (seeded per lane); a failure is an exception raised by a task
(the run stops) or a worker process that returns early. Under the real clock,
`RealExecutor(threads=True)` gives every worker its own thread.
`tests/scheduler/test_scheduler_core.py` has a 64-worker parameter server.
"""

from jaxsgd.scheduler.core import Channel, Cluster, Compute, DeadlockError, Get, Process
from jaxsgd.scheduler.core import Put, Send
from jaxsgd.scheduler.costs import CostModel, time_calls
from jaxsgd.scheduler.executor import Executor
from jaxsgd.scheduler.placement import Placement
from jaxsgd.scheduler.real import RealExecutor, ThreadedExecutor
from jaxsgd.scheduler.store import Snapshot, UpdateRecord, VersionedStore
from jaxsgd.scheduler.timeline import TaskRecord, Timeline
from jaxsgd.scheduler.virtual import VirtualExecutor
from jaxsgd.scheduler.virtual_processes import LaneProcessModel
