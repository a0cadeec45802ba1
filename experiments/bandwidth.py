r"""Compute utilization against bandwidth: data-parallel, DiLoCo and streaming DiLoCo
for a ~1B-parameter transformer on simulated devices, priced from abstract shapes.

    python -m experiments.bandwidth --out=experiments/results/lm/bandwidth
    python -m experiments.bandwidth --device=a100 --workers=16 --blocks=40 ...

The shape of the simulation in Douillard et al. 2025 (Streaming DiLoCo, Figure 4):
M workers, each one device of `--device` (a `jaxsgd.scheduler.hardware` preset),
joined by links of bandwidth β from 1 to 400 Gbit/s. One worker step (forward,
backward, AdamW update of a decoder-only transformer, `--batch` sequences of
`--length` bytes) is priced by the preset's roofline from XLA's operation counts of
the step compiled on `jax.ShapeDtypeStruct`s: no parameter is allocated. A
synchronization is a ring all-reduce of the float32 weights (of the gradients for
data-parallel), each worker's share of it `jaxsgd.spmd.timing.ring_allreduce_time`,
and the utilization is `StepTimeModel.relative_throughput`, the time model every
data-parallel run of jaxsgd uses on the virtual clock:

    utilization = p · compute / (p · compute + max(0, T_allreduce − τ · compute))

with p the steps between two synchronizations (1: data-parallel; H: DiLoCo; H/P:
streaming DiLoCo, one fragment of 1/P of the weights each time) and τ the steps an
all-reduce overlaps before its result is merged. Writes `bandwidth.md` (the table and
the bandwidth each method needs for 50-99 % utilization), `bandwidth.json` and
`bandwidth.png`; prints the table and, last, the bandwidths needed for 95 %.

What differs from the paper's simulation: weights and gradients are float32 here (the
paper sends bf16 and, for streaming DiLoCo, 4-bit outer gradients: 2x and 8x fewer
bytes), and data-parallel's gradient all-reduce is not overlapped with the backward
pass (the paper's simulation overlaps it).
"""

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure
import optax

from jaxsgd.models import zoo
from jaxsgd.scheduler import hardware
from jaxsgd.spmd import step as step_lib
from jaxsgd.spmd import timing

GBIT = 1e9 / 8  # bytes/s in one Gbit/s
BANDWIDTHS_GBIT = (1, 2, 5, 10, 20, 50, 100, 200, 400)
UTILIZATIONS = (0.5, 0.75, 0.9, 0.95, 0.99)


@dataclasses.dataclass(frozen=True)
class Method:
  """How a method synchronizes: every `period` steps, 1/`fragments` of the weights,
  merged `delay` steps later."""

  label: str
  period: int
  fragments: int = 1
  delay: int = 0

  def time_model(self, compute: float, comm: float = 0.0) -> timing.StepTimeModel:
    """Its steps of `compute` seconds, one all-reduce of `comm` seconds per sync."""
    return timing.sync_time_model(
      compute, comm, period=self.period, fragments=self.fragments, delay=self.delay
    )

  def utilization(self, compute, nbytes, workers, bandwidth, latency) -> float:
    """Its `relative_throughput` with an all-reduce of `nbytes / fragments` over
    `workers` on links of `bandwidth` bytes/s and `latency` s."""
    comm = timing.ring_allreduce_time(
      nbytes / self.fragments, workers, bandwidth=bandwidth, latency=latency
    )
    return self.time_model(compute, comm).relative_throughput()

  def bandwidth_for(self, utilization, compute, nbytes, workers, latency) -> float:
    """The link bandwidth (bytes/s) at which this method's utilization is `utilization`."""
    budget = self.time_model(compute).comm_budget(utilization)
    return timing.ring_allreduce_bandwidth(
      budget, nbytes / self.fragments, workers, latency=latency
    )


