r"""Real speed-up over lane processes: staged BP on one pinned core vs DDG / local on K.

    python -m benchmarks.real_speedup                 # ~3 min on a loaded 2-core CPU
    python -m benchmarks.real_speedup --address HEAD_IP:6379   # lanes on a Ray cluster
    python -m benchmarks.real_speedup --lanes=8 --depth=16 --gpu  # K=8 on 8 cores; BP on a GPU

The same policies as training (`jaxsgd.pipeline`), on the real clock across processes
(`scheduler/process.py`), each lane an OS process pinned to its own core with XLA's
intra-op threads off:
  bp      staged BP, the whole model as one stage, on lane `stage0` (core 0)
  ddg     DDG K=2 (paper form), stages on `stage0` (core 0) and `stage1` (core 1)
  local   local parallelism K=2 (greedy, pipelined), same lanes
  asgd    ASGD with 2 workers: `server` and `worker0` on core 0, `worker1` on core 1;
          an iteration is one applied update (one batch's gradient, as for BP)
  pdasgd  PD-ASGD 1:1, the model in 2 layer groups whatever K (the store's per-layer
          update granularity, not its lanes): the shared model (whose lane applies
          the layer-wise updates) and the forward worker on core 0, the backward
          worker on core 1; an iteration is one batch's backward, applied
  lppsgd  LPP-SGD with 2 replicas of one worker each (`worker0.0` on core 0,
          `worker1.0` on core 1), averaged every 4 updates (`allreduce` on core 0); an
          iteration is one applied update
`--lanes=K` runs the same cases with K lanes on cores 0..K-1 (DDG and local K=K, ASGD with
K workers, PD-ASGD 1:(K-1) with its backward workers on cores 1..K-1, LPP-SGD with K
replicas); past the cores this process may use, lanes wrap round and share cores (a smoke
run of K=4 on 2 cores; `simulator_accuracy` refuses that instead). A split
into K stages needs at least K layers: `--depth` sets the hidden layers; `--families`
runs only some of the cases (bp always); `--driver_cores` pins every thread of the
driver (this process) to those cores once the lanes are up (default: where the OS puts
it, or by load with `--copies=auto`: below), to see what its dispatch takes from the lanes of the
cores it leaves (in every case, BP's too: on its lane's core it slows BP, and every
speed-up over it reads higher); `--moves=socket`
sends every value over the lanes' sockets, as the wire did before memory shared within a
host (`LaneSpec.moves`; run it alternately with the default to compare). A lane's copy
threads (the readers of its connections, its export thread) run beside its tasks on its
core unless moved: by default (`--copies=auto`) each case first runs once, not counted,
and then runs with the copy threads of its busiest core's lanes on its least busy core
where that core stays the less busy of the two (`placement.copies_toward_idle`, from each
lane's tasks' CPU and its copies' measured in that run; a line per case says what it
measured and moved): PD-ASGD 1:1's backward worker, its slowest lane, then leaves the copies of
the residuals it takes in and the gradients it sends to the core where the forward worker
waits. The driver's threads are placed by the same run (unless `--driver_cores` placed
them): pinned, for that case's counted runs, to its least busy cores where those stay
no busier than its busiest (`placement.driver_toward_idle`, from the driver's CPU per
iteration in that run; the line says where), e.g. beside PD-ASGD 1:1's forward worker.
`--copies=run` leaves it to each counted run's executor, as a training run on lane
processes does (`ProcessExecutor(copies='auto')`: placed once after a window of its first
tasks, a line per run says when and what; give it `--steps` and `--warmup` enough for the
placement to fall in the warm-up). `--copies=own` keeps every lane's on its own cores;
`--copies backwardworker0:0`
places that lane's on core 0 for every case (`LaneSpec.copy_cores`). `--gpu` adds,
after the CPU rounds, DDG K=2 with a GPU, in two pools of their own, each case
interleaved with BP on the pool's GPU lane (its ratio is over that, not over BP on a
core): both stages on the one GPU
(`stage0@gpu=0.5; stage1@gpu=0.5`, two processes sharing it, their values moved on the
device path), the same with `moves=host` (through host memory), and stage 0 on the GPU
with stage 1 on core 1 (`stage0@gpu=1; stage1@cores=1`). It is refused before any round where
the driver's host has no GPU in the Ray cluster.
`--no_executor` adds, in every round after the cases, DDG's, local's and PD-ASGD's tasks
(of those in `--families`) with no executor: K processes pinned to the cases' cores, each
built once and calling its stage's tasks (DDG, local) or its worker's (PD-ASGD: the
forward and the update on core 0, as its lanes place them, the backward on the others)
`steps - warmup` times, all at once and waiting for nothing from the others
(`neighbour_contention.Together`); the row's time per iteration is their pace
(`neighbour_contention.pace`), its speed-up over BP in the same round what the cores
give with no executor and no waits between the stages. A case below its no-executor
row lost the difference to its executor and to its schedule's waits.
`--traces DIR` writes each round's timeline of every case to DIR (`<case>-round<n>.json`,
which https://ui.perfetto.dev opens): where a case's time per iteration exceeds its
busiest lane's, the lanes' waits are in it. `--retime DIR` measures those traces again
(no run) and prints, per case and lane, the time between two of its tasks by their
kinds (`lane_gaps`: e.g. a stage's forward -> backward, where it waits for the gradient
from the stage after it), median and per iteration: with the lane's busy time, its
whole iteration.
The model is an MLP wide enough that a task (~tens of ms) dwarfs a dispatch (~1 ms);
the batches are synthetic, a cycle of a few made once (`batches`). Its inputs
(`--features`, 1472 by default) make the two stages that `split` cuts by forward FLOPs
(printed) cost about the same forward and backward (6.17 and 6.33 M multiply-adds an
example): a first stage computes no input gradient, so its backward is lighter than the
next stage's, and more inputs make it up (1024 would leave stage 0 with 5.25 of 6.33).
How close the two come in time depends on the CPU's kernels: on one CPU measured, 1536
inputs (closer in multiply-adds) left stage 0 ~10 % heavier, its first layer's weight
gradient slower per multiply-add; on another, 1472 left stage 1 ~10 % heavier and
1536-1792 balanced them; at 1696 the stage ceiling was 1.93-1.97× on both
(`benchmarks.stage_costs` times each task alone, per stage, beside its multiply-adds;
rerun it to check a machine; the figures: benchmarks/results/stage_costs.txt). Per case
the busiest lane's busy time per iteration is printed, with the part of it that was the
lane's own CPU (the rest: its cores ran its copies, the driver, Ray or another lane), and
BP's time over it: the case's ceiling as it ran, had nothing but that lane's tasks taken
time. Time per iteration: from the end of the
last update of
batch `--warmup` - 1 to that of the last batch every updating lane updated, over the
batches in between (compilation in the lanes is left out; DDG's stage 0 applies batch
`steps - K`'s gradient last, so DDG K=8 with 16 steps and 4 of warm-up is timed over 5
batches: give large K more steps), median over interleaved rounds; the speed-up is the median
over rounds of BP's time over the case's in the same round. Host time per task: the
driver's wall time in `LanePool.start` (and `early`) per dispatched task, and of it the
driver thread's CPU (the rest: waiting for a core, which the lanes take, and for the
lock of Python's interpreter); its median over the cases is printed as
`process executor host time per task: <x> µs` (before the last line; above it, the
driver's whole CPU per task from the first task of batch `--warmup` to the run's end,
every thread of its process: dispatch, hearing the lanes, the policy, its connections'
readers and writers;
`real_clock_overhead` prints the in-process real clock's). The limit on 2
cores is 2x; other jobs on the machine take their share of the cores (the load average
is printed). Not a test: speed is measured, not asserted.
"""

