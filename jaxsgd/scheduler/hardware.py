"""Analytic task costs: XLA's operation counts on a named device (the roofline).

A task's cost on a device it never ran on:

    seconds = max(flops / peak_flops, bytes / memory_bandwidth) + launch_overhead
    transfer of n bytes = link_latency + n / link_bandwidth

`flops` and `bytes` (bytes accessed) come from XLA's cost analysis of the
compiled task (`jitted.lower(*args).compile().cost_analysis()`), the rest from a
`DeviceSpec`. The result is a pure function of the program and the spec, so a
run with `--config.cost.device=h100` simulates H100s on a laptop, the same
simulated times on any machine, any load.

What it leaves out (see docs/simulator.md for how far it is from measured costs
on this CPU): the operation counts are those of the program compiled for *this*
machine's backend (fusion differs on a GPU, which changes bytes more than
flops); every operation is assumed to reach the peak (real kernels do not, small
ones by far); and the launch overhead is one figure per task, whatever the
number of kernels in it.

Presets (`PRESETS`; peak = the rate JAX's *default* precision gets for float32
arrays, which is what jaxsgd's models use):

  cpu     this project's machine (2 vCPUs of an AMD EPYC, Zen 5, AVX-512, KVM), measured
          by `measure_device_spec` (benchmarks/device_spec.py,
          benchmarks/results/device_spec.txt): peak = the fastest float32 2048² matmul,
          bandwidth = the fastest `x + 1` over 512 MiB (bytes read + written), launch =
          one blocking call of a trivial jitted function, link = `device_put` between two
          CPU devices (fitted latency + n / bandwidth).
  v100    NVIDIA Tesla V100 SXM2 datasheet (2017): FP32 15.7 TFLOP/s (Volta has no
          TF32, so float32 matmuls run at the FP32 rate), HBM2 900 GB/s, NVLink 300 GB/s
          total bidirectional -> 150 GB/s one way.
  a100    NVIDIA A100 datasheet (SXM4 80 GB, 2021): TF32 Tensor Core 156 TFLOP/s dense
          (JAX's default precision lets float32 matmuls and convolutions use TF32 on
          Ampere and later), HBM2e 2,039 GB/s, NVLink 600 GB/s -> 300 GB/s one way.
  h100    NVIDIA H100 datasheet (SXM5, 2022): TF32 Tensor Core 989 TFLOP/s with 2:4
          sparsity -> 494.7 dense (why TF32: as for the A100), HBM3 3.35 TB/s, NVLink
          900 GB/s -> 450 GB/s one way.
  tpu_v4  Google Cloud TPU v4 documentation (cloud.google.com/tpu/docs/v4): 275 TFLOP/s
          bf16 per chip (the default precision of a float32 matmul on TPU is one bf16
          pass), HBM2 1,200 GB/s; ICI 400 Gb/s = 50 GB/s per link and direction (Jouppi
          et al., "TPU v4: An Optically Reconfigurable Supercomputer ...", ISCA 2023).

Launch overheads and link latencies of the accelerators are not datasheet figures:
they are estimates of one JAX dispatch plus a kernel launch (20 µs per task) and of
a small device-to-device copy (10 µs GPUs, 5 µs TPU ICI); replace them with
`dataclasses.replace(preset('h100'), launch_overhead=...)` when you have a
measurement.
"""

import dataclasses
import math
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
    launch_overhead: seconds added to every task (dispatch and launch).
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
  precision: str = ''

  def __post_init__(self):
    for field in ('peak_flops', 'memory_bandwidth', 'link_bandwidth'):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f'cost.device {self.name!r}: {field} must be a finite number > 0, '
                         f'got {value!r}.')
    for field in ('launch_overhead', 'link_latency'):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(f'cost.device {self.name!r}: {field} must be a finite number of '
                         f'seconds >= 0, got {value!r}.')


PRESETS = {
    # Measured on this machine by benchmarks/device_spec.py (see the module docstring).
    'cpu': DeviceSpec('cpu', peak_flops=4.1e11, memory_bandwidth=1.1e11,
                      launch_overhead=4.7e-6, link_bandwidth=2.5e9, link_latency=2.2e-5,
                      precision='float32 (XLA:CPU matmul, measured)'),
    'v100': DeviceSpec('v100', peak_flops=15.7e12, memory_bandwidth=900e9,
                       launch_overhead=20e-6, link_bandwidth=150e9, link_latency=10e-6,
                       precision='fp32 (no tf32 on Volta)'),
    'a100': DeviceSpec('a100', peak_flops=156e12, memory_bandwidth=2039e9,
                       launch_overhead=20e-6, link_bandwidth=300e9, link_latency=10e-6,
                       precision='tf32 tensor core, dense'),
    'h100': DeviceSpec('h100', peak_flops=494.7e12, memory_bandwidth=3.35e12,
                       launch_overhead=20e-6, link_bandwidth=450e9, link_latency=10e-6,
                       precision='tf32 tensor core, dense'),
    'tpu_v4': DeviceSpec('tpu_v4', peak_flops=275e12, memory_bandwidth=1200e9,
                         launch_overhead=20e-6, link_bandwidth=50e9, link_latency=5e-6,
                         precision='bf16 (default precision of a float32 matmul on TPU)'),
}


