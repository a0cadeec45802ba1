"""The shipped configs' virtual runs keep their numbers and their simulated times.

Each case is a shipped config's smoke variant on the virtual clock with fixed task costs
(`cost.compute`, or the `cpu` preset), alone or with one of the simulator's schedule and
host settings. Its fingerprint — every logged record's `sim_time`, loss and accuracy, and
a digest of every task's lane, name, start and end in `trace.json` — is kept in
`tests/fingerprints/virtual_runs.json`. A refactoring of the cost model or of the virtual
clock must leave all of them as they are; a change that is meant to move simulated times
regenerates the file (`python -m tests.test_virtual_fingerprints`) and says why in its
commit.

Simulated times and the trace are compared exactly (they are sums of the priced costs in
the order the schedule decides); losses to a relative 1e-5 and accuracies to 1e-3, since
XLA may round differently on another CPU.
"""

import hashlib
import importlib
import json
import os
import pathlib
import sys

import pytest

from jaxsgd.scheduler import host as host_lib

FINGERPRINTS = pathlib.Path(__file__).parent / 'fingerprints' / 'virtual_runs.json'

_PIPELINE_COSTS = {
  'cost.calibrate': False,
  'cost.compute.forward': 0.003,
  'cost.compute.backward': 0.005,
  'cost.compute.update': 0.001,
}
_STEP_COSTS = {'cost.calibrate': False, 'cost.compute.step': 0.004}
_LINKS = {'cost.link_latency': 2e-4, 'cost.link_bandwidth': 1e9}
# The process executor's host (`cost.host`, a host profile written for the case): free
# links and take-ins and no host time unless a case gives them; as many cores as no case's lanes fill.
_PROCESSES = {
  'executor': 'processes',
  'cores': 64,
  **dict.fromkeys(host_lib.FIGURES['processes'], 0.0),
  'link_bandwidth': float('inf'),
  'take_in_bandwidth': float('inf'),
  'export_bandwidth': float('inf'),
}
_RUN_AHEAD = {'cost.host': _PROCESSES}
_DRIVER = {'cost.host': {**_PROCESSES, 'driver': 3e-4, 'driver_latency': 5e-4}}