import argparse
import contextlib
import glob
import json
import os
import re
import statistics
import time
import types
from typing import NamedTuple

import jax

from benchmarks import common as bench_common
from benchmarks import neighbour_contention
from jaxsgd import models, optimizers
from jaxsgd.algorithms import asgd, ddg, local
from jaxsgd.asynchronous import common, lppsgd, pdasgd, server
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles
from jaxsgd.scheduler import Placement
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.lanes import placement as placement_lib
from jaxsgd.scheduler.lanes import cluster, runtime
from jaxsgd.scheduler.process import ProcessExecutor
from jaxsgd.scheduler.timeline import Timeline

WIDTH = 1024  # of every hidden layer
FEATURES, CLASSES, HIDDEN, BATCH = 1472, 10, (WIDTH,) * 4, 512
OPTIMIZER = optimizers.OptimizerSettings('sgd', 0.01)
# `--gpu`: (case name, placement) of DDG K=2 with a GPU, each with BP on its `stage0`
GPU_CASES = (
  ('ddg K=2 (both stages on the GPU)', LanePlacement.parse('stage0@gpu=0.5; stage1@gpu=0.5')),
  (  # the same with its values moved through host memory, as before the device path
    'ddg K=2 (both stages on the GPU, moves=host)',
    LanePlacement.parse('stage0@gpu=0.5@moves=host; stage1@gpu=0.5@moves=host'),
  ),
  ('ddg K=2 (stage 0 GPU, stage 1 core 1)', LanePlacement.parse('stage0@gpu=1; stage1@cores=1')),
)
FAMILIES = ('ddg', 'local', 'asgd', 'pdasgd', 'lppsgd')
# Printed above the tables of a run with `--copies` (`speedup_chart` reads it: its lanes
# are placed otherwise than the default's).
COPIES_APART = 'copy threads apart:'
# `--copies`' words: each case's lanes' copy threads placed by the load a first round
# measured (`copies_by_load`; the default), every lane's on its own cores, or placed by
# each run's executor as it runs (`ProcessExecutor(copies='auto')`, as a training run
# does); and the line the first prints above the tables (`speedup_chart` reads it).
BY_LOAD, OWN, RUN, BY_LOAD_LINE = 'auto', 'own', 'run', 'copy threads by load'
WORDS, WORDS_TEXT = (BY_LOAD, OWN, RUN), f'{BY_LOAD}, {OWN} or {RUN}'
EXECUTOR = {'copies': 'own'}  # every case's `ProcessExecutor`'s (`--copies=run`: 'auto')


def batches(seed: int = 0):
  """The cases' synthetic batches: a cycle of a few made once (`cycled_batches`)."""
  return bench_common.cycled_batches((FEATURES,), CLASSES, BATCH, seed=seed)


def placed(roles, steps: int) -> PlacedStages:
  num = len(roles)
  model = mlp()
  return PlacedStages(
    model,
    num,
    optimizers.make_optimizer(OPTIMIZER, steps),
    placement=Placement.create(num, jax.devices()),
    batch_size=BATCH,
    aux_heads=any(r.loss == 'aux' for r in roles),
    optimizer=(OPTIMIZER, steps),
  )


def mlp():
  """The benchmark's model: `FEATURES` inputs, the `HIDDEN` layers, `CLASSES` outputs."""
  return models.get_model('mlp', (FEATURES,), CLASSES, hidden=HIDDEN)


def split_balance(num_stages: int) -> str:
  """The K-stage split's stages in forward FLOPs (XLA's count, what `split` balances)."""
  from jaxsgd.models.split import balanced_boundaries

  costs = mlp().layer_costs()
  stages = [sum(costs[a:b]) for a, b in balanced_boundaries(costs, num_stages)]
  shares = ' : '.join(f'{c / 1e6:.2f}' for c in stages)
  return f'K={num_stages} split: {shares} forward MFLOP per example'


