r"""Simulated time to a target test accuracy: PD-ASGD vs LPP-SGD vs ASGD vs BP.

    python -m benchmarks.async_speedup          # --quick (default): ~4 min on a loaded 2-core CPU
    python -m benchmarks.async_speedup --full     # larger step budgets, a higher target

The same simulated devices for every method (virtual clock): the CNN on
MNIST-1D (40k/10k, generated offline), batch 64, Adam 1e-3 (constant), links of
10 µs and 10 GB/s. Every task's duration comes from ONE timing, done at the
start on this machine (the fastest of 7 timings of each real jitted call: the whole
model for `bp`/`asgd`/`lppsgd`, each of the 4 layers for `pdasgd`) and given to
every run as explicit costs, so the methods differ only in their schedules and
updates. The measured backward/forward ratio is printed.

Per device count D (3 and 8):
  bp      sequential SGD on one device (staged BP, 1 stage: the reference)
  asgd    parameter server + D workers
  lppsgd  D replicas × 2 Hogwild! workers per device, averaged every 4 updates
  pdasgd  n_fwd + n_bwd = D workers, layer-wise updates; the best of a small sweep
          of ratios (D = 3: 1:2, 2:1; D = 8: 3:5, 2:6, 4:4); on 8 devices without
          stragglers, the best ratio again with block updates (`pd-block`, the ablation)
and the same with stragglers: log-normal task noise σ = 0.5 on every lane and
the last device (worker) at 1/4 speed (bp: the noise only).

Time to target = the simulated time of the first evaluation (every 100 steps)
at or above the target; a run that does not reach it within its step budget
shows `>` its simulated time (a lower bound).
"""

import argparse
import dataclasses
import os
import tempfile
import time

if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import optax

from benchmarks.common import print_table
from experiments.configs import asgd as asgd_config
from experiments.configs import default as default_config
from experiments.configs import lppsgd as lpp_config
from experiments.configs import pdasgd as pd_config
from jaxsgd import data as data_lib
from jaxsgd import models
from jaxsgd import training
from jaxsgd.asynchronous import common
from jaxsgd.pipeline import PlacedStages
from jaxsgd.scheduler import Placement
from jaxsgd.pipeline.session import sequential_roles

LAYERS = 4  # The CNN's layers: 3 conv blocks + the head.
RATIOS = {3: ((1, 2), (2, 1)), 8: ((3, 5), (2, 6), (4, 4))}
STRAGGLERS = {'straggler_std': 0.5, 'slow': 0.25}


@dataclasses.dataclass(frozen=True)
class Sizes:
  target: float
  bp_steps: int
  async_steps: int  # asgd and pdasgd
  lpp_steps: dict  # per device count
  eval_every: int = 100


QUICK = Sizes(target=0.75, bp_steps=600, async_steps=1400, lpp_steps={3: 2000, 8: 4000})
FULL = Sizes(target=0.85, bp_steps=1500, async_steps=3000, lpp_steps={3: 5000, 8: 10000})


def time_tasks(dataset, batch_size: int) -> dict:
  """{1: whole-model table, LAYERS: per-layer table} of seconds per (stage, kind)."""
  model = models.get_model('cnn', dataset.input_shape, dataset.num_classes)
  batch = next(dataset.train_batches(batch_size, seed=0))
  tables = {}
  for stages in (1, LAYERS):
    pipeline = PlacedStages(
      model,
      stages,
      optax.adam(1e-3),
      placement=Placement.create(stages, jax.devices()[:1]),
      batch_size=batch_size,
    )
    tables[stages] = pipeline.time_tasks(sequential_roles(stages), batch, reps=7)
  return tables


def explicit(config, table: dict, stages: int) -> None:
  config.cost.calibrate = False
  for kind in ('forward', 'backward', 'update'):
    config.cost.compute[kind] = [table[(k, kind)] for k in range(stages)]
  config.cost.link_latency = 1e-5
  config.cost.link_bandwidth = 1e10


