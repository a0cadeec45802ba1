r"""Real speed-up over lane processes: staged BP on one pinned core vs DDG / local on two.

    python -m benchmarks.real_speedup                 # ~3 min on a loaded 2-core CPU
    python -m benchmarks.real_speedup --address HEAD_IP:6379   # lanes on a Ray cluster

The same policies as training (`jaxsgd.pipeline`), on the real clock across processes
(`scheduler/process.py`), each lane an OS process pinned to its own core with XLA's
intra-op threads off:
  bp      staged BP, the whole model as one stage, on lane `stage0` (core 0)
  ddg     DDG K=2 (paper form), stages on `stage0` (core 0) and `stage1` (core 1)
  local   local parallelism K=2 (greedy, pipelined), same lanes
  asgd    ASGD with 2 workers: `server` and `worker0` on core 0, `worker1` on core 1;
          an iteration is one applied update (one batch's gradient, as for BP)
  pdasgd  PD-ASGD 1:1, the model in K=2 layers: the shared model (whose lane applies
          the layer-wise updates) and the forward worker on core 0, the backward
          worker on core 1; an iteration is one batch's backward, applied
  lppsgd  LPP-SGD with 2 replicas of one worker each (`worker0.0` on core 0,
          `worker1.0` on core 1), averaged every 4 updates (`allreduce` on core 0); an
          iteration is one applied update
The model is an MLP wide enough that a task (~tens of ms) dwarfs a dispatch (~1 ms);
the batches are synthetic, a cycle of a few made once (`batches`). Its inputs (`--features`, 1536 by default) make the two stages
that `split` cuts by forward FLOPs (printed) cost about the same forward and backward: a
first stage computes no input gradient, so its backward is lighter than the next stage's
(with 1024 inputs the stages cost the same forward, but the lanes' busy times were
5 : 6). Per case the busiest lane's busy time per iteration is printed, and BP's time
over it: the case's ceiling as it ran, had nothing but that lane's tasks taken time. Time per iteration: from the end of the last update of
batch `--warmup` to that of the last batch, over the batches in between (compilation
in the lanes is left out), median over interleaved rounds; the speed-up is the median
over rounds of BP's time over the case's in the same round. Host time per task: the
driver's time in `LanePool.start` (and `early`) per dispatched task. The limit on 2
cores is 2x; other jobs on the machine take their share of the cores (the load average
is printed). Not a test: speed is measured, not asserted.
"""

import argparse
import os
import statistics
import time

import jax

from benchmarks import common as bench_common
from jaxsgd import models, optimizers
from jaxsgd.algorithms import asgd, ddg, local
from jaxsgd.asynchronous import common, lppsgd, pdasgd, server
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles
from jaxsgd.scheduler import Placement
from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.process import ProcessExecutor

FEATURES, CLASSES, HIDDEN, BATCH = 1536, 10, (1024, 1024, 1024, 1024), 512
OPTIMIZER = optimizers.OptimizerSettings('sgd', 0.01)


def batches(seed: int = 0):
  """The cases' synthetic batches: a cycle of a few made once (`cycled_batches`)."""
  return bench_common.cycled_batches((FEATURES,), CLASSES, BATCH, seed=seed)


def placed(roles, steps: int) -> PlacedStages:
  num = len(roles)
  model = models.get_model('mlp', (FEATURES,), CLASSES, hidden=HIDDEN)
  return PlacedStages(
    model,
    num,
    optimizers.make_optimizer(OPTIMIZER, steps),
    placement=Placement.create(num, jax.devices()),
    batch_size=BATCH,
    aux_heads=any(r.loss == 'aux' for r in roles),
    optimizer=(OPTIMIZER, steps),
  )


def split_balance() -> str:
  """The K=2 split's stages in forward FLOPs (XLA's count, what `split` balances)."""
  from jaxsgd.models.split import balanced_boundaries

  model = models.get_model('mlp', (FEATURES,), CLASSES, hidden=HIDDEN)
  costs = model.layer_costs()
  stages = [sum(costs[a:b]) for a, b in balanced_boundaries(costs, 2)]
  shares = ' : '.join(f'{c / 1e6:.2f}' for c in stages)
  return f'K=2 split: {shares} forward MFLOP per example'


