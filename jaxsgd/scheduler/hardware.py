"""Analytic task costs: XLA's operation counts on a named device (the roofline).

A task's cost on a device it never ran on:

    seconds = max(flops / peak_flops, bytes / memory_bandwidth)      # the roofline
              + launch_overhead + kernels · kernel_overhead            # fixed costs
    transfer of n bytes = link_latency + n / link_bandwidth

`flops` and `bytes` (bytes accessed) come from XLA's cost analysis of the
compiled task (`jitted.lower(*args).compile().cost_analysis()`), `kernels` is
the number of operations of the compiled program's entry computation (fusions,
convolutions, copies: what a device launches one by one), the rest from a
`DeviceSpec`. The kernel term is there because training small models is not
at the roofline: a stage update is dozens of tiny fused kernels (Adam over
every leaf) whose flops and bytes are next to nothing, and whose cost is the
launching (measured here: ~1.7 µs per kernel on this CPU).

The result is a pure function of the program and the spec, so a run with
`--config.cost.device=h100` simulates H100s on a laptop, the same simulated
times on any machine, any load.

What it leaves out (see docs/simulator.md for how far it is from measured costs
on this CPU): the operation counts are those of the program compiled for *this*
machine's backend (fusion differs on a GPU, which changes bytes more than
flops); every operation is assumed to reach the peak (real kernels do not,
convolutions on this CPU reach 10–30 % of the matmul peak); and the fixed costs are
two figures per device, whatever the kernels and their arguments.

Presets (`PRESETS`; peak = the rate JAX's *default* precision gets for float32
arrays, which is what jaxsgd's models use):

  cpu     this project's machine (2 vCPUs of an AMD EPYC, family 26 = Zen 5, AVX-512,
          under KVM), measured by `measure_device_spec` (benchmarks/device_spec.py,
          benchmarks/results/device_spec.txt): peak = a float32 2048² matmul (float32
          is all XLA:CPU does for float32 arrays), bandwidth = `x ← x + 1` in place over
          256 MiB (bytes read + written), launch = one blocking call of a trivial jitted
          function, kernel = the extra time per one-kernel output, link = `device_put`
          between two CPU devices. Each the best seen over several runs: the machine is
          shared, and under load the same measurement gave 92–412 GFLOP/s and
          37–114 GB/s (the figures only ever drop with load).
  cpu_core  one core of it, the unit a lane pinned to a core has (and what a profile
          measured pinned, the default of `experiments.profile`, measures): the same
          measurements in a process pinned to core 0, peak and bandwidth timed by the
          process's CPU time (185–195 GFLOP/s, 56–59 GB/s over runs: half of `cpu`).
  v100    NVIDIA Tesla V100 SXM2 datasheet (2017): FP32 15.7 TFLOP/s (Volta has no
          TF32, so float32 matmuls run at the FP32 rate), HBM2 900 GB/s, NVLink 300 GB/s
          total bidirectional -> 150 GB/s one way.
  a100    NVIDIA A100 datasheet (SXM4 80 GB, 2021): TF32 Tensor Core 156 TFLOP/s dense
          (JAX's default precision lets float32 matmuls and convolutions use TF32 on
          Ampere and later), HBM2e 2,039 GB/s, NVLink 600 GB/s -> 300 GB/s one way.
  h100    NVIDIA H100 datasheet (SXM5, 2022): TF32 Tensor Core 989 TFLOP/s with 2:4
          sparsity -> 494.7 dense (why TF32: as for the A100), HBM3 3.35 TB/s, NVLink
          900 GB/s -> 450 GB/s one way.
  h200    NVIDIA H200 datasheet (SXM, 2024): the H100's Hopper compute (TF32 Tensor Core
          989 TFLOP/s with sparsity -> 494.7 dense), HBM3e 4.8 TB/s, NVLink 900 GB/s ->
          450 GB/s one way.
  tpu_v4  Google Cloud TPU v4 documentation (cloud.google.com/tpu/docs/v4): 275 TFLOP/s
          bf16 per chip (the default precision of a float32 matmul on TPU is one bf16
          pass), HBM2 1,200 GB/s; ICI 400 Gb/s = 50 GB/s per link and direction (Jouppi
          et al., "TPU v4: An Optically Reconfigurable Supercomputer ...", ISCA 2023).

Launch and kernel overheads and link latencies of the accelerators are not
datasheet figures: they are order-of-magnitude estimates — one JAX dispatch per
task (20 µs), a CUDA kernel launch per kernel (2 µs; TPUs run a compiled program's
operations back to back without host launches: 0.2 µs), a small device-to-device
copy (10 µs GPUs, 5 µs TPU ICI). Replace them with
`dataclasses.replace(preset('h100'), kernel_overhead=...)` when you have a
measurement.
"""

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsgd.scheduler import transfer
from jaxsgd.scheduler.costs import CostModel


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """What the roofline needs to know about a device and its links.

  Attributes:
    name: the preset's name.
    peak_flops: floating-point operations per second.
    memory_bandwidth: bytes per second between the device and its memory.
    launch_overhead: seconds added to every task (its host dispatch).
    kernel_overhead: seconds added per kernel of the task (launch, allocation).
    link_bandwidth: bytes per second of a device-to-device link, one direction.
    link_latency: seconds per transfer.
    precision: which peak `peak_flops` is (e.g. 'tf32 tensor core, dense').
  """

  name: str
  peak_flops: float
  memory_bandwidth: float
  launch_overhead: float
  link_bandwidth: float
  link_latency: float
  kernel_overhead: float = 0.0
  precision: str = ''

  def __post_init__(self):
    for field in ('peak_flops', 'memory_bandwidth', 'link_bandwidth'):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(
          f'cost.device {self.name!r}: {field} must be a finite number > 0, got {value!r}.'
        )
    for field in ('launch_overhead', 'kernel_overhead', 'link_latency'):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(
          f'cost.device {self.name!r}: {field} must be a finite number of '
          f'seconds >= 0, got {value!r}.'
        )