def make_config(
  method: str,
  devices: int,
  sizes: Sizes,
  tables: dict,
  data_dir,
  stragglers: bool,
  ratio=(1, 2),
  updates: str = 'layer',
):
  """The run's config: the experiment config of `method` with the benchmark's sizes."""
  if method == 'bp':
    config = default_config.get_config()
  else:
    config = {'asgd': asgd_config, 'lppsgd': lpp_config, 'pdasgd': pd_config}[method].get_config()
  config.dataset, config.data_dir, config.batch_size = 'mnist1d', data_dir, 64
  config.model = default_config.get_config().model
  config.optimizer.update({'name': 'adam', 'learning_rate': 1e-3, 'schedule': 'constant'})
  config.train_steps = {'bp': sizes.bp_steps, 'lppsgd': sizes.lpp_steps[devices]}.get(
    method, sizes.async_steps
  )
  config.eval_every, config.target_accuracy = sizes.eval_every, sizes.target
  config.clock = 'virtual'
  workers = devices
  if method == 'asgd':
    config.workers = devices
  elif method == 'lppsgd':
    config.algorithm.update(
      {'devices': devices, 'workers_per_device': 2, 'warmup_steps': 0, 'averaging_freq': 4}
    )
    workers = 2 * devices
  elif method == 'pdasgd':
    config.algorithm.update({'n_fwd': ratio[0], 'n_bwd': ratio[1], 'updates': updates})
  explicit(config, tables[LAYERS if method == 'pdasgd' else 1], config.stages)
  if stragglers:
    config.cost.straggler_std = STRAGGLERS['straggler_std']
    if method != 'bp':  # The last device runs at 1/4 speed (both LPP workers on it).
      slow = 2 if method == 'lppsgd' else 1
      config.cost.speeds = (1.0,) * (workers - slow) + (STRAGGLERS['slow'],) * slow
  return config


@dataclasses.dataclass
class Result:
  method: str
  ratio: str
  steps: int | None
  sim_time: float  # to target, or the whole run's (then a lower bound)
  reached: bool
  staleness: float
  wall: float


def run(config, label: str, ratio: str = '') -> Result:
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    summary = training.train_and_evaluate(config, workdir, show_progress=False)
  hit = summary['time_to_target']
  result = Result(
    label,
    ratio,
    hit['step'] if hit else None,
    hit['sim_time'] if hit else summary['final']['sim_time'],
    hit is not None,
    summary.get('mean_staleness', 0.0),
    time.perf_counter() - start,
  )
  reached = f'→ target at step {result.steps}' if hit else 'target not reached'
  print(
    f'  {label:<8} {ratio:<4} {reached:<27} sim {result.sim_time:8.3f} s  '
    f'(wall {result.wall:.0f} s)',
    flush=True,
  )
  return result


def setting(
  devices: int, stragglers: bool, sizes, tables, data_dir, bp_cache: dict
) -> list[Result]:
  make = lambda method, **kw: make_config(
    method, devices, sizes, tables, data_dir, stragglers, **kw
  )
  if stragglers not in bp_cache:  # One device: the same run for every device count.
    bp_cache[stragglers] = run(make('bp'), 'bp')
  results = [bp_cache[stragglers], run(make('asgd'), 'asgd'), run(make('lppsgd'), 'lppsgd')]
  sweep = [run(make('pdasgd', ratio=r), 'pdasgd', f'{r[0]}:{r[1]}') for r in RATIOS[devices]]
  return results + sweep


def block_ablation(devices: int, ratio: str, sizes, tables, data_dir) -> Result:
  """The best PD-ASGD ratio again with block (whole-model) updates."""
  config = make_config(
    'pdasgd',
    devices,
    sizes,
    tables,
    data_dir,
    False,
    ratio=tuple(int(n) for n in ratio.split(':')),
    updates='block',
  )
  return run(config, 'pd-block', ratio)