def measured(executor: ProcessExecutor, timeline, steps: int, warmup: int):
  """`run`'s three figures of a finished run."""
  return (
    per_iteration(timeline, steps, warmup),
    executor.dispatch_seconds / executor.dispatched,
    busiest_lane(timeline, steps, warmup),
  )


def busiest_lane(timeline, steps: int, warmup: int) -> float:
  """Busy seconds per iteration of the busiest compute lane over `steady_window`:
  what the case would take if nothing but its lanes' work took time (its ceiling is BP's
  time over this)."""
  start, end = steady_window(timeline, steps, warmup)
  busy = {}
  for task in timeline.records:
    if not timeline.lane_names[task.lane].startswith('link '):
      overlap = max(0.0, min(task.end, end) - max(task.start, start))
      busy[task.lane] = busy.get(task.lane, 0.0) + overlap
  return max(busy.values()) / (steps - warmup)


def steady_window(timeline, steps: int, warmup: int) -> tuple[float, float]:
  """From the end of the last update of batch `warmup - 1` to that of the last batch."""
  ends = {}
  for task in timeline.tasks(kind='update'):
    ends[task.batch] = max(ends.get(task.batch, 0.0), task.end)
  return ends[warmup - 1], ends[steps - 1]


def per_iteration(timeline, steps: int, warmup: int) -> float:
  """Seconds per iteration over `steady_window`."""
  start, end = steady_window(timeline, steps, warmup)
  return (end - start) / (steps - warmup)


def run(pool: LanePool, roles, steps: int, warmup: int) -> tuple[float, float, float]:
  """(seconds per iteration after `warmup` batches, driver seconds per dispatched task,
  busy seconds per iteration of the busiest lane)."""
  if roles == 'asgd':
    return run_asgd(pool, 2, steps, warmup)
  if roles == 'pdasgd':
    return run_pdasgd(pool, steps, warmup)
  if roles == 'lppsgd':
    return run_lppsgd(pool, steps, warmup)
  stages = placed(roles, steps)
  feed = BatchFeed(batches(), 1 + sum(r.loss != 'none' for r in roles))
  session = stages.session(roles, feed, steps)
  executor = ProcessExecutor(pool=pool)
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, steps, warmup)


def run_asgd(pool: LanePool, num_workers: int, steps: int, warmup: int) -> tuple[float, float]:
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
  executor = ProcessExecutor(pool=pool, run_ahead=asgd.RUN_AHEAD)  # as experiments.train
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
  return measured(executor, timeline, steps, warmup)


def run_pdasgd(pool: LanePool, steps: int, warmup: int) -> tuple[float, float]:
  """PD-ASGD (`jaxsgd.asynchronous.pdasgd`), one forward and one backward worker, the
  default bound of 2 batches in flight; updates on the shared model's lane."""
  settings = pdasgd.PdSettings(n_fwd=1, n_bwd=1, updates='layer')
  executor = ProcessExecutor(pool=pool)
  session = pdasgd.PdSession(
    placed(sequential_roles(2), steps),
    settings,
    [batches()],
    [jax.devices()[0]] * 3,
    common.StepCounter(steps),
    common.WorkerLog([pdasgd.worker_name(settings, w) for w in range(2)], {}, executor.now),
    lane_processes=True,
  )
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, steps, warmup)