def preset(name: str) -> DeviceSpec:
  """The named device; refuses an unknown name, listing the known ones."""
  if name not in PRESETS:
    raise ValueError(f'cost.device: unknown device {name!r}; allowed: '
                     f'{", ".join(PRESETS)}.')
  return PRESETS[name]


# --- operation counts ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpCounts:
  flops: float
  bytes_accessed: float


def op_counts(fn: Callable, args: tuple) -> OpCounts:
  """XLA's count of `fn(*args)` as compiled here (`fn` need not be jitted already)."""
  jitted = fn if hasattr(fn, 'lower') else jax.jit(fn)
  analysis = jitted.lower(*args).compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per computation.
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return OpCounts(float(analysis.get('flops', 0.0)), float(analysis.get('bytes accessed', 0.0)))


def roofline_seconds(counts: OpCounts, spec: DeviceSpec) -> float:
  """`max(flops / peak, bytes / bandwidth) + launch`: the task's time at the roofline."""
  return (max(counts.flops / spec.peak_flops, counts.bytes_accessed / spec.memory_bandwidth)
          + spec.launch_overhead)


def analytic_costs(calls: Mapping[Any, tuple[Callable, tuple]], spec: DeviceSpec,
                   ) -> dict[Any, float]:
  """`{key: roofline seconds}` for the same `{key: (fn, args)}` `costs.calibrate` takes.

  Compiles every call but runs none: the result does not depend on this machine's load.
  """
  return {key: roofline_seconds(op_counts(fn, args), spec) for key, (fn, args) in calls.items()}


def cost_model(spec: DeviceSpec, compute: Mapping[Any, float], **cost_model_fields) -> CostModel:
  """A `CostModel` with `compute` and the spec's links (other fields passed through)."""
  return CostModel(compute=dict(compute), link_latency=spec.link_latency,
                   link_bandwidth=spec.link_bandwidth, **cost_model_fields)


def pipeline_costs(pipeline, roles, batch: dict, spec: DeviceSpec) -> dict:
  """Roofline seconds per `(stage, kind)` of `pipeline`'s stages in `roles`: the
  analytic counterpart of `Pipeline.calibrate(roles, batch)`."""
  return analytic_costs(pipeline._calibration_calls(roles, batch),  # pylint: disable=protected-access
                        spec)


# --- measuring this machine ------------------------------------------------------------------
def _fastest(fn: Callable, args: tuple, reps: int) -> float:
  transfer.wait(fn(*args))
  best = math.inf
  for _ in range(reps):
    start = time.perf_counter()
    transfer.wait(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measure_device_spec(name: str = 'measured', *, matmul_size: int = 2048,
                        copy_bytes: int = 256 * 2**20, reps: int = 10,
                        device: jax.Device | None = None) -> DeviceSpec:
  """A `DeviceSpec` of `device` (default: the first), measured (fastest of `reps`).

  peak_flops: a float32 `matmul_size`² matmul, 2 n³ flops over its fastest time.
  memory_bandwidth: `x ← x + 1` in place (`x` donated) over `copy_bytes` of float32,
    XLA's bytes accessed (read and write) over its fastest time. In place because a
    fresh output of that size pays the kernel's page faults (measured here: 5 GB/s
    with a new output, 58 GB/s in place), which a training step's reused buffers
    do not.
  launch_overhead: a blocking call of a trivial jitted function.
  link: `device_put` from `device` to another device: latency = a 4-byte copy,
    bandwidth = 64 MiB over (its time − latency) (with one device, the link is the
    memory: latency 0, bandwidth = memory_bandwidth).
  """
  devices = jax.devices()
  device = device or devices[0]
  n = matmul_size
  a = jax.device_put(np.ones((n, n), np.float32), device)
  matmul = jax.jit(lambda x, y: x @ y)
  peak = 2.0 * n**3 / _fastest(matmul, (a, a), reps)
  bandwidth = _stream_bandwidth(copy_bytes, device, reps)
  tiny = jnp.zeros((), jnp.float32, device=device)
  launch = _fastest(jax.jit(lambda v: v + 1), (tiny,), max(reps, 100))
  others = [d for d in devices if d != device]
  if others:
    latency, link_bandwidth = _fit_link(device, others[0], reps)
  else:
    latency, link_bandwidth = 0.0, bandwidth
  return DeviceSpec(name, peak_flops=peak, memory_bandwidth=bandwidth, launch_overhead=launch,
                    link_bandwidth=link_bandwidth, link_latency=latency,
                    precision='float32, measured')


def _stream_bandwidth(nbytes: int, device: jax.Device, reps: int) -> float:
  add_one = jax.jit(lambda v: v + 1, donate_argnums=0)
  state = [jax.device_put(np.zeros(nbytes // 4, np.float32), device)]
  moved = op_counts(jax.jit(lambda v: v + 1), (state[0],)).bytes_accessed

  def step():
    state[0] = add_one(state[0])
    return state[0]
  return moved / _fastest(step, (), reps)


def _fit_link(source: jax.Device, destination: jax.Device, reps: int) -> tuple[float, float]:
  def copy_time(nbytes):
    x = jax.device_put(np.ones(max(nbytes // 4, 1), np.float32), source)
    return _fastest(lambda v: jax.device_put(v, destination), (x,), reps)
  latency = copy_time(4)
  big = 64 * 2**20
  return latency, big / max(copy_time(big) - latency, 1e-12)