# The last run's timeline and the `time.time()` its times count from, for a benchmark
# that reads more of it (`benchmarks.lane_overheads`).
LAST_RUN: dict = {}


def counted_executor(pool: LanePool, warmup: int, **kwargs) -> ProcessExecutor:
  """A case's executor: quiet, `EXECUTOR`'s copies, its driver CPU counted from batch
  `warmup` on (`steady_from_batch`)."""
  return ProcessExecutor(pool=pool, verbose=False, steady_from_batch=warmup, **EXECUTOR, **kwargs)


def measured(executor: ProcessExecutor, timeline, warmup: int):
  """`run`'s figures of a finished run (its executor's `steady_from_batch` set to
  `warmup`)."""
  # (lanes: the timeline's lane -> the pool's, for `copies_by_load`)
  LAST_RUN.update(
    timeline=timeline,
    t0=executor._t0,  # pylint: disable=protected-access
    lanes=dict(executor._lane_names),  # pylint: disable=protected-access
    copies=executor.copies_by_load,
    driver_cpu=executor.steady_cpu_seconds,  # (from batch `warmup` on: `copies_by_load`)
  )
  return (
    per_iteration(timeline, warmup),
    executor.dispatch_seconds / executor.dispatched,
    *busiest_lane(timeline, warmup),
    executor.dispatch_cpu_seconds / executor.dispatched,
    executor.driver_cpu_per_task(),  # (`warmup` < `steps`: a task of batch `warmup` ran)
  )


BP_TRACE = 'bp-1-lane-core-0'  # `write_trace`'s name of BP's case on a core


def write_trace(folder: str, case: str, round_: int) -> None:
  """The last run's timeline as `<case>-round<round_>.json` in `folder` (Perfetto opens
  it; times from the start of the run), `case` in a file name's letters; `cases.json`
  there maps those names back to the cases'."""
  os.makedirs(folder, exist_ok=True)
  name = re.sub(r'[^A-Za-z0-9]+', '-', case).strip('-')
  LAST_RUN['timeline'].write_chrome_trace(os.path.join(folder, f'{name}-round{round_}.json'))
  names = {**trace_names(folder), name: case}  # (read before the file is opened anew)
  with open(os.path.join(folder, 'cases.json'), 'w') as f:
    json.dump(names, f, indent=1)


def trace_names(folder: str) -> dict[str, str]:
  """`write_trace`'s file names in `folder` -> the cases' names (none if it wrote none)."""
  index = os.path.join(folder, 'cases.json')
  if not os.path.exists(index):
    return {}
  with open(index) as f:
    return json.load(f)


def print_cases(header: tuple, rows: list) -> None:
  """A table of cases, left-aligned, as `speedup_chart` reads it (a case's name first)."""
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def retime(folder: str, warmup: int) -> None:
  """Prints the CPU cases' figures measured again from the timelines that `--traces`
  wrote to `folder` (their rounds paired with BP's on core 0, as a run pairs them), with
  this module's windows as they are now, then their lanes' gaps (`print_gaps`); `--gpu`'s
  cases are left out."""
  runs: dict[str, dict[int, Timeline]] = {}
  for path in sorted(glob.glob(os.path.join(folder, '*-round*.json'))):
    case, round_ = re.fullmatch(r'(.*)-round(\d+)\.json', os.path.basename(path)).groups()
    with open(path) as f:
      runs.setdefault(case, {})[int(round_)] = Timeline.from_chrome_trace(json.load(f))
  if BP_TRACE not in runs:
    raise SystemExit(f'--retime: no {BP_TRACE}-round<n>.json in {folder}')
  names = trace_names(folder)
  bp = {n: per_iteration(t, warmup) for n, t in runs[BP_TRACE].items()}
  rows, speedups = [], {}
  for case, rounds in runs.items():
    if 'GPU' in names.get(case, case):  # paired with BP on its pool's GPU lane in a run
      continue
    seconds = {n: per_iteration(t, warmup) for n, t in rounds.items()}
    busy = {n: busiest_lane(t, warmup)[0] for n, t in rounds.items()}
    paired = sorted(set(seconds) & set(bp))
    speedups[case] = statistics.median(bp[n] / seconds[n] for n in paired)
    ceiling = statistics.median(bp[n] / busy[n] for n in paired)
    rows.append(
      (
        names.get(case, case),
        f'{1e3 * statistics.median(seconds.values()):.1f}',
        f'{speedups[case]:.2f}',
        f'{1e3 * statistics.median(busy.values()):.1f}',
        f'{ceiling:.2f}',
        ' '.join(f'{1e3 * seconds[n]:.1f}' for n in sorted(seconds)),
      )
    )
  header = ('case', 'ms / iteration', 'speed-up over bp', 'busiest lane ms / it', 'ceiling')
  print_cases((*header, 'rounds (ms)'), rows)
  timed = {names.get(case, case): runs[case] for case in speedups}  # (the CPU cases)
  print_gaps(timed, warmup)
  ddg_case = next((case for case in speedups if case.startswith('ddg')), None)
  if ddg_case is not None:
    name = names.get(ddg_case, ddg_case)
    print(f'ddg real speed-up (retimed from {name}): {speedups[ddg_case]:.2f}')


class Gap(NamedTuple):
  """A lane's idle time between two of its tasks (`lane_gaps`): `seconds` inside the
  window; `dry`, whether the driver sent the next task's call only after the task before
  had ended, so that the lane had no call queued and waited for the driver (None where the
  timeline does not say when it was sent: a virtual clock's without a driver)."""

  seconds: float
  dry: bool | None


