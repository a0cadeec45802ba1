r"""This machine as a `DeviceSpec`: the figures behind `hardware.PRESETS['cpu']`.

    python -m benchmarks.device_spec [--reps=10]

Peak FLOP/s (a float32 2048² matmul), memory bandwidth (`x + 1` over 512 MiB,
XLA's bytes accessed over time), launch overhead (a blocking trivial jitted
call) and the link between two CPU devices (`device_put` at 64 KiB .. 64 MiB,
latency of 4 bytes, bandwidth of 64 MiB), kernel overhead (200 one-kernel
outputs against 1); each the fastest of `--reps` calls, since other
jobs on the machine only ever add time. Runs with two host devices. `--pin`
measures one core (the process pinned to core 0, peak and bandwidth timed by
the process's CPU time: the `cpu_core` preset). Last
line: `<cpu|cpu_core|gpu> spec: peak <x> GFLOP/s, bandwidth <y> GB/s`. Where JAX's
first device is a GPU, that is what it measures (one GPU: the link is its memory;
`--matmul=8192` for a peak that a 2048² matmul is too small to reach there).
"""

import argparse
import os
import time

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
).strip()

import jax  # pylint: disable=wrong-import-position

from benchmarks.common import print_table  # pylint: disable=wrong-import-position
from jaxsgd.scheduler import hardware, task_timing  # pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--reps', type=int, default=10)
  parser.add_argument(
    '--pin',
    action='store_true',
    help='measure one core: pin this process to core 0 first (cpu_core)',
  )
  parser.add_argument(
    '--matmul', type=int, default=2048, help='n of the n x n matmul timed for the peak'
  )
  args = parser.parse_args()
  if args.pin:
    task_timing.pin_to_core(0)
  name = 'cpu_core' if args.pin else 'cpu' if jax.default_backend() == 'cpu' else 'gpu'
  spec = hardware.measure_device_spec(
    name,
    matmul_size=args.matmul,
    reps=args.reps,
    clock=time.process_time if args.pin else time.perf_counter,
  )
  print(f'device: {jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}')
  print_table(
    ['quantity', 'measured', 'unit'],
    [
      ['peak_flops', spec.peak_flops / 1e9, 'GFLOP/s'],
      ['memory_bandwidth', spec.memory_bandwidth / 1e9, 'GB/s'],
      ['launch_overhead', spec.launch_overhead * 1e6, 'µs'],
      ['kernel_overhead', spec.kernel_overhead * 1e6, 'µs'],
      ['link_bandwidth', spec.link_bandwidth / 1e9, 'GB/s'],
      ['link_latency', spec.link_latency * 1e6, 'µs'],
    ],
  )
  print(
    f'{name} spec: peak {spec.peak_flops / 1e9:.1f} GFLOP/s, bandwidth '
    f'{spec.memory_bandwidth / 1e9:.1f} GB/s'
  )


if __name__ == '__main__':
  main()