PRESETS = {
  # Measured on this machine by benchmarks/device_spec.py (see the module docstring).
  'cpu': DeviceSpec(
    'cpu',
    peak_flops=4.1e11,
    memory_bandwidth=1.1e11,
    launch_overhead=4.7e-6,
    link_bandwidth=2.5e9,
    link_latency=2.2e-5,
    kernel_overhead=1.7e-6,
    precision='float32 (XLA:CPU matmul, measured)',
  ),
  'cpu_core': DeviceSpec(
    'cpu_core',
    peak_flops=1.95e11,
    memory_bandwidth=5.9e10,
    launch_overhead=5e-6,
    link_bandwidth=2.0e9,
    link_latency=2.5e-5,
    kernel_overhead=1.7e-6,
    precision='float32 (one core, measured)',
  ),
  'v100': DeviceSpec(
    'v100',
    peak_flops=15.7e12,
    memory_bandwidth=900e9,
    launch_overhead=20e-6,
    link_bandwidth=150e9,
    link_latency=10e-6,
    kernel_overhead=2e-6,
    precision='fp32 (no tf32 on Volta)',
  ),
  'a100': DeviceSpec(
    'a100',
    peak_flops=156e12,
    memory_bandwidth=2039e9,
    launch_overhead=20e-6,
    link_bandwidth=300e9,
    link_latency=10e-6,
    kernel_overhead=2e-6,
    precision='tf32 tensor core, dense',
  ),
  'h100': DeviceSpec(
    'h100',
    peak_flops=494.7e12,
    memory_bandwidth=3.35e12,
    launch_overhead=20e-6,
    link_bandwidth=450e9,
    link_latency=10e-6,
    kernel_overhead=2e-6,
    precision='tf32 tensor core, dense',
  ),
  'h200': DeviceSpec(
    'h200',
    peak_flops=494.7e12,
    memory_bandwidth=4.8e12,
    launch_overhead=20e-6,
    link_bandwidth=450e9,
    link_latency=10e-6,
    kernel_overhead=2e-6,
    precision='tf32 tensor core, dense',
  ),
  'tpu_v4': DeviceSpec(
    'tpu_v4',
    peak_flops=275e12,
    memory_bandwidth=1200e9,
    launch_overhead=20e-6,
    link_bandwidth=50e9,
    link_latency=5e-6,
    kernel_overhead=0.2e-6,
    precision='bf16 (default precision of a float32 matmul on TPU)',
  ),
}