def lane_gaps(timeline, warmup: int) -> tuple[dict, int]:
  """(gaps, iterations): each compute lane's idle time between its tasks over
  `steady_window`, `{lane name: {(kind before, kind after): [Gap, ...]}}`, and the
  iterations. A gap runs from the latest end of the lane's tasks so far (`before`, the
  task that ended then) to the next start (`after`); only its part inside the window
  counts, and a gap with none there is left out. A lane runs one task at a time, so its
  gaps and its busy time (`lane_times`) add up to the window where it has a task at both
  edges: the gaps are where it waited for an input, for its own hand-over between two
  calls, or — dry — for its next call (the run-ahead bound: `scheduler/process.py`)."""
  start, end, iterations = steady_window(timeline, warmup)
  gaps: dict[str, dict[tuple[str, str], list[Gap]]] = {}
  for lane, name in enumerate(timeline.lane_names):
    if name.startswith('link '):
      continue
    before = None
    for after in timeline.tasks(lane=lane):
      if before is not None:
        inside = bench_common.overlap(before.end, after.start, start, end)
        dry = None if after.dispatched is None else after.dispatched > before.end
        if inside > 0:
          gaps.setdefault(name, {}).setdefault((before.kind, after.kind), []).append(
            Gap(inside, dry)
          )
      if before is None or after.end > before.end:
        before = after
  return gaps, iterations


def print_gaps(runs: dict[str, dict[int, Timeline]], warmup: int) -> None:
  """A table of `lane_gaps` by case, lane and the kinds of the two tasks, over every
  round of `runs` (`{case: {round: timeline}}`): how many gaps (of some length inside the
  window), their median, their sum per iteration and that of the dry ones among them
  ('-' where the timelines do not say; all rounds' gaps over all rounds' iterations)."""
  rows = []
  for case, rounds in runs.items():
    pooled: dict[tuple[str, str, str], list[Gap]] = {}
    iterations = 0
    for timeline in rounds.values():
      gaps, count = lane_gaps(timeline, warmup)
      iterations += count
      for lane, pairs in gaps.items():
        for (before, after), found in pairs.items():
          pooled.setdefault((lane.split(' (')[0], before, after), []).extend(found)
    for (lane, before, after), found in sorted(pooled.items()):
      seconds = [gap.seconds for gap in found]
      known = [gap for gap in found if gap.dry is not None]
      dry = sum(gap.seconds for gap in known if gap.dry)
      rows.append(
        (
          case,
          lane,
          f'{before} -> {after}',
          str(len(found)),
          f'{1e3 * statistics.median(seconds):.2f}',
          f'{1e3 * sum(seconds) / iterations:.2f}',
          f'{1e3 * dry / iterations:.2f}' if known else '-',
        )
      )
  print("between two tasks of a lane, in the steady window (its rounds' gaps pooled):")
  header = ('case', 'lane', 'tasks', 'gaps', 'median ms', 'ms / iteration', 'of it dry')
  print_cases(header, rows)


def lane_times(timeline, warmup: int) -> tuple[dict, dict, set, int]:
  """(busy, cpu, unknown, iterations) over `steady_window`: each compute lane's busy
  seconds and its tasks' own CPU seconds (a task's `cpu`: its process's, less its copy
  threads'), by timeline lane; the lanes with a task inside of unknown cpu; the
  iterations. A task's share inside the window counts in proportion."""
  start, end, iterations = steady_window(timeline, warmup)
  busy, cpu, unknown = {}, {}, set()
  for task in timeline.records:
    if not timeline.lane_names[task.lane].startswith('link '):
      inside = bench_common.overlap(task.start, task.end, start, end)
      busy[task.lane] = busy.get(task.lane, 0.0) + inside
      if inside > 0 and task.cpu is None:
        unknown.add(task.lane)
      elif inside > 0:
        share = task.cpu * inside / (task.end - task.start)
        cpu[task.lane] = cpu.get(task.lane, 0.0) + share
  return busy, cpu, unknown, iterations


def busiest_lane(timeline, warmup: int) -> tuple[float, float]:
  """Busy seconds per iteration of the busiest compute lane over `steady_window` (what the
  case would take if nothing but its lanes' work took time: its ceiling is BP's time over
  this), and of them the seconds of that lane's own CPU (`lane_times`; the rest its cores
  ran something else — the lane's copies, the driver, Ray, a neighbour lane — or it
  waited)."""
  busy, cpu, unknown, iterations = lane_times(timeline, warmup)
  lane = max(busy, key=busy.get)
  own = float('nan') if lane in unknown else cpu.get(lane, 0.0)
  return busy[lane] / iterations, own / iterations


def steady_window(timeline, warmup: int) -> tuple[float, float, int]:
  """(start, end, iterations): from the end of the last update of batch `warmup - 1` to
  that of the last batch updated on every updating lane (`bench_common.update_ends`:
  DDG K's stage 0 applies batch `steps - K`'s gradient last), and the batches between."""
  ends = bench_common.update_ends((t.lane, t.batch, t.end) for t in timeline.tasks(kind='update'))
  last = max(ends)
  if warmup - 1 not in ends or last <= warmup - 1:
    raise ValueError(
      f'no iteration after the warm-up: every updating lane updated batches up to {last}, '
      f'the warm-up ends at batch {warmup - 1}; run more steps'
    )
  return ends[warmup - 1], ends[last], last - (warmup - 1)


def per_iteration(timeline, warmup: int) -> float:
  """Seconds per iteration over `steady_window`."""
  start, end, iterations = steady_window(timeline, warmup)
  return (end - start) / iterations


def run(pool: LanePool, case, steps: int, warmup: int) -> tuple[float, ...]:
  """(seconds per iteration after `warmup` batches, driver seconds per dispatched task,
  busy seconds per iteration of the busiest lane and of them its own CPU's, the driver
  thread's CPU seconds per dispatched task, and the driver process's per task dispatched
  from batch `warmup` on: `ProcessExecutor.steady_cpu_seconds`). `case`: stage roles, or
  `(family, K)` of an asynchronous family."""
  if isinstance(case[0], str):
    family, lanes = case
    return {'asgd': run_asgd, 'pdasgd': run_pdasgd, 'lppsgd': run_lppsgd}[family](
      pool, lanes, steps, warmup
    )
  stages = placed(case, steps)
  feed = BatchFeed(batches(), 1 + sum(r.loss != 'none' for r in case))
  session = stages.session(case, feed, steps, host_batches=True)  # lanes take numpy
  executor = counted_executor(pool, warmup)
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, warmup)


