r"""How far the roofline (`hardware`, preset `cpu`) is from measured task costs here.

    python -m benchmarks.roofline_vs_measured [--reps=20] [--stages=4] [--mode=pinned|shared]
    python -m benchmarks.roofline_vs_measured --mode=gpu --preset=h200 \
        --models=cnn,resnet20,resnet18,transformer        # on a machine with a GPU

For the CNN (MNIST-1D shapes, batch 128) and ResNet-20 (CIFAR-10 shapes, batch
64) by default, `--models` also ResNet-18 (CIFAR-10 shapes, batch 128) and a GPT-2-shaped
transformer (width 512, 8 blocks, 8 heads, 256 tokens of a 1024-token vocabulary,
batch 16), each cut into `--stages` stages as the pipeline algorithms cut them: every
stage's forward, backward and update (Adam), timed as a cost profile times them
(`task_timing.measure`: 3 warm-up calls, then `--reps` interleaved blocking calls,
their median counts), next to its roofline time `max(flops / peak, bytes /
bandwidth) + launch + kernels · kernel_overhead` from XLA's compiled cost
analysis and a preset. `--mode=shared` (default): both cores, wall time,
against the `cpu` preset — how `experiments.profile` measures by default;
`--mode=pinned`: the process on one core, calls timed by its CPU time, against
`cpu_core`; `--mode=gpu`: the tasks on JAX's first GPU, wall time, against `--preset`
(the operation counts are then those of the program compiled for the GPU).
`bound` says which term of the max won; `kernels` is the kernel count charged
`kernel_overhead` each. Ratio = measured / roofline (> 1: the
task is slower than the roofline says). Last line: `median measured/roofline
ratio: <x>`. Before it: per stage, the measured and roofline totals and the
pipeline bound sum / max each implies (what a simulated speed-up rests on: the
balance of the stages, not their absolute cost).
"""

import argparse
import os
import time

import jax
import numpy as np
import optax

from benchmarks.common import print_table
from jaxsgd import models
from jaxsgd.pipeline import PlacedStages, sequential_roles
from jaxsgd.scheduler import Placement, hardware, task_timing

MODELS = {  # name: (input shape, classes, batch size, the model's settings)
  'cnn': ((40, 1), 10, 128, {}),
  'resnet20': ((32, 32, 3), 10, 64, {}),
  'resnet18': ((32, 32, 3), 10, 128, {}),
  'transformer': ((256,), 1024, 16, {'width': 512, 'blocks': 8, 'heads': 8}),
}


def model_batch(name: str, rng) -> dict:
  """A batch of `name`'s shapes: images and labels, or token ids and next tokens."""
  shape, classes, batch_size, _ = MODELS[name]
  if name == 'transformer':
    tokens = rng.integers(0, classes, (batch_size, shape[0] + 1))
    return {'image': tokens[:, :-1].astype(np.float32), 'label': tokens[:, 1:].astype(np.int32)}
  return {
    'image': rng.standard_normal((batch_size,) + shape).astype(np.float32),
    'label': rng.integers(0, classes, batch_size).astype(np.int32),
  }


