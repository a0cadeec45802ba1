"""`experiments.train`'s path (`train_and_evaluate`) for each data-parallel method."""

import json
import math

import pytest

from experiments.configs import dasgd as dasgd_config
from experiments.configs import ssgd as ssgd_config
from jaxsgd.spmd import timing
from jaxsgd.training import train_and_evaluate


@pytest.mark.parametrize('variant', ['ssgd', 'local_sgd', 'dasgd', 'diloco'])
def test_smoke_run_learns(data_dir, tmp_path, variant):
  config = (
    ssgd_config.get_config('smoke')
    if variant == 'ssgd'
    else dasgd_config.get_config(f'{variant},smoke')
  )
  config.dataset, config.data_dir, config.model.name = 'digits', data_dir, 'mlp'
  config.optimizer.learning_rate = 1e-2
  config.cost.link_bandwidth = 0.1e9 / 8  # A slow link (0.1 Gbit/s): DaSGD hides only part.
  summary = train_and_evaluate(config, str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert summary['workers'] == 4 and summary['global_batch_size'] == 64
  assert records[-1]['samples'] == 40 * 64
  assert all(math.isfinite(r['train_loss']) for r in records)
  assert records[-1]['train_loss'] < records[0]['train_loss'] < math.log(10)
  assert records[-1]['test_accuracy'] > 0.8  # Chance is 0.1.
  assert {'metrics.jsonl', 'summary.json', 'curves.png'} <= {p.name for p in tmp_path.iterdir()}
  # The virtual clock: sim_time is the time model's, which the summary records.
  clock = timing.StepTimeModel(
    **{k: summary['time_model'][k] for k in ('compute', 'comm', 'period', 'delay', 'hidden')}
  )
  assert clock.compute == config.cost.compute.step and clock.comm > clock.compute
  assert 0 < clock.hidden_fraction() < 1 if variant == 'dasgd' else clock.hidden_fraction() == 0
  for r in records:
    assert r['sim_time'] == pytest.approx(clock.elapsed(r['step']), rel=1e-12)