def run_asgd(
  pool: LanePool, num_workers: int, steps: int, warmup: int
) -> tuple[float, float, float]:
  """ASGD (`jaxsgd.asynchronous.server`) with every function a named task."""
  stages = placed(sequential_roles(1), steps)
  settings = server.ServerSettings(num_workers)
  params = stages.initial_variables(0, sequential_roles(1)[0])['params']
  tx = optimizers.make_optimizer(
    OPTIMIZER, steps, gradient_transforms=server.server_gradient_transforms(settings)
  )
  device = jax.devices()[0]
  ps = server.ParameterServer(
    tx,
    params,
    num_workers,
    device,
    record_pulls=False,
    apply_fn=server.named_apply(OPTIMIZER, steps, settings),
  )
  executor = counted_executor(pool, warmup, run_ahead=asgd.RUN_AHEAD)  # as experiments.train
  names = [f'worker {m}' for m in range(num_workers)]
  session = server.AsgdSession(
    stages,
    ps,
    {},
    [batches(seed=m) for m in range(num_workers)],
    [device] * (1 + num_workers),
    common.StepCounter(steps),
    common.WorkerLog(names, {}, executor.now),
  )
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, warmup)


def run_pdasgd(pool: LanePool, lanes: int, steps: int, warmup: int) -> tuple[float, float, float]:
  """PD-ASGD (`jaxsgd.asynchronous.pdasgd`), one forward and `lanes - 1` backward workers
  (a backward costs about twice a forward), the default bound of `lanes` batches in
  flight; updates on the shared model's lane."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=lanes - 1, updates='layer')
  executor = counted_executor(pool, warmup)
  session = pdasgd.PdSession(
    placed(sequential_roles(2), steps),
    settings,
    [batches()],
    [jax.devices()[0]] * (1 + lanes),
    common.StepCounter(steps),
    common.WorkerLog([pdasgd.worker_name(settings, w) for w in range(lanes)], {}, executor.now),
    lane_processes=True,
  )
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, warmup)


def run_lppsgd(pool: LanePool, lanes: int, steps: int, warmup: int) -> tuple[float, float, float]:
  """LPP-SGD (`jaxsgd.asynchronous.lppsgd`), `lanes` replicas of one worker, averaged
  every 4."""
  settings = lppsgd.LppSettings(devices=lanes, workers_per_device=1, averaging_freq=4)
  stages = placed(sequential_roles(1), steps)
  variables = stages.initial_variables(0, sequential_roles(1)[0])
  executor = counted_executor(pool, warmup)
  session = lppsgd.LppSession(
    stages,
    settings,
    variables,
    stages.tx.init(variables['params']),
    [batches(seed=d) for d in range(lanes)],
    [jax.devices()[0]] * lanes,
    common.StepCounter(steps),
    common.WorkerLog([f'worker {d}.0' for d in range(lanes)], {}, executor.now),
    lane_processes=True,
  )
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, warmup)


def cores_label(lanes: int) -> str:
  """The cores of a case's name: '0, 1' up to four lanes, else '0-7'."""
  return ', '.join(map(str, range(lanes))) if lanes <= 4 else f'0-{lanes - 1}'


def cases(lanes: int, families=FAMILIES) -> dict:
  """Each case's name and what `run` takes: stage roles, or `(family, K)`; bp and those
  of `families`."""
  cores = cores_label(lanes)
  every = {
    'bp': ('bp (1 lane, core 0)', sequential_roles(1)),
    'ddg': (f'ddg K={lanes} (cores {cores})', ddg.roles(lanes)),
    'local': (f'local K={lanes} (cores {cores})', local.roles(lanes)),
    'asgd': (f'asgd M={lanes} (cores {cores})', ('asgd', lanes)),
    'pdasgd': (f'pdasgd 1:{lanes - 1} (cores {cores})', ('pdasgd', lanes)),
    'lppsgd': (f'lppsgd D={lanes} (cores {cores})', ('lppsgd', lanes)),
  }
  return dict(every[family] for family in ('bp', *families))


def milliseconds(seconds) -> str:
  """Each round's time per iteration, in ms to three figures."""
  return ' '.join(f'{1e3 * t:.1f}' if t < 0.1 else f'{1e3 * t:.0f}' for t in seconds)


def no_executor_cases(lanes: int, families, steps: int, warmup: int, stack) -> dict:
  """`{name: (family, Together)}`: for DDG, local and PD-ASGD among `families`, their K
  processes' tasks on the cores their lanes use, built and warm, with no executor
  (`neighbour_contention.Together`, ended with `stack`): each round times `steps -
  warmup` calls of each at once; the case's time per iteration is their pace
  (`neighbour_contention.pace`)."""
  shape = types.SimpleNamespace(
    layers=1, features=FEATURES, batch=BATCH, depth=len(HIDDEN), warmup=3, reps=steps - warmup
  )
  cores = sorted(os.sched_getaffinity(0))
  mine = [cores[k % len(cores)] for k in range(lanes)]
  # Each named as its case is, `no executor` before its cores.
  names = {
    family: list(cases(lanes, (family,)))[-1].replace(' (cores', ' no executor (cores')
    for family in ('ddg', 'local', 'pdasgd')
    if family in families
  }
  return {
    name: (family, stack.enter_context(neighbour_contention.Together(mine, shape, family)))
    for family, name in names.items()
  }


