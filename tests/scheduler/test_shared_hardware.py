"""Stages placed on one device share it on the virtual clock: their tasks run one at a time.

`placement.stage_to_device` is the hardware modelled. With both stages of DDG K = 2 on one
device and free links, the device is never idle once the first forward has started, so
the makespan is exactly the sum of every task's cost: steps × Σ_k (f_k + b_k + u_k), less
stage 0's last backward and update (its delay is 1: the last batch's backward is never run).
"""

import pytest

from experiments.configs import ddg as ddg_config
from jaxsgd import training

STEPS = 10
COSTS = {'forward': [1e-3, 2e-3], 'backward': [3e-3, 4e-3], 'update': [5e-4, 5e-4]}


def _run(data_dir, tmp_path, stage_to_device):
  config = ddg_config.get_config('smoke')
  config.data_dir = data_dir
  config.update_from_flattened_dict(
    {
      'stages': 2,
      'train_steps': STEPS,
      'eval_every': STEPS,
      'cost.calibrate': False,
      'placement.stage_to_device': stage_to_device,
    }
  )
  config.cost.compute.update(COSTS)
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  return summary['sim_time']


def test_two_stages_on_one_device_run_one_task_at_a_time(data_dir, tmp_path):
  shared = _run(data_dir, tmp_path / 'shared', (0, 0))
  total = STEPS * sum(sum(per_stage) for per_stage in COSTS.values())
  total -= COSTS['backward'][0] + COSTS['update'][0]  # dropped at the end (delay 1)
  assert shared == pytest.approx(total, rel=1e-12)


def test_two_devices_overlap_their_stages(data_dir, tmp_path):
  shared = _run(data_dir, tmp_path / 'shared', (0, 0))
  apart = _run(data_dir, tmp_path / 'apart', (0, 1))
  # Stage 1's work per step (2 + 4 + 0.5 ms) bounds the pipelined makespan from below.
  assert STEPS * 6.5e-3 <= apart < shared