def preset(name: str) -> DeviceSpec:
  """The named device; refuses an unknown name, listing the known ones."""
  if name not in PRESETS:
    raise ValueError(f'cost.device: unknown device {name!r}; allowed: {", ".join(PRESETS)}.')
  return PRESETS[name]


# --- operation counts ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpCounts:
  flops: float
  bytes_accessed: float
  kernels: int = 0


def op_counts(fn: Callable, args: tuple) -> OpCounts:
  """XLA's count of `fn(*args)` as compiled here (`fn` need not be jitted already)."""
  jitted = fn if hasattr(fn, 'lower') else jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per computation.
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return OpCounts(
    float(analysis.get('flops', 0.0)),
    float(analysis.get('bytes accessed', 0.0)),
    count_kernels(compiled.as_text()),
  )


_NOT_KERNELS = frozenset({'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast'})
_OPCODE = re.compile(r' = .*? ([a-z][a-z0-9-]*)\(')


def count_kernels(hlo_text: str) -> int:
  """Operations of the ENTRY computation of compiled HLO text, less those that move
  no data (parameters, constants, tuples, bitcasts): the kernels a device runs."""
  entry = hlo_text[hlo_text.index('ENTRY') :]
  body = entry[entry.index('{') + 1 : entry.index('\n}')]
  count = 0
  for line in body.splitlines():
    match = _OPCODE.search(line)
    if match and match.group(1) not in _NOT_KERNELS:
      count += 1
  return count


def roofline_seconds(counts: OpCounts, spec: DeviceSpec) -> float:
  """`max(flops / peak, bytes / bandwidth) + launch + kernels · kernel_overhead`."""
  return (
    max(counts.flops / spec.peak_flops, counts.bytes_accessed / spec.memory_bandwidth)
    + spec.launch_overhead
    + counts.kernels * spec.kernel_overhead
  )


def analytic_costs(
  calls: Mapping[Any, tuple[Callable, tuple]],
  spec: DeviceSpec,
) -> dict[Any, float]:
  """`{key: roofline seconds}` for the same `{key: (fn, args)}` `costs.time_calls` takes.

  Compiles every call but runs none: the result does not depend on this machine's load.
  """
  return {key: roofline_seconds(op_counts(fn, args), spec) for key, (fn, args) in calls.items()}


def cost_model(spec: DeviceSpec, compute: Mapping[Any, float], **cost_model_fields) -> CostModel:
  """A `CostModel` with `compute` and the spec's links (other fields passed through)."""
  return CostModel(
    compute=dict(compute),
    link_latency=spec.link_latency,
    link_bandwidth=spec.link_bandwidth,
    **cost_model_fields,
  )


def pipeline_costs(pipeline, roles, batch: dict, spec: DeviceSpec) -> dict:
  """Roofline seconds per `(stage, kind)` of `pipeline`'s stages in `roles`: the
  analytic counterpart of `PlacedStages.time_tasks(roles, batch)`."""
  calls = pipeline.task_calls(roles, batch)
  return analytic_costs(calls, spec)


# --- measuring this machine ------------------------------------------------------------------
def _fastest(
  fn: Callable, args: tuple, reps: int, clock: Callable[[], float] = time.perf_counter
) -> float:
  transfer.wait(fn(*args))
  best = math.inf
  for _ in range(reps):
    start = clock()
    transfer.wait(fn(*args))
    best = min(best, clock() - start)
  return best