# case -> (config module, overrides).
CASES = {
  'bp': ('ddg', {**_PIPELINE_COSTS, 'algorithm.name': 'bp', 'algorithm.variant': None}),
  'ddg': ('ddg', _PIPELINE_COSTS),
  'ddg preset cpu': ('ddg', {'cost.device': 'cpu'}),
  'ddg links': ('ddg', {**_PIPELINE_COSTS, **_LINKS}),
  'local': ('local', _PIPELINE_COSTS),
  'asgd': ('asgd', {**_PIPELINE_COSTS, 'cost.straggler_std': 0.3}),
  'dcasgd': ('dcasgd', _PIPELINE_COSTS),
  'pdasgd': ('pdasgd', _PIPELINE_COSTS),
  'lppsgd': ('lppsgd', _PIPELINE_COSTS),
  'ddg run ahead': ('ddg', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'asgd run ahead': ('asgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'pdasgd run ahead': ('pdasgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'lppsgd run ahead': ('lppsgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'ddg driver': ('ddg', {**_PIPELINE_COSTS, **_DRIVER}),
  'asgd driver': ('asgd', {**_PIPELINE_COSTS, **_DRIVER}),
  'ddg copies on sender': (
    'ddg',
    {**_PIPELINE_COSTS, 'cost.host': {**_PROCESSES, 'link_latency': 2e-4, 'link_bandwidth': 1e9}},
  ),
  'ddg one core time-sliced': (
    'ddg',
    {**_PIPELINE_COSTS, **_RUN_AHEAD, 'placement.lanes': 'stage0@cores=0; stage1@cores=0'},
  ),
  'ddg one core fifo': (
    'ddg',
    {**_PIPELINE_COSTS, 'placement.lanes': 'stage0@cores=0; stage1@cores=0'},
  ),
  'ssgd': ('ssgd', {**_STEP_COSTS, **_LINKS}),
  'dasgd': ('dasgd', {**_STEP_COSTS, **_LINKS}),
  'streaming_diloco': ('streaming_diloco', {**_STEP_COSTS, **_LINKS}),
}


def _config(name, data_dir, overrides, directory):
  config = importlib.import_module(f'experiments.configs.{name}').get_config('smoke')
  config.data_dir = data_dir
  config.clock = 'virtual'
  for field, value in overrides.items():
    if field == 'cost.host':  # a host profile's figures: written to a file for the run
      value = _host_file(value, directory)
    parent, _, leaf = field.rpartition('.')
    node = config[parent] if parent else config
    if value is None:
      del node[leaf]  # a field the other algorithm does not have
    else:
      node[leaf] = value
  return config


def _host_file(figures, directory) -> str:
  figures = dict(figures)
  executor, cores = figures.pop('executor'), figures.pop('cores')
  path = os.path.join(directory, 'host.json')
  host_lib.save(host_lib.make(executor, figures, cores=cores), path)
  return path


def fingerprint(workdir) -> dict:
  """What a run must keep: its records' simulated times and metrics, and its trace."""
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  path = os.path.join(workdir, 'trace.json')  # none for the data-parallel step
  events = json.load(open(path))['traceEvents'] if os.path.exists(path) else []
  tasks = [[e.get('tid'), e['name'], e['ts'], e.get('dur')] for e in events if e.get('ph') == 'X']
  return {
    'sim_time': [r.get('sim_time') for r in records],
    'loss': [r.get('loss') for r in records],
    'accuracy': [r.get('test_accuracy', r.get('accuracy')) for r in records],
    'tasks': len(tasks),
    'trace_sha1': hashlib.sha1(json.dumps(tasks).encode()).hexdigest(),
  }


def run_case(case, data_dir, workdir) -> dict:
  from jaxsgd.training import train_and_evaluate

  name, overrides = CASES[case]
  os.makedirs(f'{workdir}-host', exist_ok=True)
  config = _config(name, data_dir, overrides, f'{workdir}-host')
  train_and_evaluate(config, str(workdir), show_progress=False)
  return fingerprint(workdir)


def _close(got, want, *, rel):
  return all(
    (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= rel * abs(b))
    for a, b in zip(got, want, strict=True)
  )


@pytest.mark.parametrize('case', CASES)
def test_a_shipped_config_keeps_its_simulated_times_and_numbers(case, data_dir, tmp_path):
  want = json.loads(FINGERPRINTS.read_text())[case]
  got = run_case(case, data_dir, tmp_path)
  assert got['sim_time'] == want['sim_time']
  assert (got['tasks'], got['trace_sha1']) == (want['tasks'], want['trace_sha1'])
  assert _close(got['loss'], want['loss'], rel=1e-5), (got['loss'], want['loss'])
  assert len(got['accuracy']) == len(want['accuracy'])
  for a, b in zip(got['accuracy'], want['accuracy'], strict=True):
    assert (a is None and b is None) or abs(a - b) <= 1e-3


def main() -> None:
  """Writes the fingerprints of every case (or of the cases named on the command line)."""
  import tempfile

  import conftest  # noqa: F401  (the tests' XLA flags, set before JAX starts)

  wanted = sys.argv[1:] or list(CASES)
  old = json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {}
  with tempfile.TemporaryDirectory() as tmp:
    for i, case in enumerate(wanted):
      old[case] = run_case(case, os.path.join(tmp, 'data'), os.path.join(tmp, f'run{i}'))
      print(case, old[case]['sim_time'][-1], old[case]['tasks'], flush=True)
  FINGERPRINTS.parent.mkdir(exist_ok=True)
  FINGERPRINTS.write_text(json.dumps(old, indent=1, sort_keys=True) + '\n')


if __name__ == '__main__':
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  main()
