"""Analytic (roofline) costs: hand-computed cases, presets, determinism."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from jaxsgd.algorithms import ddg
from jaxsgd.algorithms import local
from jaxsgd.pipeline import sequential_roles
from jaxsgd.scheduler import VirtualExecutor, hardware
from scheduler_helpers import pipeline_for, take, train

SPEC = hardware.DeviceSpec(
  'test',
  peak_flops=1e9,
  memory_bandwidth=1e8,
  launch_overhead=1e-6,
  link_bandwidth=2e9,
  link_latency=3e-6,
)


def test_xla_counts_a_matmul_as_by_hand():
  a, b = jnp.ones((256, 512)), jnp.ones((512, 128))
  counts = hardware.op_counts(lambda x, y: x @ y, (a, b))
  assert counts.flops == 2 * 256 * 512 * 128
  assert counts.bytes_accessed == 4 * (256 * 512 + 512 * 128 + 256 * 128)
  assert counts.kernels == 1


def test_roofline_of_a_compute_bound_matmul():
  """2·256·512·128 = 33,554,432 flops at 1 GFLOP/s = 33.554432 ms; its 917,504 bytes at
  100 MB/s take 9.17504 ms, less: the flops decide. Plus 1 µs launch."""
  a, b = jnp.ones((256, 512)), jnp.ones((512, 128))
  costs = hardware.analytic_costs({'matmul': (lambda x, y: x @ y, (a, b))}, SPEC)
  assert costs['matmul'] == pytest.approx(33.554432e-3 + 1e-6, rel=1e-12)


def test_kernels_are_counted_and_charged():
  """Ten independent `a · 2 + 1` with ten outputs: ten loop fusions on XLA:CPU, each
  charged `kernel_overhead` (5 µs here) on top of the roofline and the launch."""
  leaves = [jnp.ones(16, jnp.float32) for _ in range(10)]
  counts = hardware.op_counts(lambda t: [a * 2 + 1 for a in t], (leaves,))
  # Bytes: 64 read + 64 written per leaf, and XLA counts 8 per element of the output tuple.
  assert (counts.flops, counts.bytes_accessed, counts.kernels) == (320, 10 * (2 * 64 + 8), 10)
  spec = dataclasses.replace(SPEC, kernel_overhead=5e-6)
  assert hardware.roofline_seconds(counts, spec) == pytest.approx(
    max(320 / 1e9, 1360 / 1e8) + 1e-6 + 10 * 5e-6, rel=1e-12
  )


def test_count_kernels_reads_the_entry_computation():
  hlo = """HloModule m
%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %a = f32[2]{0} add(%p, %p)
}

