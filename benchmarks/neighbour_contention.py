r"""How much slower a pipeline stage's task runs while other cores run their tasks too.

    python -m benchmarks.neighbour_contention                       # N = 1, 2 here
    python -m benchmarks.neighbour_contention --counts=1,2,4,8,16   # a 16-core machine
    python -m benchmarks.neighbour_contention --stages --counts=1,4,8   # DDG's own stages
    python -m benchmarks.neighbour_contention --pdasgd --counts=1,2     # PD-ASGD's workers

A speed-up over K lanes is bounded by what K cores can compute at once, not only by the
executor: cores share the last-level cache, the memory bus and a power budget (the
all-core clock is below the one-core turbo), two hardware threads of one physical core
share its execution units, and a virtual machine's cores may share their host with work
it cannot see. This measures that bound with no executor in the way. For each N of
`--counts` and each placement, N processes are started, each pinned to its own core with
one XLA thread (as a lane is: `LANE_ENV`); each builds its task and calls it `--warmup`
times; then all are released together and each times `--reps` blocking calls.

The task: `--layers` dense tanh layers of `--features` units on a batch of `--batch`
float32 rows, forward and backward (by default a DDG K=8 stage of `real_speedup --lanes=8
--depth=16`); or, with `--stages`, `real_speedup`'s own model (`--features` inputs,
`--depth` hidden layers of 1024, batch `--batch`) split as DDG K = N splits it, process k
running stage k's forward, backward and update (`PlacedStages.task_calls`, the calls a
lane makes), and N = 1 BP's one stage: the reference, so `--counts` starts at 1. With
`--pdasgd`, PD-ASGD 1:(N-1) on the same model: process 0 the forward worker's forward of
the whole model and the update (which `real_speedup`'s shared model applies on that
core), each other process a backward worker's backward.

Placements, of the cores this process may use:
  first     cores in order (0, 1, 2, ...): how `real_speedup` places its lanes
  spread    one core per physical core first (sysfs `thread_siblings_list`), then their
            siblings; printed only where it differs from `first`

The table: placement, N, the median over processes of each one's median call, the
slowest process's median, and the ratio of the first to N = 1's (the slowdown); with
`--stages` or `--pdasgd`, instead, the ceiling: BP alone over the time per batch of the
processes at once (`pace`: DDG's slowest stage; PD-ASGD's forward worker or its backward
workers' share), the speed-up the method could reach if the executor cost nothing. Then
each core's median at the largest N (a pipeline runs at its slowest stage's pace). Not a
test: speed is measured, not asserted. The last line, for the largest N:
`<N> busy cores (<placement>): a task takes <x>x its time alone`, or with `--stages`
`DDG K=<N>'s stages at once (<placement>): ceiling <x>x over BP alone` (`--pdasgd`:
`PD-ASGD 1:<N-1>'s workers at once ...`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def physical_order(cores: list[int]) -> list[int]:
  """`cores`, one per physical core first (the lowest of each sibling set), then the
  rest in order; `cores` unchanged where sysfs does not say which are siblings."""
  first, rest, seen = [], [], set()
  for core in cores:
    siblings = thread_siblings(core)
    if siblings is None:
      return list(cores)
    key = min(siblings)
    (rest if key in seen else first).append(core)
    seen.add(key)
  return first + rest


def thread_siblings(core: int) -> set[int] | None:
  """The hardware threads sharing `core`'s physical core (sysfs), or None if unknown."""
  path = f'/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list'
  try:
    with open(path) as f:
      return parse_core_list(f.read())
  except OSError:
    return None


def parse_core_list(text: str) -> set[int]:
  """'0-3,8' -> {0, 1, 2, 3, 8} (the kernel's cpu list format)."""
  cores = set()
  for part in text.strip().split(','):
    low, _, high = part.partition('-')
    cores.update(range(int(low), int(high or low) + 1))
  return cores


def placements(cores: list[int], count: int) -> dict[str, list[int]]:
  """`{placement: the first `count` cores}` for 'first' and, if it differs, 'spread'."""
  chosen = {'first': cores[:count]}
  spread = physical_order(cores)[:count]
  if sorted(spread) != sorted(chosen['first']):
    chosen['spread'] = spread
  return chosen


def worker(core: int, stage: str, args) -> None:
  """One process: pinned to `core`, builds and warms its task (`stage`: 'ddg:K:k' or
  'pdasgd:N:k', `stage_task`; '' the tanh layers), says 'ready', then for each line on
  stdin times `reps` calls and prints their seconds as JSON, until stdin ends."""
  os.sched_setaffinity(0, {core})  # before JAX starts its threads: they inherit it
  import time

  import jax

  run = stage_task(stage, args) if stage else tanh_task(core, args)
  for _ in range(args.warmup):
    jax.block_until_ready(run())
  print('ready', flush=True)
  while sys.stdin.readline():
    times = []
    for _ in range(args.reps):
      start = time.perf_counter()
      jax.block_until_ready(run())
      times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)


