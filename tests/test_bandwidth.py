"""`experiments.bandwidth`: compute utilization against bandwidth, by hand, and the
abstract pricing of a worker step equal to the pricing of the step on real arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import bandwidth
from jaxsgd.models import zoo
from jaxsgd.scheduler import hardware
from jaxsgd.spmd import step as step_lib


def test_utilization_by_hand():
  # 4 workers, 8 MB of weights, links of 1e7 bytes/s and no latency; a step 0.5 s.
  # DiLoCo H=8: one all-reduce of 2 * 3/4 * 8e6 / 1e7 = 1.2 s per 8 steps of 4 s.
  diloco = bandwidth.Method('DiLoCo', 8)
  assert diloco.utilization(0.5, 8e6, 4, 1e7, 0.0) == pytest.approx(4 / 5.2, rel=1e-12)
  # Streaming, P=2, τ=1: half the weights (0.6 s) every 4 steps (2 s), 0.5 s of it hidden.
  streaming = bandwidth.Method('streaming', 8, fragments=2, delay=1)
  assert streaming.utilization(0.5, 8e6, 4, 1e7, 0.0) == pytest.approx(2 / 2.1, rel=1e-12)
  # Data-parallel: 1.2 s after every step of 0.5 s.
  assert bandwidth.Method('dp', 1).utilization(0.5, 8e6, 4, 1e7, 0.0) == pytest.approx(0.5 / 1.7)


@pytest.mark.parametrize('target', [0.5, 0.9, 0.99])
def test_the_bandwidth_needed_gives_exactly_that_utilization(target):
  for method in bandwidth.methods(period=100, fragments=4, delay=5):
    needed = method.bandwidth_for(target, 0.4, 4e9, 8, 1e-3)
    if needed == float('inf'):  # The latency alone is over the budget.
      assert method.utilization(0.4, 4e9, 8, 1e15, 1e-3) < target, method.label
    else:
      assert method.utilization(0.4, 4e9, 8, needed, 1e-3) == pytest.approx(target), method.label


def test_the_study_lists_every_method_and_its_peak_bytes():
  result = bandwidth.study(0.4, 4e9, 8, 1e-3, bandwidth.methods(100, 4, 5), (1, 10))
  assert list(result['bytes_per_sync'].values()) == [4e9, 4e9, 1e9, 1e9]
  for values in result['utilization'].values():
    assert len(values) == 2 and values[0] < values[1] <= 1


def test_abstract_pricing_equals_pricing_the_step_on_real_arrays():
  spec = hardware.preset('h100')
  shape = {'width': 16, 'blocks': 1, 'heads': 2, 'length': 8, 'batch': 2}
  seconds, parameters = bandwidth.abstract_step_seconds(spec, **shape)
  model = zoo.transformer((8,), 256, width=16, blocks=1, heads=2)
  variables = model.init(jax.random.key(0))
  tx = optax.adamw(1e-4)
  batch = {'image': jnp.zeros((2, 8), jnp.float32), 'label': jnp.zeros((2, 8), jnp.int32)}
  step = jax.jit(step_lib.make_worker_step(model, tx, average_grads=False))
  counts = hardware.op_counts(step, (variables, tx.init(variables['params']), batch))
  assert seconds == hardware.roofline_seconds(counts, spec)
  assert parameters == sum(np.size(x) for x in jax.tree.leaves(variables['params']))


@pytest.mark.parametrize(
  'argv, field',
  [
    (['--delay=25'], '--delay'),
    (['--period=10', '--fragments=4'], '--period'),
    (['--workers=0'], '--workers'),
  ],
)
def test_bad_settings_are_refused_in_one_line_naming_the_flag(argv, field, capsys):
  with pytest.raises(SystemExit) as stop:
    bandwidth.parse_args(argv)
  assert stop.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert f'error: {field}:' in error
  others = {'--delay', '--period', '--workers'} - {field}
  assert not any(other in error for other in others), error
