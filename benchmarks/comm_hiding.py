r"""How much communication SSGD, local SGD and DaSGD hide: `python -m benchmarks.comm_hiding`.

1. Virtual clock (`jaxsgd.spmd.timing`): M = 8, 64, 256 workers training a
   ResNet-20-sized model (CIFAR ResNet-20, ~0.27M float32 parameters), links of 1
   to 100 Gbit/s. One step's compute is measured once on this machine (ResNet-20,
   `--batch` images per worker) unless `--step_time` is given; an all-reduce takes
   2(M−1)/M · bytes/β + 2(M−1)·α. Printed: throughput relative to the same run
   without communication (1.0 = all communication hidden).
2. The all-reduces one period of DaSGD executes, counted in each compiled program's
   HLO (`jaxsgd.spmd.hlo.collective_count`): `overlap=True` runs each period as one
   program with one all-reduce (of the stored snapshot, issued before the period's
   compute, merged at step `delay`); the per-step form issued one every step; the
   lock-step form (`overlap=False`) one in a `lax.cond` on merge steps.
3. Real steps/s on this machine for `ssgd` and the three DaSGD forms, interleaved
   rounds: 2 and 4 fake CPU devices in this process, and 2 processes × 1 device
   launched by `jaxsgd.launch` (gloo on loopback). The CPU has 2 cores that every
   fake device shares, so these numbers show overheads, not parallel speed-up
   (see docs/jax_on_cpu.md).

Runtime: ~3 min on the 2-core CPU (`--skip_real`: ~70 s). The real rates are noisy on
the shared 2 cores (a factor of 2 between runs under other jobs' load); compare the
columns of one run, which are interleaved.
"""

import argparse
import json
import os
import subprocess
import sys
import time

_FLAG = '--xla_force_host_platform_device_count=4'
if 'JAXSGD_PROCESS_ID' not in os.environ and 'device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxsgd import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd import transforms  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.spmd import DataParallelTrainer  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.spmd import hlo  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.spmd import step as step_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxsgd.spmd import timing  # pylint: disable=g-import-not-at-top,wrong-import-position