def tanh_task(seed: int, args):
  """A call of `--layers` dense tanh layers' forward and backward."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(seed), args.layers + 1)
  scale = args.features**-0.5
  weights = [
    jax.random.normal(k, (args.features, args.features), jnp.float32) * scale for k in keys[1:]
  ]
  inputs = jax.random.normal(keys[0], (args.batch, args.features), jnp.float32)

  def stage(weights, x):
    for w in weights:
      x = jnp.tanh(x @ w)
    return x

  @jax.jit
  def forward_backward(weights, x):
    out, pullback = jax.vjp(stage, weights, x)
    return pullback(out)  # any cotangent of the output's shape: the same work

  return lambda: forward_backward(weights, inputs)


def stage_task(stage: str, args):
  """A call of process k's share of `real_speedup`'s model (`stage_calls`), each task
  waited for."""
  import jax

  mine = stage_calls(stage, args)

  def run():
    for fn, fn_args in mine:
      out = jax.block_until_ready(fn(*fn_args))
    return out

  return run


def stage_calls(stage: str, args) -> list[tuple]:
  """Process k's tasks, `(jitted fn, args)` in order, of `real_speedup`'s model (its MLP
  of `--depth` hidden layers of 1024, `--features` inputs, `--batch`):
    'ddg:K:k'     DDG K's stage k: its forward, backward and update (K = 1: BP's)
    'local:K:k'   local K's stage k (`local.roles(K)`, as `real_speedup`'s local case:
                  an auxiliary head's loss on every stage but the last): the same three
    'pdasgd:N:k'  PD-ASGD 1:(N-1) (N = 1: BP): k = 0 the forward worker's forward of the
                  whole model and the update (applied by the shared model, on the forward
                  worker's core in `real_speedup`), k > 0 a backward worker's backward
  """
  from benchmarks import real_speedup
  from jaxsgd.algorithms import ddg, local
  from jaxsgd.pipeline.session import sequential_roles

  family, count, k = stage.split(':')
  count, k = int(count), int(k)
  real_speedup.set_shape(args.features, args.batch, args.depth)
  pipelines = {'ddg': ddg.roles, 'local': local.roles}
  roles = pipelines[family](count) if family in pipelines and count > 1 else sequential_roles(1)
  pipe = real_speedup.placed(roles, steps=1000)
  calls = pipe.task_calls(roles, next(real_speedup.batches()))
  if family in pipelines or count == 1:
    kinds, stage_index = ('forward', 'backward', 'update'), k
  else:
    kinds, stage_index = (('forward', 'update') if k == 0 else ('backward',)), 0
  return [calls[(stage_index, kind)] for kind in kinds]


class Together:
  """Processes pinned to `cores`, each with its task built and warm (`family` 'ddg',
  'local' or 'pdasgd': core i runs process i's share of it, `stage_task`; '': the tanh
  task); `time()` releases them together and returns each one's median call in seconds,
  as often as asked; `close()` (or leaving the context) ends them."""

  def __init__(self, cores: list[int], args, family: str = ''):
    command = [sys.executable, '-m', 'benchmarks.neighbour_contention', *shape_flags(args)]
    # A lane's environment (one XLA thread, no BLAS threads); imported here, in the parent
    # only: the module imports JAX, and a worker pins itself before JAX starts.
    from benchmarks.simulator_accuracy import LANE_ENV  # pylint: disable=g-import-not-at-top

    env = {**os.environ, 'JAX_PLATFORMS': 'cpu', **LANE_ENV}
    self.cores, self.processes = list(cores), []
    try:
      for i, core in enumerate(self.cores):
        stage = f'{family}:{len(self.cores)}:{i}' if family else ''
        self.processes.append(
          subprocess.Popen(
            [*command, f'--_worker={core}', f'--_stage={stage}'],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
          )
        )
      for process, core in zip(self.processes, self.cores):
        if process.stdout.readline().strip() != 'ready':  # (its error went to stderr)
          raise RuntimeError(f'neighbour_contention: the process on core {core} did not start.')
    except BaseException:
      self.close()
      raise

  def time(self) -> list[float]:
    for process in self.processes:  # released together: each times while the others do
      process.stdin.write('go\n')
      process.stdin.flush()
    return [statistics.median(json.loads(p.stdout.readline())) for p in self.processes]

  def close(self) -> None:
    for process in self.processes:
      process.kill()
      process.wait()
    self.processes = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


def run_together(cores: list[int], args, family: str = '') -> list[float]:
  """Each core's median call in seconds, all `cores` timing at once, once."""
  with Together(cores, args, family) as together:
    return together.time()


def pace(family: str, medians: list[float]) -> float:
  """Seconds per batch of processes running at once with these median calls: a pipeline
  (DDG, local) moves at its slowest stage's pace; PD-ASGD's backward workers (processes
  1..N-1) share the batches, so N-1 of them take one batch per (their call / (N-1)), and
  process 0 (forward and update) one per call."""
  if family == 'pdasgd' and len(medians) > 1:
    return max(medians[0], max(medians[1:]) / (len(medians) - 1))
  return max(medians)


def shape_flags(args) -> list[str]:
  return [
    f'--{name}={getattr(args, name)}'
    for name in ('layers', 'features', 'batch', 'depth', 'warmup', 'reps')
  ]


def per_core(medians: dict[int, float], alone: float) -> str:
  """'core:ms(ratio)' of each core, slowest marked: a pipeline runs at its slowest stage's
  pace, so one slow core bounds it where the median does not."""
  slowest = max(medians, key=medians.get)
  return ' '.join(
    f'{core}:{ms * 1e3:.1f}({ms / alone:.2f}){"*" if core == slowest else ""}'
    for core, ms in sorted(medians.items())
  )


def counts_or_error(parser, text: str, available: int) -> list[int]:
  try:
    counts = sorted({int(c) for c in text.split(',') if c.strip()})
  except ValueError:
    counts = []
  if not counts or counts[0] < 1 or counts[-1] > available:
    parser.error(f'--counts: comma-separated process counts in 1..{available}; got {text!r}')
  return counts


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--counts', default='1,2', help='process counts N, comma-separated')
  parser.add_argument('--stages', action='store_true', help="time real_speedup's DDG stages")
  parser.add_argument('--pdasgd', action='store_true', help="time PD-ASGD's workers' tasks")
  parser.add_argument('--layers', type=int, default=2, help='dense tanh layers of the task')
  parser.add_argument('--features', type=int, default=1024, help='inputs of each layer')
  parser.add_argument('--batch', type=int, default=256, help='rows of the batch')
  parser.add_argument('--depth', type=int, default=16, help="--stages: the MLP's hidden layers")
  parser.add_argument('--warmup', type=int, default=5, help='untimed calls first')
  parser.add_argument('--reps', type=int, default=40, help='timed calls of each process')
  parser.add_argument('--_worker', type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument('--_stage', default='', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for name in ('layers', 'features', 'batch', 'depth', 'warmup', 'reps'):
    if getattr(args, name) < 1:
      parser.error(f'--{name}: a positive integer; got {getattr(args, name)}')
  if args._worker is not None:
    return worker(args._worker, args._stage, args)
  cores = sorted(os.sched_getaffinity(0))
  counts = counts_or_error(parser, args.counts, len(cores))
  if args.stages and args.pdasgd:
    parser.error('--stages, --pdasgd: one of them (DDG or PD-ASGD), not both')
  family = 'ddg' if args.stages else 'pdasgd' if args.pdasgd else ''
  if family and counts[0] != 1:
    parser.error(
      f'--counts: with --{"stages" if args.stages else "pdasgd"}, 1 (BP alone, the '
      f'reference) and process counts; got {args.counts!r}'
    )
  model = f"real_speedup's MLP {args.features}-1024x{args.depth}-10, batch {args.batch}"
  task = {
    'ddg': f"{model}: DDG K's stage k on core k (K = 1: BP), forward + backward + update",
    'pdasgd': f'{model}: PD-ASGD 1:(N-1), forward + update on core 0, backward workers '
    '(backward) on the others (N = 1: BP)',
    '': f'{args.layers} x {args.features} tanh layers, batch {args.batch}, forward + backward',
  }[family]
  print(f'machine: {len(cores)} cores allowed, load average {os.getloadavg()[0]:.1f}; task: {task}')
  print(f'physical order: {",".join(map(str, physical_order(cores)))}')
  ratio = 'ceiling' if family else 'ratio'
  print(f'{"placement":<10}{"N":>4}{"cores":>22}{"median ms":>11}{"slowest ms":>12}{ratio:>9}')
  alone, last = None, None
  for count in counts:
    for name, chosen in placements(cores, count).items():
      medians = run_together(chosen, args, family)
      median, slowest = statistics.median(medians), max(medians)
      alone = alone or median
      shown = ','.join(map(str, chosen)) if count <= 6 else f'{chosen[0]}..{chosen[-1]} ({name})'
      figure = alone / pace(family, medians) if family else median / alone
      print(
        f'{name:<10}{count:>4}{shown:>22}{median * 1e3:>11.2f}{slowest * 1e3:>12.2f}{figure:>9.2f}'
      )
      last = (count, name, figure, dict(zip(chosen, medians)))
  print(f'each core at N = {last[0]} ({last[1]}), ms: ' + per_core(last[3], alone))
  if family == 'ddg':
    print(f"DDG K={last[0]}'s stages at once ({last[1]}): ceiling {last[2]:.2f}x over BP alone")
  elif family == 'pdasgd':
    print(
      f"PD-ASGD 1:{last[0] - 1}'s workers at once ({last[1]}): ceiling {last[2]:.2f}x over BP alone"
    )
  else:
    print(f'{last[0]} busy cores ({last[1]}): a task takes {last[2]:.2f}x its time alone')


if __name__ == '__main__':
  main()
