"""Simulated times do not move: two runs of one config give the same `metrics.jsonl`,
`sim_time` included, for every family, whatever the machine's load in between.

The default cost source (`cost.calibrate=True`) measures the tasks once and keeps them as a
profile where the data lives; a profile file (`cost.profile`) and a hardware preset
(`cost.device`) are deterministic from the start.
"""

import importlib
import json

import pytest
from scheduler_helpers import host_file

from jaxsgd.training import train_and_evaluate

# A host profile of the process executor for the run-ahead cases (written per test).
_DRIVEN = {'driver': 1e-4, 'driver_latency': 3e-4, 'dispatch': 5e-5}

# (config, variant overrides): one smoke run per family on the virtual clock.
FAMILIES = {
  'bp (staged)': ('ddg', {'algorithm.name': 'bp', 'algorithm.variant': None}),
  'ddg': ('ddg', {}),
  'local': ('local', {}),
  'asgd': ('asgd', {}),
  'dcasgd': ('dcasgd', {}),
  'lppsgd': ('lppsgd', {}),
  'pdasgd': ('pdasgd', {}),
  # The process executor's host, simulated (`cost.host`, a host profile with a driver):
  # what a task waits for and the copies it pays are decided by the same events, in the
  # same order.
  'ddg (run ahead)': ('ddg', {'cost.host': _DRIVEN}),
  'asgd (run ahead)': ('asgd', {'cost.host': _DRIVEN}),
  'pdasgd (run ahead)': ('pdasgd', {'cost.host': _DRIVEN}),
  'lppsgd (run ahead)': ('lppsgd', {'cost.host': _DRIVEN}),
  'dasgd': ('dasgd', {'cost.calibrate': True, 'cost.compute.step': None}),
  'streaming_diloco': ('streaming_diloco', {'cost.calibrate': True, 'cost.compute.step': None}),
}


def _config(name, data_dir, overrides, directory=None):
  config = importlib.import_module(f'experiments.configs.{name}').get_config('smoke')
  config.data_dir = data_dir
  config.clock = 'virtual'
  for field, value in overrides.items():
    if field == 'cost.host':
      value = host_file(directory, **value)
    parent, _, leaf = field.rpartition('.')
    node = config[parent] if parent else config
    if value is None and leaf in ('variant',):
      del node[leaf]  # a field the other algorithm does not have
    else:
      node[leaf] = value
  return config


def _records(workdir):
  """metrics.jsonl without the wall-clock time (the one field that may differ)."""
  lines = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  return [{k: v for k, v in r.items() if k != 'wall_time'} for r in lines]


@pytest.mark.parametrize('family', FAMILIES)
def test_two_runs_give_identical_metrics_and_simulated_times(family, data_dir, tmp_path):
  name, overrides = FAMILIES[family]
  first, second = tmp_path / 'first', tmp_path / 'second'
  train_and_evaluate(_config(name, data_dir, overrides, tmp_path), str(first), show_progress=False)
  train_and_evaluate(_config(name, data_dir, overrides, tmp_path), str(second), show_progress=False)
  a, b = _records(first), _records(second)
  assert [r['sim_time'] for r in a] == [r['sim_time'] for r in b]
  assert a == b
  assert a[-1]['sim_time'] > 0


@pytest.mark.parametrize('device', ['cpu', 'h100'])
def test_a_hardware_preset_gives_fixed_simulated_times(device, data_dir, tmp_path):
  config = _config('ddg', data_dir, {'cost.device': device, 'train_steps': 20, 'eval_every': 10})
  train_and_evaluate(config, str(tmp_path / 'a'), show_progress=False)
  train_and_evaluate(config, str(tmp_path / 'b'), show_progress=False)
  assert _records(tmp_path / 'a') == _records(tmp_path / 'b')


def test_h100_preset_simulates_a_faster_device_than_this_cpu(data_dir, tmp_path):
  times = {}
  for device in ('cpu', 'h100'):
    config = _config('ddg', data_dir, {'cost.device': device, 'train_steps': 20, 'eval_every': 20})
    summary = train_and_evaluate(config, str(tmp_path / device), show_progress=False)
    times[device] = summary['sim_time']
  assert times['h100'] < times['cpu']
