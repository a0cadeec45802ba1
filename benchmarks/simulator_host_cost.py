r"""Host time the virtual clock spends per task: a simulated ASGD session with M = 64 workers.

    python -m benchmarks.simulator_host_cost            # ~1 min on a 2-core CPU
    python -m benchmarks.simulator_host_cost --rounds=8 --workers=64

The session of `jaxsgd.asynchronous.server` (a parameter server and M workers, the
CNN of the default config on MNIST-1D shapes, batch 64, Adam 1e-3) on the virtual
clock, links of 10 µs and 10 GB/s, every lane computing on one CPU device. Each
worker step is 5 tasks: forward, backward, the push's transfer, the server's
update, the reply's transfer.

Host time is the CPU time of the Python thread that runs the simulation
(`time.thread_time`): XLA executes the jitted calls on threads of its own, so what
the thread spends is the simulator — event loop, channels, stores, messages, byte
counting, on-device checks — plus what JAX does on the host for the work: dispatching
the jitted calls, copying each host batch to the device (inside the forward's call:
`transfer.HostInputs`), freeing the arrays the tasks made. CPU time rather than wall
time, because other jobs on a shared machine add wall time but not this thread's CPU
time (they still inflate it a little: caches and cores are shared). Every session reuses one compiled server update (a run
compiles it once), and starts after a full garbage collection. The columns, per task:

- `µs/task`: the session's thread CPU time, its task calls not timed.
- `timed: µs/task`, `in jitted calls` / `outside them`: another session whose task
  calls are timed (forward, its host batch copied in by the call; backward; server
  update), split into the time inside those calls and the rest, which includes
  freeing the arrays the calls made. Timing a call costs two `time.thread_time` system
  calls (~7 µs here), which is why the figure reads the session that is not timed.
- `bare loop`: the same jitted calls, `updates` times, in a plain loop (forward,
  backward, server update per step, on one batch already on the device, its frees
  included), no scheduler; `session − bare` is the figure of the last line, as this
  benchmark has always reported it: the host time a simulated session adds to the
  calls it makes.
- `constant outputs`: the same session with every task returning a constant output
  (no JAX call, no array made or freed) and every batch already on the device: the
  simulator's own Python alone.

The workers' host batches cycle through a few pre-generated ones, so making data costs
nothing here. Repeats interleave timed session, session, bare loop and constant-output
session;
medians are reported, with the load average. The last line is the figure:
`simulated ASGD M=64 host time per task: <x> us` (session − bare).

Measured here (2-core CPU shared with other jobs; benchmarks/results/): at load ~4,
the engine branch took the figure from 173 µs to 71 µs. On branch `hostcost`, at
load 17–26 (results file, main and branch alternated, three passes each), the
simulator alone costs 13–16 µs per task (main 15–18), and `session − bare` is 80–97
µs on the branch against 76–89 on main: no difference this load lets one see, since
what remains is JAX's host work, not the simulator's. Where the ~90 µs outside the
jitted calls go, measured by removing one part at a time (load ~23, medians of 5):
freeing the tasks' arrays ~33 µs (results kept alive: 93 → 60), placing each host
batch on the device ~21 µs (batches pre-placed: 93 → 72; 53 µs per placement here,
11 µs on an idle device, `jax.device_put` 207), the simulator's Python ~15 µs, garbage
collection ~0, and ~20 µs of contention: the same Python costs more CPU time while
XLA's threads compute beside it on the two cores. Since then a worker's host batch goes
into its forward call instead of being placed first (one dispatch instead of two): six
interleaved pairs of runs on a 2-core AMD EPYC VM (2026-11-26), the figure 72.4 → 68.7
µs (medians), the session's whole host time per task 128 → 116 µs (three pairs). On
2026-11-28 (same VM kind) the figure became the untimed session's and the virtual
clock flattens a `Send` once: 58.4–67.2 µs in four runs (the simulator alone 13.0–13.4),
against 26–34 µs with one worker and 36–38 with eight: the jitted calls and frees cost
~25 µs more per task with 64 workers' work held at once.
"""

import argparse
import dataclasses
import gc
import itertools
import os
import time

import jax
import numpy as np
import optax