def best(results: list[Result], method: str) -> Result:
  candidates = [r for r in results if r.method == method]
  return min(candidates, key=lambda r: (not r.reached, r.sim_time))


def time_text(r: Result) -> str:
  return f'{r.sim_time:.3f}' if r.reached else f'>{r.sim_time:.3f}'


def speedup(slow: Result, fast: Result) -> str:
  """`slow / fast` in time to target; a bound when one of them did not reach it."""
  if not fast.reached:
    return 'n/a' if not slow.reached else f'<{slow.sim_time / fast.sim_time:.2f}'
  return f'{slow.sim_time / fast.sim_time:.2f}' + ('' if slow.reached else '+')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--full', action='store_true', help='larger budgets, target 0.85')
  parser.add_argument('--quick', action='store_true', help='the default sizes (target 0.75)')
  parser.add_argument('--data_dir', default=None, help='tfds data_dir (default: tfds default)')
  args = parser.parse_args()
  sizes = FULL if args.full else QUICK
  start = time.perf_counter()
  dataset = data_lib.load('mnist1d', args.data_dir)
  tables = time_tasks(dataset, 64)
  whole, layers = tables[1], tables[LAYERS]
  print(
    f'timed (ms): whole model forward {1e3 * whole[(0, "forward")]:.3f}, backward '
    f'{1e3 * whole[(0, "backward")]:.3f}, update {1e3 * whole[(0, "update")]:.3f}; '
    f'per layer forward {[round(1e3 * layers[(k, "forward")], 3) for k in range(LAYERS)]}, '
    f'backward {[round(1e3 * layers[(k, "backward")], 3) for k in range(LAYERS)]}'
  )
  print(
    f'measured backward/forward ratio: whole model {common.backward_forward_ratio(whole):.2f}, '
    f'layers {common.backward_forward_ratio(layers):.2f}'
  )
  rows, headline, bp_cache = [], {}, {}
  for devices in (3, 8):
    for stragglers in (False, True):
      name = f'{devices} devices' + (', stragglers' if stragglers else '')
      print(f'{name}:', flush=True)
      results = setting(devices, stragglers, sizes, tables, args.data_dir, bp_cache)
      bp, pd = best(results, 'bp'), best(results, 'pdasgd')
      if devices == 8 and not stragglers:
        results.append(block_ablation(devices, pd.ratio, sizes, tables, args.data_dir))
        ablation = (pd, results[-1])
      for r in results:
        rows.append(
          (
            devices,
            'yes' if stragglers else 'no',
            r.method,
            r.ratio or '-',
            r.steps if r.reached else '-',
            time_text(r),
            speedup(bp, r),
            round(r.staleness, 2),
          )
        )
      headline[name] = speedup(best(results, 'lppsgd'), pd)
  print()
  print(
    f'Time to {100 * sizes.target:.0f} % test accuracy on MNIST-1D, CNN, simulated devices '
    f'(virtual clock, timed costs):'
  )
  print_table(
    (
      'devices',
      'stragglers',
      'method',
      'fwd:bwd',
      'steps',
      'sim s to target',
      'speed-up vs bp',
      'mean staleness',
    ),
    rows,
  )
  print()
  for name, value in headline.items():
    print(f'pdasgd (best ratio) vs lppsgd, {name}: {value}x')
  layer, block = ablation
  print(
    f'pdasgd {layer.ratio} on 8 devices, layer-wise vs block updates: mean staleness '
    f'{layer.staleness:.2f} vs {block.staleness:.2f}, sim s to target {time_text(layer)} vs '
    f'{time_text(block)}'
  )
  print(f'total wall time {time.perf_counter() - start:.0f} s')
  print(f'pdasgd vs lppsgd time-to-target (virtual): {headline["8 devices"]}x')


if __name__ == '__main__':
  main()