def run_lppsgd(pool: LanePool, steps: int, warmup: int) -> tuple[float, float]:
  """LPP-SGD (`jaxsgd.asynchronous.lppsgd`), 2 replicas of one worker, averaged every 4."""
  settings = lppsgd.LppSettings(devices=2, workers_per_device=1, averaging_freq=4)
  stages = placed(sequential_roles(1), steps)
  variables = stages.initial_variables(0, sequential_roles(1)[0])
  executor = ProcessExecutor(pool=pool)
  session = lppsgd.LppSession(
    stages,
    settings,
    variables,
    stages.tx.init(variables['params']),
    [batches(seed=d) for d in range(2)],
    [jax.devices()[0]] * 2,
    common.StepCounter(steps),
    common.WorkerLog(['worker 0.0', 'worker 1.0'], {}, executor.now),
    lane_processes=True,
  )
  timeline = executor.run(session.cluster, session.processes())
  return measured(executor, timeline, steps, warmup)


def main():
  global FEATURES, BATCH  # (`--features`, `--batch`), read by `batches` and `placed`
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--warmup', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--address', default=None, help='a Ray cluster (default: start one here)')
  parser.add_argument('--features', type=int, default=FEATURES, help='inputs of the MLP')
  parser.add_argument('--batch', type=int, default=BATCH, help='examples per batch')
  args = parser.parse_args()
  FEATURES, BATCH = args.features, args.batch
  cases = {
    'bp (1 lane, core 0)': sequential_roles(1),
    'ddg K=2 (cores 0, 1)': ddg.roles(2),
    'local K=2 (cores 0, 1)': local.roles(2),
    'asgd M=2 (cores 0, 1)': 'asgd',
    'pdasgd 1:1 K=2 (cores 0, 1)': 'pdasgd',
    'lppsgd D=2 (cores 0, 1)': 'lppsgd',
  }
  print(
    f'machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; '
    f'jax {jax.__version__}; MLP {FEATURES}-{"-".join(map(str, HIDDEN))}-{CLASSES}, '
    f'batch {BATCH}, {args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds'
  )
  print(split_balance())
  placement = LanePlacement.parse(
    'stage0@cores=0; stage1@cores=1; server@cores=0; worker0@cores=0; worker1@cores=1; '
    'sharedmodel@cores=0; forwardworker0@cores=0; backwardworker0@cores=1; '
    'worker0.0@cores=0; worker1.0@cores=1; allreduce@cores=0'
  )
  times = {name: [] for name in cases}
  host = {name: [] for name in cases}
  busiest = {name: [] for name in cases}
  with LanePool(placement, address=args.address) as pool:
    for _ in range(args.rounds):  # interleaved: every case once per round
      for name, roles in cases.items():
        seconds, dispatch, busy = run(pool, roles, args.steps, args.warmup)
        busiest[name].append(busy)
        times[name].append(seconds)
        host[name].append(dispatch)
  print(f'load average {os.getloadavg()[0]:.1f} at end')
  bp = times['bp (1 lane, core 0)']
  header = (
    'case',
    'ms / iteration',
    'speed-up over bp',
    'busiest lane ms / it',
    'ceiling',
    'host ms / task',
    'rounds (ms)',
  )
  rows, speedups = [], {}
  for name in cases:
    median = statistics.median(times[name])
    # Paired: bp and this case ran in the same round, so they saw about the same load.
    speedups[name] = statistics.median(b / t for b, t in zip(bp, times[name]))
    rows.append(
      (
        name,
        f'{1e3 * median:.1f}',
        f'{speedups[name]:.2f}',
        f'{1e3 * statistics.median(busiest[name]):.1f}',
        f'{statistics.median(b / t for b, t in zip(bp, busiest[name])):.2f}',
        f'{1e3 * statistics.median(host[name]):.2f}',
        ' '.join(f'{1e3 * t:.0f}' for t in times[name]),
      )
    )
  widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
  for row in (header, *rows):
    print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)))
  print(
    "busiest lane: the busy time per iteration of the case's busiest lane (its tasks, "
    "in the lane's own timing); ceiling: bp's time over it, the speed-up if nothing "
    'but that lane took time (stage balance, tasks slowed by a neighbour)'
  )
  print(f'ddg real speed-up K=2 (processes): {speedups["ddg K=2 (cores 0, 1)"]:.2f}')


if __name__ == '__main__':
  t0 = time.time()
  main()
  print(f'({time.time() - t0:.0f} s)')