from benchmarks import common
from jaxsgd import models
from jaxsgd.asynchronous import common as async_common
from jaxsgd.asynchronous import server
from jaxsgd.models import stage_functions as stages_lib
from jaxsgd.pipeline import PlacedStages, sequential_roles
from jaxsgd.scheduler import CostModel, Placement, VirtualExecutor, transfer

BATCH = 64
COSTS = CostModel(
  {'forward': 1e-3, 'backward': 2e-3, 'update': 1.25e-4}, link_latency=1e-5, link_bandwidth=1e10
)


class Setup:
  """The model as one stage, a fresh parameter server per session, the batches."""

  def __init__(self, num_workers: int):
    self.model = models.get_model('cnn', (40, 1), 10)
    self.device = jax.devices()[0]
    self.num_workers = num_workers
    self.pipeline = PlacedStages(
      self.model,
      1,
      optax.adam(1e-3),
      placement=Placement.create(1, [self.device]),
      batch_size=BATCH,
    )
    self.settings = server.ServerSettings(num_workers)
    # One jitted update for every session, as a run has: a fresh `jax.jit` per session
    # would trace (on this thread) and compile (on XLA's) inside the timed region.
    self.apply_fn = server.make_apply(
      server.server_optimizer(self.pipeline.tx, self.settings), record_pulls=False
    )
    self.streams = [
      common.cycled_batches(self.model.input_shape, 10, BATCH, seed=m) for m in range(num_workers)
    ]

  def server(self):
    variables = self.pipeline.initial_variables(0, sequential_roles(1)[0])
    params, state = stages_lib.split_variables(variables)
    tx = server.server_optimizer(self.pipeline.tx, self.settings)
    return server.ParameterServer(
      tx, params, self.num_workers, self.device, record_pulls=False, apply_fn=self.apply_fn
    ), state

  def session(self, steps: int):
    ps, state = self.server()
    log = async_common.WorkerLog([f'worker {m}' for m in range(self.num_workers)], {}, lambda: 0.0)
    return server.AsgdSession(
      self.pipeline,
      ps,
      state,
      self.streams,
      [self.device] * (1 + self.num_workers),
      async_common.StepCounter(steps),
      log,
    )


class _Timed:
  """Wraps a jitted function: thread CPU seconds spent inside its calls, summed."""

  def __init__(self, fn, clock: list):
    self.fn, self.clock = fn, clock

  def __call__(self, *args):
    start = time.thread_time()
    result = self.fn(*args)
    self.clock[0] += time.thread_time() - start
    return result


def constant_outputs(setup: Setup) -> dict:
  """One real output of each task function (forward, backward, server update)."""
  ps, state = setup.server()
  ops = setup.pipeline.ops(0, sequential_roles(1)[0])
  batch = transfer.to_device(next(setup.streams[0]), setup.device)
  current = ps.store.read().value
  forward = ops.forward({'params': current.params, **state}, batch['image'], batch['label'])
  backward = ops.backward(forward[3], None)
  ps.pull(0)
  fn, args = ps.update_call(0, backward[0], 0)
  return {'forward': forward, 'backward': backward, 'apply': jax.block_until_ready(fn(*args))}


def session_cost(
  setup: Setup, steps: int, constants: dict | None = None, timed: bool = True
) -> tuple:
  """(thread CPU seconds, of which inside the jitted task calls, wall seconds, tasks) of
  one simulated session. With `constants` (`constant_outputs`), every task returns its
  constant output instead of calling JAX, and every host batch is already on the device:
  what is left is the simulator's own Python (event loop, policy, messages, checks).
  With `timed=False` the task calls are not timed (the second figure is 0): timing them
  costs two `time.thread_time` calls each, ~7 µs of this thread's CPU per call here (a
  system call), which the bare loop it is held against does not pay."""
  session = setup.session(steps)
  inside = [0.0]
  if constants is None:
    forward, backward = session.ops.forward, session.ops.backward
    apply_fn = session.server.apply_fn
  else:
    forward, backward, apply_fn = (
      lambda *args, out=constants[name]: out for name in ('forward', 'backward', 'apply')
    )
    on_device = transfer.to_device(next(setup.streams[0]), setup.device)
    session.streams = [itertools.repeat(on_device)] * setup.num_workers
  if timed:
    forward, backward, apply_fn = (_Timed(fn, inside) for fn in (forward, backward, apply_fn))
  session.ops = dataclasses.replace(session.ops, forward=forward, backward=backward)
  session.server.apply_fn = apply_fn
  executor = VirtualExecutor(COSTS)
  gc.collect()  # Every repeat starts with the same garbage: none.
  wall, cpu = time.perf_counter(), time.thread_time()
  timeline = executor.run(session.cluster, session.processes())
  cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
  jax.block_until_ready(session.server.store.read().value)
  return cpu, inside[0], wall, len(timeline.records)