REAL_MODEL = ('cnn', (40, 1), 10)  # The default experiment's CNN on MNIST-1D-shaped data.


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workers', default='8,64,256')
  parser.add_argument('--bandwidths', default='1,3,10,30,100', help='Gbit/s per link')
  parser.add_argument('--latency', type=float, default=1e-5, help='seconds per message')
  parser.add_argument('--batch', type=int, default=32, help='images per worker per step')
  parser.add_argument('--period', type=int, default=4)
  parser.add_argument('--delay', type=int, default=1)
  parser.add_argument(
    '--step_time',
    type=float,
    default=None,
    help='seconds of compute per step (default: measured here)',
  )
  parser.add_argument(
    '--accelerator_step_time',
    type=float,
    default=0.005,
    help='a second table for a faster, accelerator-class step',
  )
  parser.add_argument(
    '--real_steps', type=int, default=96, help='steps per timed round (a multiple of --period)'
  )
  parser.add_argument('--rounds', type=int, default=9)
  parser.add_argument('--skip_real', action='store_true')
  parser.add_argument('--measure_worker', default=None, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


# --- 1. virtual clock ----------------------------------------------------------------
def resnet20_compute(batch: int) -> tuple[float, int]:
  """(seconds of one ResNet-20 worker step here, bytes of its float32 parameters)."""
  model = models.get_model('resnet20', (32, 32, 3), 10)
  variables = model.init(jax.random.key(0))
  tx = optax.sgd(0.1, momentum=0.9)
  one_step = jax.jit(step_lib.make_worker_step(model, tx, average_grads=False))
  rng = np.random.default_rng(0)
  data = {
    'image': rng.normal(size=(batch, 32, 32, 3)).astype(np.float32),
    'label': rng.integers(0, 10, batch).astype(np.int32),
  }
  seconds = timing.measure_seconds(one_step, variables, tx.init(variables['params']), data)
  return seconds, timing.tree_bytes(variables['params'])


def clocks(compute, nbytes, workers, gbps, args) -> dict[str, timing.StepTimeModel]:
  comm = timing.ring_allreduce_time(nbytes, workers, bandwidth=gbps * 1e9 / 8, latency=args.latency)
  return {
    'ssgd': timing.StepTimeModel(compute, comm),
    'local_sgd': timing.StepTimeModel(compute, comm, args.period, 0),
    'dasgd': timing.StepTimeModel(compute, comm, args.period, args.delay),
  }


def virtual_table(compute, nbytes, args) -> tuple[list[str], dict]:
  lines = [
    f'{"M":>4} {"Gbit/s":>6} {"allreduce ms":>12} | {"ssgd":>6} {"local_sgd":>9} '
    f'{"dasgd":>6} | dasgd hidden'
  ]
  results = {}
  for m in map(int, args.workers.split(',')):
    for gbps in map(float, args.bandwidths.split(',')):
      c = clocks(compute, nbytes, m, gbps, args)
      results[m, gbps] = {k: v.relative_throughput() for k, v in c.items()}
      lines.append(
        f'{m:>4} {gbps:>6g} {1e3 * c["ssgd"].comm:>12.2f} | '
        f'{results[m, gbps]["ssgd"]:>6.3f} {results[m, gbps]["local_sgd"]:>9.3f} '
        f'{results[m, gbps]["dasgd"]:>6.3f} | '
        f'{100 * c["dasgd"].hidden_fraction():>5.1f} %'
      )
  return lines, results


# --- 2. real steps/s ---------------------------------------------------------------------
# 'dasgd': overlap=True, each period one program with one all-reduce (issued first,
# merged at step d); 'dasgd, per step': overlap=True with one program per step, each
# all-reducing the snapshot (the form before whole-period programs); 'dasgd, cond':
# overlap=False, the all-reduce in a lax.cond taken on merge steps only (lock-step).
REAL_NAMES = ('ssgd', 'dasgd', 'dasgd_step', 'dasgd_cond')
REAL_LABELS = ('ssgd', 'dasgd', 'dasgd, per step', 'dasgd, cond')


def _trainer(name, workers, args):
  model = models.get_model(REAL_MODEL[0], REAL_MODEL[1], REAL_MODEL[2])
  if name == 'ssgd':
    return DataParallelTrainer(model, optax.sgd(0.05), workers, average_grads=True)
  tx = transforms.local_sgd(
    optax.sgd(0.05),
    period=args.period,
    delay=args.delay,
    axis_name='data',
    overlap=name != 'dasgd_cond',
  )
  period = dict(period=args.period, delay=args.delay) if name == 'dasgd' else {}
  return DataParallelTrainer(model, tx, workers, average_grads=False, **period)


class _Timed:
  """One method's trainer, state and synthetic batches (32 per worker), warmed up."""

  def __init__(self, name, workers, args):
    self.trainer = _trainer(name, workers, args)
    rng = np.random.default_rng(jax.process_index())
    self.local = [
      {
        'image': rng.normal(size=(32,) + REAL_MODEL[1]).astype(np.float32),
        'label': rng.integers(0, 10, 32).astype(np.int32),
      }
      for _ in self.trainer.local_workers
    ]
    self.state = self.trainer.init(0)
    self.run(2 * args.period)  # Compile and warm up.

  def run(self, steps) -> float:
    """Seconds of `steps` steps as the training loop runs them (whole periods)."""
    trainer, done, loss = self.trainer, 0, None
    start = time.perf_counter()
    while done < steps:
      n = trainer.program_length(done, steps)
      self.state, losses = trainer.train_steps(self.state, [self.local] * n)
      done += n
      trainer.maybe_wait(done, losses[-1], steps=n)  # Several local devices: every 16.
      loss = losses[-1]
    loss.block_until_ready()
    return time.perf_counter() - start


def measure_steps_per_second(names, workers, args) -> dict[str, float]:
  """Steps/s of each method, interleaved: `--rounds` rounds of `--real_steps` each
  (a multiple of the period), the median round per method."""
  timed = {name: _Timed(name, workers, args) for name in names}
  seconds = {name: [] for name in names}
  for _ in range(args.rounds):
    for name in names:
      seconds[name].append(timed[name].run(args.real_steps))
  return {name: args.real_steps / float(np.median(s)) for name, s in seconds.items()}


def real_rows(args) -> tuple[list[str], dict[str, float]]:
  """The steps/s table, and the rates of 1 process x 2 devices."""
  rows = [f'{"":<24}' + ''.join(f' {label:>15}' for label in REAL_LABELS)]
  layouts = [
    (f'1 process x {w} devices', lambda w=w: measure_steps_per_second(REAL_NAMES, w, args))
    for w in (2, 4)
  ]
  layouts.append(('2 processes x 1 device', lambda: _launched_rates(args)))
  first = None
  for label, rates in layouts:
    rates = rates()
    first = first or rates
    rows.append(f'{label:<24}' + ''.join(f' {rates[n]:>15.1f}' for n in REAL_NAMES))
  return rows, first


def _launched_rates(args) -> dict[str, float]:
  """Steps/s of 2 processes x 1 device, started by `python -m jaxsgd.launch`."""
  cmd = [
    sys.executable,
    '-m',
    'jaxsgd.launch',
    '--processes',
    '2',
    '--devices_per_process',
    '1',
    '--timeout_s',
    '300',
    '--',
    '-m',
    'benchmarks.comm_hiding',
    '--measure_worker',
    ','.join(REAL_NAMES),
    '--real_steps',
    str(args.real_steps),
    '--rounds',
    str(args.rounds),
    '--period',
    str(args.period),
    '--delay',
    str(args.delay),
  ]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=360, check=True).stdout
  rates = [
    json.loads(line.split('RESULT ', 1)[1]) for line in out.splitlines() if 'RESULT ' in line
  ]
  return {n: min(r[n] for r in rates) for n in REAL_NAMES}  # The slower process sets the pace.