def rows_for(name: str, num_stages: int, reps: int, spec: hardware.DeviceSpec, clock) -> list:
  shape, classes, batch_size, settings = MODELS[name]
  model = models.get_model(name, shape, classes, **settings)
  roles = sequential_roles(num_stages)
  pipeline = PlacedStages(
    model,
    num_stages,
    optax.adam(1e-3),
    placement=Placement.create(num_stages),
    batch_size=batch_size,
    seed=0,
  )
  batch = model_batch(name, np.random.default_rng(0))
  calls = pipeline.task_calls(roles, batch)
  measured, _ = task_timing.measure(calls, warmup=3, reps=reps, clock=clock)
  rows = []
  for (stage, kind), (fn, args) in calls.items():
    counts = hardware.op_counts(fn, args)
    roofline = hardware.roofline_seconds(counts, spec)
    bound = (
      'flops'
      if counts.flops / spec.peak_flops >= counts.bytes_accessed / spec.memory_bandwidth
      else 'bytes'
    )
    rows.append(
      [
        name,
        stage,
        kind,
        counts.flops / 1e6,
        counts.bytes_accessed / 1e6,
        counts.kernels,
        bound,
        1e3 * measured[(stage, kind)],
        1e3 * roofline,
        measured[(stage, kind)] / roofline,
      ]
    )
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--reps', type=int, default=20)
  parser.add_argument('--stages', type=int, default=4)
  parser.add_argument(
    '--mode',
    choices=('pinned', 'shared', 'gpu'),
    default='shared',
    help='pinned: one core, CPU-time clock, preset cpu_core (how a profile '
    "is measured by default); shared: both cores, wall clock, preset cpu; gpu: JAX's "
    'first GPU, wall clock, preset --preset',
  )
  parser.add_argument('--preset', default='h200', help='with --mode=gpu: the GPU preset')
  parser.add_argument('--models', default='cnn,resnet20', help=f'of {",".join(MODELS)}')
  args = parser.parse_args()
  names = [name.strip() for name in args.models.split(',') if name.strip()]
  if not names or set(names) - set(MODELS):
    parser.error(f'--models: a comma-separated list of {", ".join(MODELS)}; got {args.models!r}')
  if args.mode == 'gpu' and args.preset not in hardware.PRESETS:
    parser.error(f'--preset: one of {", ".join(hardware.PRESETS)}; got {args.preset!r}')
  if args.mode == 'gpu' and jax.default_backend() != 'gpu':
    parser.error(f'--mode=gpu: JAX found no GPU here (its backend is {jax.default_backend()})')
  if args.mode == 'pinned':
    task_timing.pin_to_core(0)
  spec = hardware.preset({'pinned': 'cpu_core', 'shared': 'cpu'}.get(args.mode, args.preset))
  clock = time.process_time if args.mode == 'pinned' else time.perf_counter
  print(
    f'{spec.name} preset: peak {spec.peak_flops / 1e9:.0f} GFLOP/s, bandwidth '
    f'{spec.memory_bandwidth / 1e9:.0f} GB/s, launch {spec.launch_overhead * 1e6:.1f} µs, '
    f'kernel {spec.kernel_overhead * 1e6:.1f} µs; '
    f'{args.stages} stages, measured = median of {args.reps} interleaved calls; '
    f'load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; '
    f'{jax.devices()[0].device_kind}, jax {jax.__version__}'
  )
  rows = [row for name in names for row in rows_for(name, args.stages, args.reps, spec, clock)]
  print_table(
    [
      'model',
      'stage',
      'kind',
      'MFLOP',
      'MB',
      'kernels',
      'bound',
      'measured ms',
      'roofline ms',
      'ratio',
    ],
    rows,
  )
  ratios = np.array([row[-1] for row in rows])
  print(
    'per stage (forward + backward + update, ms) and the pipeline bound sum / max '
    '(the speed-up a K-stage pipeline could reach with these costs):'
  )
  for name in names:
    stages = sorted({row[1] for row in rows if row[0] == name})
    measured = [sum(r[7] for r in rows if r[0] == name and r[1] == k) for k in stages]
    roofline = [sum(r[8] for r in rows if r[0] == name and r[1] == k) for k in stages]
    print(
      f'{name:>8}: measured {" / ".join(f"{m:.3f}" for m in measured)} -> '
      f'{sum(measured) / max(measured):.2f}x; roofline '
      f'{" / ".join(f"{m:.3f}" for m in roofline)} -> {sum(roofline) / max(roofline):.2f}x'
    )
  for name in names:
    for kind in ('forward', 'backward', 'update'):
      sel = [row[-1] for row in rows if row[0] == name and row[2] == kind]
      print(
        f'{name:>8} {kind:<8}: ratio median {np.median(sel):.2f} '
        f'(range {min(sel):.2f} .. {max(sel):.2f})'
      )
  print(f'median measured/roofline ratio: {np.median(ratios):.2f}')


if __name__ == '__main__':
  main()
