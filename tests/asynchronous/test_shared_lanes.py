"""Asynchronous lanes placed on one device share it (`placement.lane_to_device`).

ASGD with M = 2 workers and explicit costs F = 1, B = 2, U = 1/2 s; worker 1 runs at
half speed (F = 2, B = 4); free links. Hand-computed simulated time of each server update:

    own devices (server | w0 | w1)        server and w0 on device 0, w1 on device 1
    w0 F[0,1] B[1,3], push 3              w0 F[0,1] B[1,3], push 3
    U(w0) [3, 3.5]           → step 1     U(w0) [3, 3.5]                     → step 1
    w0 F[3.5,4.5] B[4.5,6.5]              w0 F[3.5,4.5] B[4.5,6.5]
    w1 F[0,2] B[2,6], push 6              w1 F[0,2] B[2,6], push 6
    U(w1) [6, 6.5]           → step 2     U(w1) waits for w0's backward: [6.5, 7] → step 2
    U(w0) [6.5, 7]           → step 3     U(w0) [7, 7.5]                     → step 3
    w0 F[7,8] B[8,10]                     w0 F[7.5,8.5] B[8.5,10.5]
    U(w0) [10, 10.5]         → step 4     U(w0) [10.5, 11]                   → step 4

(w1's second gradient, begun at 6.5 or 7, arrives after step 4.)
"""

import json
import os

import pytest

from experiments.configs import asgd as asgd_config
from experiments.configs import pdasgd as pdasgd_config
from jaxsgd import training

COSTS = {'forward': 1.0, 'backward': 2.0, 'update': 0.5}


def _config(module, data_dir, overrides):
  config = module.get_config('smoke')
  config.data_dir = data_dir
  config.update_from_flattened_dict(
    {'train_steps': 4, 'eval_every': 1, 'cost.calibrate': False, **overrides}
  )
  config.cost.compute.update(COSTS)
  return config


def _step_times(config, workdir) -> list[float]:
  training.train_and_evaluate(config, str(workdir), show_progress=False)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line)['sim_time'] for line in f]


def _asgd(data_dir, lane_to_device):
  return _config(
    asgd_config,
    data_dir,
    {
      'workers': 2,
      'cost.speeds': (1.0, 0.5),
      'placement.lane_to_device': lane_to_device,
    },
  )


def test_asgd_on_own_devices_matches_the_hand_computed_times(data_dir, tmp_path):
  assert _step_times(_asgd(data_dir, None), tmp_path) == [3.5, 6.5, 7.0, 10.5]
  # Three distinct devices are the same hardware as no map at all.
  assert _step_times(_asgd(data_dir, (0, 1, 2)), tmp_path / 'map') == [3.5, 6.5, 7.0, 10.5]


def test_asgd_server_sharing_a_workers_device_waits_for_its_tasks(data_dir, tmp_path):
  assert _step_times(_asgd(data_dir, (0, 0, 1)), tmp_path) == [3.5, 7.0, 7.5, 11.0]


def test_pdasgd_on_one_device_runs_one_task_at_a_time(data_dir, tmp_path):
  """1 forward and 1 backward worker, one layer group, two batches in flight: on one
  device it is never idle after the start, so step n ends at the sum of the tasks that
  ran before it; apart, the backward of batch k overlaps the forward of batch k + 1."""

  def run(lane_to_device, where):
    config = _config(
      pdasgd_config,
      data_dir,
      {
        'stages': 1,
        'algorithm.n_fwd': 1,
        'algorithm.n_bwd': 1,
        'algorithm.max_inflight': 2,
        'placement.lane_to_device': lane_to_device,
      },
    )
    return _step_times(config, tmp_path / where)

  # Apart: F[0,1] then B+U = 2.5 per step on the backward worker, from 1.
  assert run(None, 'apart') == [3.5, 6.0, 8.5, 11.0]
  # Shared (FIFO): when a forward ends, the backward worker takes its result and queues
  # its backward at that instant, before the forward worker queues the next forward; so
  # the device alternates F, B + U and step n ends at n (F + B + U).
  assert run((0, 0, 0), 'shared') == [3.5, 7.0, 10.5, 14.0]


@pytest.mark.parametrize(
  'overrides, message',
  [
    ({'placement.lane_to_device': (0, 1)}, '2 entries for the 3 lanes of asgd'),
    ({'placement.lane_to_device': (0, -1, 1)}, 'a device index >= 0 per lane'),
    (
      {'placement.lane_to_device': (0, 0, 1), 'clock': 'real'},
      "models shared devices on the virtual clock; set clock='virtual'",
    ),
  ],
)
def test_bad_lane_maps_are_refused_with_one_line(data_dir, tmp_path, overrides, message):
  config = _config(asgd_config, data_dir, {'workers': 2, **overrides})
  with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)


def test_algorithms_without_lanes_to_map_refuse_the_map(data_dir, tmp_path):
  from experiments.configs import lppsgd as lppsgd_config
  from experiments.configs import ddg as ddg_config

  config = _config(lppsgd_config, data_dir, {'placement.lane_to_device': (0,) * 6})
  with pytest.raises(ValueError, match='lppsgd places its workers itself'):
    training.train_and_evaluate(config, str(tmp_path / 'lpp'), show_progress=False)
  config = ddg_config.get_config('smoke')
  config.placement.lane_to_device = (0, 0)
  with pytest.raises(ValueError, match='ddg places stages with placement.stage_to_device'):
    training.train_and_evaluate(config, str(tmp_path / 'ddg'), show_progress=False)
