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
- `constant outputs`: the same session with every task returning a constant output
  (no JAX call, no array made or freed) and every batch already on the device: the
  simulator's own Python alone.
- `bare loop`: the same jitted functions, `updates` times, in a plain one-worker loop
  (forward, backward, server update per step, on one batch already on the device, its
  frees included), no scheduler; `session − bare` was the last line's figure before the
  replay's. It is not the session's work: one worker's arrays alive instead of 64
  workers', and no host batch copied in.
- `replay`: the session's own jitted calls, recorded once (`record_calls`: which
  function, on which arguments, each argument leaf the output of which earlier call or
  a constant such as a host batch) and made again in a plain loop in the same order,
  each output dropped after its last use (`replay_cost`). The benchmark checks that the
  replay ends at the session's server parameters bit for bit before it measures.
  `replay bookkeeping`: the same loop with every call returning a constant output (its
  lookups, unflattening, storing, dropping). `session − replayed calls` = session −
  (replay − bookkeeping): what the simulator adds to the very calls it makes.

The workers' host batches cycle through a few pre-generated ones, so making data costs
nothing here. Repeats interleave timed session, session, bare loop, constant-output
session, replay and constant-output replay; medians are reported, with the load
average. The last line is the figure, `simulated ASGD M=64 host time per task: <x> us`:
the median over the repeats of session − replayed calls, each repeat's session and
replay run one after the other, so that what load does to both cancels in their
difference. (The fastest repeat of each is printed too, but it is not the figure: load
does not only add this thread's CPU time — a busier XLA lets the thread run further
ahead, and more of the arrays it drops are then freed on XLA's threads instead.) Two
known biases: the bookkeeping is measured with XLA idle, where Python costs 2–4 µs less
per task than beside XLA's compute (the figure comes out up to that much low); the
replay's calls drop an output no call reads (a loss) right after making it, as a plain
loop would, while the session keeps it in its log.

What is in the figure besides the simulator's Python (`constant outputs`), as far as it
was explained, and the figures of earlier versions: benchmarks/results/simulator_host_cost.md
("Moved from the benchmark's docstring").
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


@dataclasses.dataclass(frozen=True)
class _Call:
  """One jitted task call of a recorded session: its function, the structure of its
  arguments, where each argument leaf comes from (`(call, output)`: the output of an
  earlier call; otherwise the leaf itself: a host batch, the initial parameters, a
  staleness constant), and the outputs whose last use it is."""

  fn: object
  treedef: object
  sources: tuple
  last_uses: tuple


class _Output(tuple):
  """`(call, output)`: an argument leaf that an earlier call of the trace made."""


def record_calls(setup: Setup, steps: int) -> tuple[list[_Call], dict]:
  """The jitted task calls of one simulated session (forward, backward, server update),
  in the order it made them, and its final server value (parameters, optimizer state).

  Replayed (`replay_cost`), they are the session's calls without the simulator: the same
  functions on the same data, made in the same order, each output dropped after its last
  use. While recording, every output is kept alive, so no two outputs share an `id`."""
  session = setup.session(steps)
  calls, made, kept = [], {}, []

  def recorded(fn):
    def call(*args):
      leaves, treedef = jax.tree_util.tree_flatten(args)
      sources = tuple(made.get(id(leaf), leaf) for leaf in leaves)
      result = fn(*args)
      outputs = jax.tree_util.tree_leaves(result)
      for position, leaf in enumerate(outputs):
        made.setdefault(id(leaf), _Output((len(calls), position)))
      calls.append((fn, treedef, sources, len(outputs)))
      kept.append(result)
      return result

    return call

  ops = session.ops
  session.ops = dataclasses.replace(
    ops, forward=recorded(ops.forward), backward=recorded(ops.backward)
  )
  session.server.apply_fn = recorded(session.server.apply_fn)
  VirtualExecutor(COSTS).run(session.cluster, session.processes())
  final = jax.device_get(session.server.store.read().value)
  # An output no call reads (a loss; backward's state) is dropped by the call that made it.
  last_use = {
    _Output((index, position)): index
    for index, (*_, outputs) in enumerate(calls)
    for position in range(outputs)
  }
  for index, (_, _, sources, _) in enumerate(calls):
    for source in sources:
      if type(source) is _Output:  # pylint: disable=unidiomatic-typecheck
        last_use[source] = index
  ends: list[list] = [[] for _ in calls]
  for source, index in last_use.items():
    ends[index].append(source)
  trace = [
    _Call(fn, treedef, sources, tuple(ends[index]))
    for index, (fn, treedef, sources, _) in enumerate(calls)
  ]
  return trace, final


def replay_cost(trace: list[_Call], keep: int = -1) -> tuple[float, object]:
  """(thread CPU seconds, the result of call `keep`) of the trace's calls in a plain loop:
  each argument leaf looked up, the arguments unflattened, the call made, its output
  leaves stored, the outputs it used last dropped."""
  outputs: dict = {}
  keep %= len(trace)
  result = kept = None
  gc.collect()
  cpu = time.thread_time()
  for index, call in enumerate(trace):
    leaves = [
      outputs[source] if type(source) is _Output else source  # pylint: disable=unidiomatic-typecheck
      for source in call.sources
    ]
    result = call.fn(*jax.tree_util.tree_unflatten(call.treedef, leaves))
    for position, leaf in enumerate(jax.tree_util.tree_leaves(result)):
      outputs[_Output((index, position))] = leaf
    for source in call.last_uses:
      del outputs[source]
    if index == keep:
      kept = result
    del leaves
  cpu = time.thread_time() - cpu
  jax.block_until_ready(result)
  return cpu, kept


def with_constant_outputs(trace: list[_Call]) -> list[_Call]:
  """The trace with every call returning its function's first real output: replayed, the
  loop's own bookkeeping (lookups, unflattening, storing, dropping), no JAX call."""
  first: dict = {}
  replay_cost([dataclasses.replace(c, fn=_first_output(c.fn, first)) for c in trace])
  return [dataclasses.replace(c, fn=lambda *args, out=first[id(c.fn)]: out) for c in trace]


def _first_output(fn, first: dict):
  def call(*args):
    result = fn(*args)
    first.setdefault(id(fn), result)
    return result

  return call


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workers', type=int, default=64)
  parser.add_argument('--rounds', type=int, default=8, help='updates per worker')
  parser.add_argument('--repeats', type=int, default=15)
  args = parser.parse_args()
  setup = Setup(args.workers)
  steps = args.workers * args.rounds
  session_cost(setup, args.workers)  # Compiles every call.
  bare_cost(setup, 2)
  constants = constant_outputs(setup)
  trace, final = record_calls(setup, steps)
  last_update = max(i for i, call in enumerate(trace) if call.fn is setup.apply_fn)
  _, replayed = replay_cost(trace, last_update)
  same = all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(replayed))
  )
  if not same:
    raise RuntimeError("the replayed calls did not end at the session's server parameters")
  bookkeeping_trace = with_constant_outputs(trace)
  rows, loads = [], [os.getloadavg()[0]]
  for r in range(args.repeats):
    # Interleaved: session (its calls timed), session, bare loop, constant-output session,
    # replay, constant-output replay.
    timed_cpu, inside, _, timed_tasks = session_cost(setup, steps)
    cpu, _, wall, tasks = session_cost(setup, steps, timed=False)
    bare = bare_cost(setup, steps)
    own, _, _, own_tasks = session_cost(setup, steps, constants, timed=False)
    replay, _ = replay_cost(trace)
    bookkeeping, _ = replay_cost(bookkeeping_trace)
    loads.append(os.getloadavg()[0])
    per_task = lambda seconds, tasks=tasks: 1e6 * seconds / tasks  # noqa: E731
    rows.append(
      (
        r,
        tasks,
        cpu,
        wall,
        per_task(cpu),
        1e6 * timed_cpu / timed_tasks,
        1e6 * inside / timed_tasks,
        1e6 * (timed_cpu - inside) / timed_tasks,
        1e6 * own / own_tasks,
        per_task(bare),
        per_task(cpu - bare),
        per_task(replay),
        per_task(bookkeeping),
        per_task(cpu - (replay - bookkeeping)),
      )
    )
  print(f'ASGD on the virtual clock: {args.workers} workers, CNN batch {BATCH}, on {setup.device}')
  print(
    f'load average {min(loads):.1f}-{max(loads):.1f} during the repeats, '
    f'on {os.cpu_count()} CPU cores; {steps} updates a session; {len(trace)} jitted calls '
    f"recorded and replayed, ending at the session's server parameters bit for bit"
  )
  common.print_table(
    (
      'repeat',
      'tasks',
      'thread CPU s',
      'wall s',
      'µs/task',
      'timed: µs/task',
      'in jitted calls',
      'outside them',
      'constant outputs',
      'bare loop',
      'session − bare',
      'replay',
      'replay bookkeeping',
      'session − replayed calls',
    ),
    rows,
  )
  median = lambda column: float(np.median([row[column] for row in rows]))  # noqa: E731
  fastest = lambda column: min(row[column] for row in rows)  # noqa: E731
  name = f'simulated ASGD M={args.workers} host time per task'
  print(f'{name}, jitted calls included: {median(4):.1f} us')
  print(
    f'{name} outside the jitted task calls (array frees included; a host batch is copied '
    f'in by its forward call; the session whose calls are timed): {median(7):.1f} us'
  )
  print(
    f'{name} of the simulator alone (tasks return constant outputs, batches already '
    f'placed): {median(8):.1f} us'
  )
  print(
    f'{name} over a one-worker loop of the same functions on a placed batch (session − '
    f"bare; the last line's figure before the replay's): median {median(10):.1f} us, fastest "
    f'{fastest(4) - fastest(9):.1f} us'
  )
  print(
    f'{name} over the same calls replayed without it, the fastest repeat of each '
    f'(fastest session − (fastest replay − fastest replay bookkeeping)): '
    f'{fastest(4) - (fastest(11) - fastest(12)):.1f} us'
  )
  print(f'{name}: {median(13):.1f} us')


if __name__ == '__main__':
  main()