# --- 3. the compiled programs ----------------------------------------------------------
def allreduces_per_period(args) -> tuple[list[str], dict[str, int]]:
  """All-reduces one period executes, read from each compiled program's HLO."""
  lines, counts = [], {}
  for name, label in zip(REAL_NAMES[1:], REAL_LABELS[1:]):
    trainer = _trainer(name, 4, args)
    state = trainer.init(0)
    local = [
      {'image': np.zeros((32,) + REAL_MODEL[1], np.float32), 'label': np.zeros(32, np.int32)}
    ] * 4
    if trainer.period_step is not None:
      compiled = (
        trainer.period_step.lower(
          state.variables, state.opt_state, trainer.put_batches([local] * args.period)
        )
        .compile()
        .as_text()
      )
      count = hlo.collective_count(compiled)
      per_period = count['top_level'] + count['in_loops']
      how = 'one program per period'
    else:
      compiled = (
        trainer.step.lower(state.variables, state.opt_state, trainer.put_batch(local))
        .compile()
        .as_text()
      )
      count = hlo.collective_count(compiled)
      per_period = args.period * (count['top_level'] + count['in_loops'])
      how = f'{args.period} programs per period'
      if count['in_conditionals']:  # Taken on the merge step only.
        per_period += count['in_conditionals']
        how += ', in a lax.cond taken once'
    ((before, after),) = hlo.compute_around_collectives(compiled)[:1]
    deps = {
      d.split('[')[0].split('.')[0] + ('.snapshot' if 'snapshot' in d else '')
      for d in hlo.collective_inputs(compiled)[0]
    }
    lines.append(
      f'  {label:<16} {per_period:>2} all-reduce(s) per period ({how}); '
      f'scheduled after {before} and before {after} compute ops (a loop of '
      f'steps counts once); reads {", ".join(sorted(deps))}'
    )
    counts[name] = per_period
  return lines, counts


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.measure_worker:  # One process of the launched 2-process measurement.
    from jaxsgd.spmd import initialize_from_env  # pylint: disable=g-import-not-at-top

    initialize_from_env()
    print(
      'RESULT',
      json.dumps(
        measure_steps_per_second(args.measure_worker.split(','), jax.device_count(), args)
      ),
    )
    return
  measured, nbytes = resnet20_compute(args.batch)
  compute = args.step_time or measured
  print(
    f'ResNet-20: {nbytes // 4:,} parameters ({nbytes / 1e6:.2f} MB float32); one worker '
    f'step of {args.batch} images measured here: {1e3 * measured:.1f} ms'
    + ('' if args.step_time is None else f' (using --step_time {1e3 * compute:.1f} ms)')
  )
  print(
    f'Virtual clock: period {args.period}, delay {args.delay}, latency '
    f'{1e6 * args.latency:g} us; throughput relative to no communication.\n'
  )
  print(f'Compute {1e3 * compute:.1f} ms/step (this machine):')
  lines, results = virtual_table(compute, nbytes, args)
  print('\n'.join(lines))
  if args.accelerator_step_time:
    print(f'\nCompute {1e3 * args.accelerator_step_time:.1f} ms/step (accelerator-class, given):')
    print('\n'.join(virtual_table(args.accelerator_step_time, nbytes, args)[0]))
  print(
    f'\nAll-reduces per period in the compiled DaSGD programs (CNN, 4 devices, period '
    f'{args.period}, delay {args.delay}; measured from the HLO):'
  )
  lines, counts = allreduces_per_period(args)
  print('\n'.join(lines))
  vs_ssgd = ''
  if not args.skip_real:
    print(
      f'\nReal, this 2-core CPU (CNN, MNIST-1D shapes, 32 per worker; steps/s, median of '
      f'{args.rounds} interleaved rounds of {args.real_steps} steps; fake devices share '
      'the 2 cores):'
    )
    rows, rates = real_rows(args)
    print('\n'.join(rows))
    vs_ssgd = f'; steps/s vs ssgd, 1 process x 2 devices: {rates["dasgd"] / rates["ssgd"]:.2f}'
  key = (64, 10.0)
  vs_model = (
    f'; throughput vs no-comm (virtual), M=64, 10Gbit/s: {results[key]["dasgd"]:.3f}'
    if key in results
    else ''
  )
  print(f'\ndasgd: {counts["dasgd"]} all-reduce per period (compiled){vs_ssgd}{vs_model}')


if __name__ == '__main__':
  main()