def bare_cost(setup: Setup, steps: int) -> float:
  """Thread CPU seconds of the same jitted calls, `steps` times, without a scheduler."""
  ps, state = setup.server()
  ops = setup.pipeline.ops(0, sequential_roles(1)[0])
  batch = transfer.to_device(next(setup.streams[0]), setup.device)
  gc.collect()
  cpu = time.thread_time()
  for _ in range(steps):
    current = ps.store.read().value
    _, _, _, vjp = ops.forward({'params': current.params, **state}, batch['image'], batch['label'])
    grads, _ = ops.backward(vjp, None)
    ps.pull(0)
    fn, args = ps.update_call(0, grads, ps.store.version)
    ps.commit(0, fn(*args), ps.store.version, lane=1, batch=0)
  cpu = time.thread_time() - cpu
  jax.block_until_ready(ps.store.read().value)
  return cpu


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workers', type=int, default=64)
  parser.add_argument('--rounds', type=int, default=8, help='updates per worker')
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  setup = Setup(args.workers)
  steps = args.workers * args.rounds
  session_cost(setup, args.workers)  # Compiles every call.
  bare_cost(setup, 2)
  constants = constant_outputs(setup)
  rows, loads = [], [os.getloadavg()[0]]
  for r in range(args.repeats):
    # Interleaved: session (its calls timed), session, bare loop, constant-output session.
    timed_cpu, inside, _, timed_tasks = session_cost(setup, steps)
    cpu, _, wall, tasks = session_cost(setup, steps, timed=False)
    bare = bare_cost(setup, steps)
    own, _, _, own_tasks = session_cost(setup, steps, constants, timed=False)
    loads.append(os.getloadavg()[0])
    rows.append(
      (
        r,
        steps,
        tasks,
        cpu,
        wall,
        1e6 * cpu / tasks,
        1e6 * timed_cpu / timed_tasks,
        1e6 * inside / timed_tasks,
        1e6 * (timed_cpu - inside) / timed_tasks,
        1e6 * bare / tasks,
        1e6 * (cpu - bare) / tasks,
        1e6 * own / own_tasks,
      )
    )
  print(f'ASGD on the virtual clock: {args.workers} workers, CNN batch {BATCH}, on {setup.device}')
  print(
    f'load average {min(loads):.1f}-{max(loads):.1f} during the repeats, '
    f'on {os.cpu_count()} CPU cores'
  )
  common.print_table(
    (
      'repeat',
      'updates',
      'tasks',
      'thread CPU s',
      'wall s',
      'µs/task',
      'timed: µs/task',
      'in jitted calls',
      'outside them',
      'bare loop',
      'session − bare',
      'constant outputs',
    ),
    rows,
  )
  median = lambda column: float(np.median([row[column] for row in rows]))
  print(
    f'simulated ASGD M={args.workers} host time per task, jitted calls included: {median(5):.1f} us'
  )
  print(
    f'simulated ASGD M={args.workers} host time per task outside the jitted task calls '
    f'(array frees included; a host batch is copied in by its forward call; the session '
    f'whose calls are timed): {median(8):.1f} us'
  )
  print(
    f'simulated ASGD M={args.workers} host time per task of the simulator alone (tasks '
    f'return constant outputs, batches already placed): {median(11):.1f} us'
  )
  print(f'simulated ASGD M={args.workers} host time per task: {median(10):.1f} us')


if __name__ == '__main__':
  main()