def measure_device_spec(
  name: str = 'measured',
  *,
  matmul_size: int = 2048,
  copy_bytes: int = 256 * 2**20,
  reps: int = 10,
  device: jax.Device | None = None,
  clock: Callable[[], float] = time.perf_counter,
) -> DeviceSpec:
  """A `DeviceSpec` of `device` (default: the first), measured (fastest of `reps`).

  peak_flops: a float32 `matmul_size`² matmul, 2 n³ flops over its fastest time.
  memory_bandwidth: `x ← x + 1` in place (`x` donated) over `copy_bytes` of float32,
    XLA's bytes accessed (read and write) over its fastest time. In place because a
    fresh output of that size pays the kernel's page faults (measured here: 5 GB/s
    with a new output, 58 GB/s in place), which a training step's reused buffers
    do not.
  launch_overhead: a blocking call of a trivial jitted function.
  kernel_overhead: `[a * 2 + 1 for a in leaves]` over 200 leaves of 16 floats (200
    kernels, each with its own output) against 1 leaf: the extra time per kernel.
  `clock` times peak and bandwidth (`time.process_time` for a process pinned to one
  core: the time it ran, not the time other jobs held the core); the fixed costs
  are always wall time (a blocked call's CPU time misses the wait).
  link: `device_put` from `device` to another device: latency = a 4-byte copy,
    bandwidth = 64 MiB over (its time − latency) (with one device, the link is the
    memory: latency 0, bandwidth = memory_bandwidth).
  """
  devices = jax.devices()
  device = device or devices[0]
  n = matmul_size
  a = jax.device_put(np.ones((n, n), np.float32), device)
  matmul = jax.jit(lambda x, y: x @ y)
  peak = 2.0 * n**3 / _fastest(matmul, (a, a), reps, clock)
  bandwidth = _stream_bandwidth(copy_bytes, device, reps, clock)
  tiny = jnp.zeros((), jnp.float32, device=device)
  launch = _fastest(jax.jit(lambda v: v + 1), (tiny,), max(reps, 100))
  kernel = _kernel_overhead(device, max(reps, 100))
  others = [d for d in devices if d != device]
  if others:
    latency, link_bandwidth = _fit_link(device, others[0], reps)
  else:
    latency, link_bandwidth = 0.0, bandwidth
  return DeviceSpec(
    name,
    peak_flops=peak,
    memory_bandwidth=bandwidth,
    launch_overhead=launch,
    link_bandwidth=link_bandwidth,
    link_latency=latency,
    kernel_overhead=kernel,
    precision='float32, measured',
  )


def _stream_bandwidth(nbytes: int, device: jax.Device, reps: int, clock) -> float:
  add_one = jax.jit(lambda v: v + 1, donate_argnums=0)
  state = [jax.device_put(np.zeros(nbytes // 4, np.float32), device)]
  moved = op_counts(jax.jit(lambda v: v + 1), (state[0],)).bytes_accessed

  def step():
    state[0] = add_one(state[0])
    return state[0]

  return moved / _fastest(step, (), reps, clock)


def _kernel_overhead(device: jax.Device, reps: int) -> float:
  def time_for(num_leaves):
    leaves = [jax.device_put(np.ones(16, np.float32), device) for _ in range(num_leaves)]
    fn = jax.jit(lambda t: [a * 2 + 1 for a in t])
    return _fastest(fn, (leaves,), reps), op_counts(fn, (leaves,)).kernels

  (few, few_kernels), (many, many_kernels) = time_for(1), time_for(200)
  return max(many - few, 0.0) / max(many_kernels - few_kernels, 1)


def _fit_link(source: jax.Device, destination: jax.Device, reps: int) -> tuple[float, float]:
  def copy_time(nbytes):
    x = jax.device_put(np.ones(max(nbytes // 4, 1), np.float32), source)
    return _fastest(lambda v: jax.device_put(v, destination), (x,), reps)

  latency = copy_time(4)
  big = 64 * 2**20
  return latency, big / max(copy_time(big) - latency, 1e-12)