def lane_placement(
  lanes: int, families=FAMILIES, moves: str = 'auto', copies: dict[str, str] | None = None
) -> LanePlacement:
  """The lanes of bp and of `families`' cases (`common.family_lanes`), lane k on the k-th
  core this process may use, round-robin: past the machine's cores, lanes share cores (a
  smoke run of K=4 on 2). No lane of a family not run: idle, a process still takes memory
  and start-up time, and its Ray threads wake on the cores the cases time. Every lane's
  values take the path `moves` (`LaneSpec.moves`); a lane named in `copies` has its copy
  threads on those cores (`LaneSpec.copy_cores`: `{'backwardworker0': '0'}`)."""
  cores = sorted(os.sched_getaffinity(0))
  core = lambda k: cores[k % len(cores)]
  # (ddg and local run on bp's stage lanes; `parse` refuses a name given twice)
  families = ('bp', *(f for f in ('asgd', 'pdasgd', 'lppsgd') if f in families))
  entries = [entry for f in families for entry in bench_common.family_lanes(f, lanes, core)]
  names, copies = [entry.split('@')[0] for entry in entries], copies or {}
  unknown = sorted(set(copies) - set(names))
  if unknown:
    raise ValueError(
      f'--copies: no lane {", ".join(unknown)} in these cases; their lanes: {", ".join(names)}'
    )
  entries = [
    f'{entry}@moves={moves}' + (f'@copies={copies[name]}' if name in copies else '')
    for entry, name in zip(entries, names)
  ]
  return LanePlacement.parse('; '.join(entries))


def placement_or_error(
  parser, lanes: int, families, moves: str, copies_text: str, words: bool = False
):
  """`lane_placement` with `--copies` read from `copies_text` (`copies_or_error`; with
  `words`, `WORDS` too, which place none apart at start), and the copies; bad input
  refused in one line by `parser`."""
  if words and copies_text.strip() in WORDS:
    copies = {}
  else:
    copies = copies_or_error(parser, copies_text, words)
  try:
    return lane_placement(lanes, families, moves, copies), copies
  except ValueError as error:
    parser.error(str(error))


def copies_or_error(parser, text: str, words: bool = False) -> dict[str, str]:
  """`--copies`: `lane:cores` entries, `;`-separated, the cores of this process (the
  error names `WORDS` too where `words` allows them)."""
  allowed, copies = set(os.sched_getaffinity(0)), {}
  for entry in filter(None, (e.strip() for e in text.split(';'))):
    lane, _, cores = entry.partition(':')
    try:
      numbers = {int(c) for c in cores.split(',')}
    except ValueError:
      numbers = set()
    if not lane or not numbers or not numbers <= allowed:
      parser.error(
        f'--copies: lane:cores entries separated by ";", the cores among '
        f'{",".join(map(str, sorted(allowed)))}{f", or {WORDS_TEXT}" * words}; '
        f'got {entry!r}'
      )
    copies[lane] = cores
  return copies


def copies_by_load(pool: LanePool, cases_: dict, steps: int, warmup: int, driver: bool) -> dict:
  """`--copies=auto`: `{case name: ({lane: cores}, driver cores)}`, where each case's
  lanes' copy threads are to run while it runs (`placement.copies_toward_idle`; a lane
  not named keeps them on its own cores) and where the driver's threads are (with
  `driver`: `placement.driver_toward_idle`, over the lanes of its host; None: where the
  OS puts them), from one run of the case, not counted: each lane's tasks' own CPU per
  iteration after the warm-up (`lane_times`), its copy threads' per step over the run
  (`LanePool.copy_cpu`: the lane's total, read before and after), the driver's per
  iteration after the warm-up (every thread of it). Prints a line per case, with its wall
  time per iteration (`per_iteration`)."""
  print(f'{BY_LOAD_LINE} (from a round first, not counted):', flush=True)
  placed, names, allowed = {}, pool.placement.names, tuple(sorted(os.sched_getaffinity(0)))
  for name, case in cases_.items():
    before = {lane: pool.copy_cpu(lane) for lane in names}
    run(pool, case, steps, warmup)
    timeline = LAST_RUN['timeline']
    _, cpu, _, iterations = lane_times(timeline, warmup)
    lanes = LAST_RUN['lanes']  # (timeline lane -> pool lane)
    loads = {
      lanes[i]: (cpu.get(i, 0.0) / iterations, (pool.copy_cpu(lanes[i]) - before[lanes[i]]) / steps)
      for i in lanes
    }
    cores = {lane: pool.placement[lane].cores for lane in loads}
    period = per_iteration(timeline, warmup)
    moved = placement_lib.copies_toward_idle(loads, cores)
    line = describe_loads(loads, cores, moved)
    pinned = None
    if driver:
      here = {lane: load for lane, load in loads.items() if pool.on_driver_host(lane)}
      used = LAST_RUN['driver_cpu'] / iterations
      pinned = placement_lib.driver_toward_idle(here, cores, moved, used, allowed)
      line += '; ' + placement_lib.describe_driver_load(used, pinned, (1e3, 1, 'ms'))
    placed[name] = (moved, pinned)
    print(f'  {name}, {1e3 * period:.1f} ms an iteration: {line}')
  return placed


def describe_loads(loads: dict, cores: dict, moved: dict) -> str:
  """'stage0 on 0: 80.1 + 4.0 ms, ...; copies of stage1 to 0' (tasks + copies a step)."""
  return placement_lib.describe_copy_loads(loads, cores, moved, (1e3, 1, 'ms'))


def describe_run_copies(measured, timeline) -> str:
  """`--copies=run`: what a run's executor measured and moved, and when (`copy_load.
  CopiesByLoad`; the batch: the last that a task had begun on by then)."""
  if measured.placed_at is None:
    return 'not placed (no window filled before the run ended)'
  begun = [
    r.batch for r in timeline.records if r.start <= measured.placed_at and r.batch is not None
  ]
  return f'at batch {max(begun, default=0)}: {measured}'