ENTRY %main (x: f32[2]) -> (f32[2], f32[2]) {
  %x = f32[2]{0} parameter(0), metadata={op_name="x"}
  %c = f32[] constant(1)
  %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/add"}
  %g = (f32[2]{0}, f32[2]{0}) fusion(%x, %f), kind=kLoop, calls=%fused
  %b = f32[2]{0} bitcast(%f)
  %y = f32[2]{0} copy(%b)
  ROOT %t = (f32[2]{0}, f32[2]{0}) tuple(%f, %y)
}
"""
  assert hardware.count_kernels(hlo) == 3  # two fusions and a copy


def test_roofline_of_a_memory_bound_add():
  """x + 1 over 10⁶ floats: 10⁶ flops (1 ms) but 8·10⁶ bytes read and written (80 ms)."""
  x = jnp.zeros(10**6, jnp.float32)
  counts = hardware.op_counts(jax.jit(lambda v: v + 1), (x,))
  assert (counts.flops, counts.bytes_accessed, counts.kernels) == (1e6, 8e6, 1)
  assert hardware.roofline_seconds(counts, SPEC) == pytest.approx(80e-3 + 1e-6, rel=1e-12)


def test_presets_are_complete_and_positive():
  assert {'cpu', 'v100', 'a100', 'h100', 'h200', 'tpu_v4'} <= set(hardware.PRESETS)
  for name, spec in hardware.PRESETS.items():
    assert spec.name == name and spec.precision
    for field in dataclasses.fields(spec):
      value = getattr(spec, field.name)
      if isinstance(value, float):
        assert math.isfinite(value) and value >= 0, (name, field.name)
    assert spec.peak_flops > 0 and spec.memory_bandwidth > 0 and spec.link_bandwidth > 0
  # Newer GPUs are faster at everything the roofline uses.
  v100, a100, h100 = (hardware.preset(n) for n in ('v100', 'a100', 'h100'))
  assert v100.peak_flops < a100.peak_flops < h100.peak_flops
  assert v100.memory_bandwidth < a100.memory_bandwidth < h100.memory_bandwidth


def test_unknown_device_and_bad_specs_are_refused():
  with pytest.raises(ValueError, match="cost.device: unknown device 'b200'; allowed: cpu"):
    hardware.preset('b200')
  with pytest.raises(ValueError, match='peak_flops must be a finite number > 0'):
    dataclasses.replace(SPEC, peak_flops=0.0)
  with pytest.raises(ValueError, match='link_latency must be a finite number of seconds'):
    dataclasses.replace(SPEC, link_latency=-1.0)


def test_cost_model_takes_the_links_of_the_spec():
  model = hardware.cost_model(SPEC, {'forward': 1.0}, straggler_std=0.0)
  assert model.transfer_time(4_000) == pytest.approx(3e-6 + 4_000 / 2e9, rel=1e-12)
  assert model.base('forward', 0) == 1.0


def test_pipeline_costs_are_deterministic_and_simulate_identically():
  roles = sequential_roles(2)
  pipeline, batch = pipeline_for(roles), take(1)[0]
  first = hardware.pipeline_costs(pipeline, roles, batch, hardware.preset('h100'))
  second = hardware.pipeline_costs(pipeline, roles, batch, hardware.preset('h100'))
  assert first == second
  assert set(first) == {(k, kind) for k in range(2) for kind in ('forward', 'backward', 'update')}
  launch = hardware.preset('h100').launch_overhead
  assert all(seconds > launch for seconds in first.values())
  timelines = [
    train(
      pipeline, roles, 5, executor=VirtualExecutor(hardware.cost_model(hardware.preset('h100'), c))
    )[1]
    for c in (first, second)
  ]
  assert timelines[0].makespan == timelines[1].makespan > 0
  assert [(r.lane, r.start, r.end) for r in timelines[0].records] == [
    (r.lane, r.start, r.end) for r in timelines[1].records
  ]


def test_a_faster_device_gives_shorter_tasks():
  roles = sequential_roles(2)
  pipeline, batch = pipeline_for(roles), take(1)[0]
  v100 = hardware.pipeline_costs(pipeline, roles, batch, hardware.preset('v100'))
  h100 = hardware.pipeline_costs(pipeline, roles, batch, hardware.preset('h100'))
  assert all(h100[k] < v100[k] for k in v100)


@pytest.mark.parametrize(
  'roles',
  [
    ddg.roles(2, 'recompute'),
    ddg.roles(2, 'stale_graph'),
    local.roles(2),
    local.roles(3, 'overlapping'),
  ],
  ids=['ddg-recompute', 'ddg-stale-graph', 'local-greedy', 'local-overlapping'],
)
def test_every_role_kind_has_a_roofline(roles):
  """Recomputing backwards and auxiliary heads compile and count like the rest; a
  recomputing backward repeats the forward, so it counts more flops than the plain one."""
  pipeline, batch = pipeline_for(roles), take(1)[0]
  spec = dataclasses.replace(hardware.preset('cpu'), launch_overhead=0.0, kernel_overhead=0.0)
  costs = hardware.pipeline_costs(pipeline, roles, batch, spec)
  assert set(costs) == {
    (k, kind) for k in range(len(roles)) for kind in ('forward', 'backward', 'update')
  }
  assert all(seconds > 0 for seconds in costs.values())
  if roles[0].backward_form == 'recompute':
    plain = hardware.pipeline_costs(
      pipeline_for(sequential_roles(2)), sequential_roles(2), batch, spec
    )
    assert costs[(0, 'backward')] > plain[(0, 'backward')]