def methods(period: int, fragments: int, delay: int) -> tuple[Method, ...]:
  """Data-parallel (a sync every step), DiLoCo (every H), streaming DiLoCo (1/P every
  H/P) without and with τ overlapped steps."""
  return (
    Method('data-parallel', 1),
    Method(f'DiLoCo H={period}', period),
    Method(f'streaming DiLoCo H={period}, P={fragments}', period, fragments),
    Method(f'streaming DiLoCo H={period}, P={fragments}, τ={delay}', period, fragments, delay),
  )


def abstract_step_seconds(
  spec: hardware.DeviceSpec, *, width, blocks, heads, length, batch
) -> tuple[float, int]:
  """(roofline seconds of one worker step on `spec`, parameters) of the transformer,
  from XLA's counts of the step compiled on abstract shapes (nothing allocated)."""
  model = zoo.transformer((length,), 256, width=width, blocks=blocks, heads=heads)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0)))
  tx = optax.adamw(1e-4)
  opt_state = jax.eval_shape(tx.init, variables['params'])
  data = {
    'image': jax.ShapeDtypeStruct((batch, length), jnp.float32),
    'label': jax.ShapeDtypeStruct((batch, length), jnp.int32),
  }
  step = jax.jit(step_lib.make_worker_step(model, tx, average_grads=False))
  counts = hardware.op_counts(step, (variables, opt_state, data))
  parameters = sum(x.size for x in jax.tree.leaves(variables['params']))
  return hardware.roofline_seconds(counts, spec), parameters


def study(compute, nbytes, workers, latency, all_methods, bandwidths_gbit=BANDWIDTHS_GBIT):
  """`{'utilization': {method: [fraction per bandwidth]}, 'needed_gbit': {method:
  {utilization: Gbit/s}}, 'bytes_per_sync': {method: bytes of one all-reduce}}`."""
  utilization = {
    m.label: [m.utilization(compute, nbytes, workers, g * GBIT, latency) for g in bandwidths_gbit]
    for m in all_methods
  }
  needed = {
    m.label: {u: m.bandwidth_for(u, compute, nbytes, workers, latency) / GBIT for u in UTILIZATIONS}
    for m in all_methods
  }
  peak = {m.label: nbytes / m.fragments for m in all_methods}
  return {'utilization': utilization, 'needed_gbit': needed, 'bytes_per_sync': peak}


def _gbit(value: float) -> str:
  """Gbit/s in 3 significant digits; ∞ where no bandwidth is enough."""
  return '∞' if value == float('inf') else f'{value:,.3g}'