def place_copies(pool: LanePool, wanted: dict, current: dict) -> None:
  """Moves the copy threads of each lane whose place in `current` (lane -> cores, None:
  its own) is not the one in `wanted` (a lane not named: its own), and notes it."""
  for lane in pool.placement.names:
    cores = wanted.get(lane)
    if current.get(lane) != cores:
      pool.place_copies(lane, cores)
      current[lane] = cores


def driver_cores_or_error(parser, text: str) -> tuple[int, ...]:
  """`--driver_cores`: () if empty, else cores this process may use."""
  allowed = sorted(os.sched_getaffinity(0))
  try:
    cores = tuple(sorted({int(c) for c in text.split(',') if c.strip()}))
  except ValueError:
    cores = None
  if cores is None or not set(cores) <= set(allowed):
    parser.error(
      f'--driver_cores: comma-separated cores of {", ".join(map(str, allowed))}; got {text!r}'
    )
  return cores


def set_shape(features: int, batch: int, depth: int) -> None:
  """The model's inputs, the batch and the hidden layers (of the default width) for what
  follows (`mlp`, `batches`, `placed`): `--features`, `--batch`, `--depth`; also in the
  worker processes of `neighbour_contention`, which build the same tasks."""
  global FEATURES, BATCH, HIDDEN
  FEATURES, BATCH, HIDDEN = features, batch, (WIDTH,) * depth


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--warmup', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--address', default=None, help='a Ray cluster (default: start one here)')
  parser.add_argument('--features', type=int, default=FEATURES, help='inputs of the MLP')
  parser.add_argument('--batch', type=int, default=BATCH, help='examples per batch')
  parser.add_argument(
    '--lanes', type=int, default=2, help='K: lanes of each case, on the first K cores allowed'
  )
  parser.add_argument('--depth', type=int, default=len(HIDDEN), help='hidden layers (1024 wide)')
  parser.add_argument(
    '--families', default=','.join(FAMILIES), help=f'cases besides bp, of {",".join(FAMILIES)}'
  )
  parser.add_argument('--gpu', action='store_true', help='also DDG K=2 with a GPU (see above)')
  parser.add_argument(
    '--no_executor',
    action='store_true',
    help="also DDG's, local's and PD-ASGD's tasks on their cores at once, no executor (see above)",
  )
  parser.add_argument(
    '--driver_cores', default='', help='comma-separated cores for the driver (see above)'
  )
  parser.add_argument(
    '--moves',
    default='auto',
    choices=('auto', 'host', 'socket'),
    help="the CPU lanes' values: auto (= host: shared memory within the host), or socket",
  )
  parser.add_argument(
    '--copies',
    default=BY_LOAD,
    help=f"{BY_LOAD} (placed by load), {OWN} (each lane's on its cores), {RUN} (placed by "
    "each run's executor, as a training run's) or lane:cores[;...]: those lanes' copy "
    'threads on those cores (see above)',
  )
  parser.add_argument(
    '--traces',
    default='',
    help="a folder to write each round's timeline of every case to (Chrome trace JSON)",
  )
  parser.add_argument(
    '--retime',
    default='',
    help='measure the traces that --traces wrote to this folder again (no run)',
  )
  args = parser.parse_args()
  if args.retime:
    retime(args.retime, args.warmup)
    return
  driver_cores = driver_cores_or_error(parser, args.driver_cores)
  families = tuple(f.strip() for f in args.families.split(',') if f.strip())
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown or 'ddg' not in families:
    parser.error(
      f'--families: a comma-separated list of {", ".join(FAMILIES)} with ddg (the last '
      f'line is its speed-up); got {args.families!r}'
    )
  if args.lanes < 2:
    parser.error(f'--lanes: lanes per case, at least 2; got {args.lanes}')
  if args.steps < args.warmup + args.lanes:  # `steady_window`: DDG's stage 0 ends at steps-K
    parser.error(
      f'--steps: at least --warmup + --lanes ({args.warmup + args.lanes}: DDG K={args.lanes} '
      f'updates every stage up to batch steps - K); got {args.steps}'
    )
  if args.depth + 1 < args.lanes:
    parser.error(
      f'--depth: hidden layers; {args.lanes} stages need at least {args.lanes - 1}, '
      f'got {args.depth}'
    )
  by_load = args.copies.strip() == BY_LOAD
  if args.copies.strip() == RUN:
    EXECUTOR['copies'] = 'auto'
  placement, copies = placement_or_error(  # (before anything compiles)
    parser, args.lanes, families, args.moves, args.copies, words=True
  )
  set_shape(args.features, args.batch, args.depth)
  cases_ = cases(args.lanes, families)
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'jax {jax.__version__}; MLP {FEATURES}-{"-".join(map(str, HIDDEN))}-{CLASSES}, '
    f'batch {BATCH}, {args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds'
  )
  print(split_balance(args.lanes))
  if copies:
    apart = ', '.join(f'{lane} on {cores}' for lane, cores in copies.items())
    print(f'{COPIES_APART} {apart}')
  times, host, busiest, busiest_cpu, host_cpu, driver = {}, {}, {}, {}, {}, {}

  copies_placed, copies_now = {}, {}  # `--copies=auto`: by case; where they are now
  driver_allowed = tuple(sorted(os.sched_getaffinity(0)))  # (`--driver_cores`: set below)

  def record(name, case, pool):
    pinned = None
    if name in copies_placed:  # (`--copies=auto`; not the GPU cases' pools)
      moved, pinned = copies_placed[name]
      place_copies(pool, moved, copies_now)
    if pinned is not None:  # (for this case's run only)
      runtime.pin_threads(pinned)
    try:
      seconds, dispatch, busy, busy_cpu, dispatch_cpu, driver_cpu = run(
        pool, case, args.steps, args.warmup
      )
    finally:
      if pinned is not None:
        runtime.pin_threads(driver_allowed)
    if LAST_RUN['copies'] is not None:  # (`--copies=run`)
      print(f'  {name}: {describe_run_copies(LAST_RUN["copies"], LAST_RUN["timeline"])}')
    times.setdefault(name, []).append(seconds)
    host.setdefault(name, []).append(dispatch)
    busiest.setdefault(name, []).append(busy)
    busiest_cpu.setdefault(name, []).append(busy_cpu)
    host_cpu.setdefault(name, []).append(dispatch_cpu)
    driver.setdefault(name, []).append(driver_cpu)
    if args.traces:
      write_trace(args.traces, name, len(times[name]))

  reference = {name: 'bp (1 lane, core 0)' for name in cases_}  # whose rounds a case pairs with

  def record_unexecuted(name, family, together):
    times.setdefault(name, []).append(neighbour_contention.pace(family, together.time()))

  with contextlib.ExitStack() as stack:  # (the no-executor processes end with it)
    unexecuted = {}
    if args.no_executor:
      print('no-executor processes: starting...', flush=True)
      unexecuted = no_executor_cases(args.lanes, families, args.steps, args.warmup, stack)
      reference.update({name: 'bp (1 lane, core 0)' for name in unexecuted})
    pool = stack.enter_context(LanePool(placement, address=args.address))
    if driver_cores:  # after the lanes started: they inherit no affinity from the driver
      driver_allowed = runtime.pin_process(driver_cores)
      print(f'driver pinned to cores {", ".join(map(str, driver_cores))}')
    if args.gpu:  # refused now, not after the CPU rounds
      try:
        for _, gpu_placement in GPU_CASES:
          cluster.check_gpus(gpu_placement.lanes)
      except ValueError as error:
        parser.error(f'--gpu: {error}')
    if by_load:  # (the driver too, unless `--driver_cores` placed it)
      placed = copies_by_load(pool, cases_, args.steps, args.warmup, driver=not driver_cores)
      copies_placed.update(placed)
    for _ in range(args.rounds):  # interleaved: every case once per round
      for name, case in cases_.items():
        record(name, case, pool)
      for name, (family, together) in unexecuted.items():
        record_unexecuted(name, family, together)
  for name, gpu_placement in GPU_CASES if args.gpu else ():  # pools of their own
    bp_name = f'bp (1 lane, GPU) beside {name[len("ddg K=2 ") :]}'
    reference.update({bp_name: bp_name, name: bp_name})
    with LanePool(gpu_placement, address=args.address) as pool:
      for _ in range(args.rounds):
        record(bp_name, sequential_roles(1), pool)
        record(name, ddg.roles(2), pool)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  header = (
    'case',
    'ms / iteration',
    'speed-up over bp',
    'busiest lane ms / it',
    'its CPU',
    'ceiling',
    'host ms / task',
    'of it CPU',
    'driver CPU ms / task',
    'rounds (ms)',
  )
  rows, speedups = [], {}
  for name in times:
    median = statistics.median(times[name])
    bp = times[reference[name]]
    # Paired: bp and this case ran in the same round, so they saw about the same load.
    speedups[name] = statistics.median(b / t for b, t in zip(bp, times[name]))
    if name in unexecuted:  # no lanes: nothing but the time per iteration to show
      row = (f'{1e3 * median:.1f}', f'{speedups[name]:.2f}', *'-' * 6)
      rows.append((name, *row, milliseconds(times[name])))
      continue
    ceiling = statistics.median(b / t for b, t in zip(bp, busiest[name]))
    rows.append(
      (
        name,
        f'{1e3 * median:.1f}',
        f'{speedups[name]:.2f}',
        f'{1e3 * statistics.median(busiest[name]):.1f}',
        f'{1e3 * statistics.median(busiest_cpu[name]):.1f}',
        f'{ceiling:.2f}',
        f'{1e3 * statistics.median(host[name]):.2f}',
        f'{1e3 * statistics.median(host_cpu[name]):.2f}',
        f'{1e3 * statistics.median(driver[name]):.2f}',
        milliseconds(times[name]),
      )
    )
  print_cases(header, rows)
  print(
    "busiest lane: the busy time per iteration of the case's busiest lane (its tasks, "
    "in the lane's own timing); its CPU: of it, that lane's process's own (its copy "
    'threads left out; the rest, its cores ran its copies, the driver, Ray or another '
    "lane); ceiling: bp's time over the busy time, the speed-up if nothing but that lane "
    'took time (stage balance, tasks slowed by a neighbour); driver CPU: every thread of '
    'the driver per task dispatched from batch --warmup on (dispatch, hearing the lanes, '
    'the policy, readers and writers), where host time is the dispatch alone'
  )
  if unexecuted:
    print(
      "no executor: the case's tasks in pinned processes on its cores, all at once, waiting "
      'for nothing (benchmarks.neighbour_contention): what the cores give with no executor '
      'and no waits between stages; a case below it lost the difference to its executor '
      "and its schedule's waits"
    )
  per_task = statistics.median(statistics.median(host[name]) for name in cases_)
  cpu_per_task = statistics.median(statistics.median(host_cpu[name]) for name in cases_)
  print(f"of it the driver thread's CPU: {1e6 * cpu_per_task:.0f} µs per task")
  driver_per_task = statistics.median(statistics.median(driver[name]) for name in cases_)
  print(
    f"the driver's CPU per task after the warm-up, every thread of it: "
    f'{1e6 * driver_per_task:.0f} µs'
  )
  print(f'process executor host time per task: {1e6 * per_task:.0f} µs')
  ddg_case = next(name for name in cases_ if name.startswith('ddg'))
  print(f'ddg real speed-up K={args.lanes} (processes): {speedups[ddg_case]:.2f}')


if __name__ == '__main__':
  t0 = time.time()
  main()
  print(f'({time.time() - t0:.0f} s)')