def table(result, bandwidths_gbit=BANDWIDTHS_GBIT) -> list[str]:
  """Markdown: utilization per method and bandwidth; then the bandwidth each method
  needs per utilization, and its bytes per synchronization."""
  head = ['method'] + [f'{g} Gbit/s' for g in bandwidths_gbit]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, values in result['utilization'].items():
    lines.append('| ' + ' | '.join([label] + [f'{100 * v:.1f} %' for v in values]) + ' |')
  head = ['Gbit/s needed for'] + [f'{100 * u:g} %' for u in UTILIZATIONS] + ['GB a sync']
  lines += ['', '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, needed in result['needed_gbit'].items():
    cells = [_gbit(needed[u]) for u in UTILIZATIONS] + [
      f'{result["bytes_per_sync"][label] / 1e9:.2f}'
    ]
    lines.append('| ' + ' | '.join([label] + cells) + ' |')
  return lines


def plot(result, path, title, bandwidths_gbit=BANDWIDTHS_GBIT) -> None:
  """Utilization (%) against bandwidth (log scale), one line per method."""
  fig = Figure(figsize=(7, 4.2))
  ax = fig.subplots()
  styles = ('o-', 's-', 'x--', 'o-')  # (streaming without overlap sits on DiLoCo: dashed)
  for (label, values), style in zip(result['utilization'].items(), styles, strict=True):
    ax.plot(bandwidths_gbit, [100 * v for v in values], style, label=label)
  ax.set(
    xscale='log', xlabel='bandwidth between workers (Gbit/s)', ylabel='compute utilization (%)'
  )
  ax.set_title(title, fontsize=9)
  ax.set_ylim(0, 102)
  ax.grid(alpha=0.3, which='both')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  arg = parser.add_argument
  arg('--out', default='runs/bandwidth', help='folder for bandwidth.{md,json,png}')
  arg('--device', default='h100', choices=list(hardware.PRESETS), help='the device preset')
  arg('--workers', type=int, default=8, help='M, the workers (one device each)')
  arg('--width', type=int, default=2048, help="the transformer's width")
  arg('--blocks', type=int, default=20, help='decoder blocks (20 of width 2048: 1.01B)')
  arg('--heads', type=int, default=16, help='attention heads')
  arg('--length', type=int, default=2048, help='sequence length (bytes)')
  arg('--batch', type=int, default=8, help='sequences per worker per step')
  arg('--period', type=int, default=100, help='H, inner steps between two syncs')
  arg('--fragments', type=int, default=4, help="P, streaming DiLoCo's fragments")
  arg('--delay', type=int, default=5, help="τ, streaming DiLoCo's overlapped steps (< H/P)")
  arg('--latency', type=float, default=1e-3, help='seconds per message of a link')
  args = parser.parse_args(argv)
  for name in ('workers', 'width', 'blocks', 'heads', 'length', 'batch', 'period', 'fragments'):
    if getattr(args, name) < 1:
      parser.error(f'--{name}: at least 1, got {getattr(args, name)}')
  if args.period % args.fragments:
    parser.error(f'--period: a multiple of --fragments ({args.fragments}), got {args.period}')
  if not 0 <= args.delay < args.period // args.fragments:
    parser.error(f'--delay: 0 <= delay < period / fragments, got {args.delay}')
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  spec = hardware.preset(args.device)
  compute, parameters = abstract_step_seconds(
    spec,
    width=args.width,
    blocks=args.blocks,
    heads=args.heads,
    length=args.length,
    batch=args.batch,
  )
  nbytes = 4 * parameters  # float32 weights (or gradients) per worker
  all_methods = methods(args.period, args.fragments, args.delay)
  result = study(compute, nbytes, args.workers, args.latency, all_methods)
  setting = (
    f'{parameters / 1e9:.2f}B-parameter transformer (width {args.width}, {args.blocks} '
    f'blocks, {args.length} tokens × {args.batch} a step), {args.workers} workers, '
    f'one {spec.name} each ({spec.precision}): a step {compute:.3f} s (roofline), '
    f'{nbytes / 1e9:.2f} GB a synchronization, links {args.latency * 1e3:g} ms latency'
  )
  os.makedirs(args.out, exist_ok=True)
  title = f'{parameters / 1e9:.2f}B transformer, {args.workers} workers, one {spec.name} each'
  plot(result, os.path.join(args.out, 'bandwidth.png'), title)
  lines = table(result)
  with open(os.path.join(args.out, 'bandwidth.md'), 'w') as f:
    f.write(f'# Compute utilization against bandwidth\n\n{setting}.\n\n')
    f.write('Command: `python -m experiments.bandwidth` (`--help` for the setting).\n\n')
    f.write('\n'.join(lines) + '\n\n![utilization against bandwidth](bandwidth.png)\n')
  with open(os.path.join(args.out, 'bandwidth.json'), 'w') as f:
    json.dump(
      {
        'setting': setting,
        'parameters': parameters,
        'step_seconds': compute,
        'bandwidths_gbit': BANDWIDTHS_GBIT,
        **result,
      },
      f,
      indent=1,
    )
  print(setting)
  print('\n'.join(lines))
  needed = ', '.join(f'{k} {_gbit(v[0.95])}' for k, v in result['needed_gbit'].items())
  print(f'Gbit/s for 95 % compute utilization: {needed}')


if __name__ == '__main__':
  main()
