"""Runs that say what they did: simulated time in the last line, the preset that priced a
run and its lanes named by it, a note on settings that make a method degenerate, the step
a resume starts from, and no line a user cannot act on."""

import json
import logging
import os
import subprocess
import sys

import pytest

from experiments import terminal
from experiments.configs import asgd, dasgd, dcasgd, ddg, default
from jaxsgd import algorithms
from jaxsgd import data as data_lib
from jaxsgd import training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(module, data_dir, **overrides):
  config = module.get_config('smoke')
  config.data_dir = data_dir
  config.update_from_flattened_dict(overrides)
  return config


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- the last line ------------------------------------------------------------------------------
def test_the_last_line_gives_simulated_time_beside_wall_time():
  final = {'step': 60, 'test_accuracy': 0.306, 'test_loss': 1.7, 'wall_time': 5.54}
  scheduler = {'final': final, 'sim_time': 0.007583}
  spmd = {'final': {**final, 'sim_time': 12.345}}  # data-parallel: in the records only
  real = {'final': final}
  assert terminal.final_line(scheduler, '/w') == (
    'final test accuracy 0.3060 at step 60 (5.5 s wall, 0.00758 s simulated); results in /w'
  )
  assert '(5.5 s wall, 12.3 s simulated)' in terminal.final_line(spmd, '/w')
  assert '(5.5 s wall);' in terminal.final_line(real, '/w')


def test_a_language_models_last_line_gives_its_perplexity_and_tokens_per_second():
  final = {'step': 30, 'test_accuracy': 0.1573, 'test_loss': 3.86, 'test_perplexity': 47.699}
  virtual = {
    'final': {**final, 'wall_time': 2.9},
    'sim_time': 0.0856,
    'tokens_per_second': {'wall': 5256.6, 'simulated': 179424.1},
  }
  assert terminal.final_line(virtual, '/w') == (
    'final test accuracy 0.1573 (perplexity 47.699) at step 30 (2.9 s wall, 0.0856 s '
    'simulated; 179,424 tokens/s simulated); results in /w'
  )
  real = {'final': {**final, 'wall_time': 2.0}, 'tokens_per_second': {'wall': 7748.4}}
  assert '(2.0 s wall; 7,748 tokens/s wall)' in terminal.final_line(real, '/w')


# --- a run priced by a preset --------------------------------------------------------------------
def test_a_preset_run_names_its_preset_and_labels_lanes_by_it(data_dir, tmp_path, caplog):
  config = _config(ddg, data_dir, **{'cost.device': 'h100', 'train_steps': 8, 'eval_every': 8})
  with caplog.at_level(logging.INFO):
    summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  priced = [r.getMessage() for r in caplog.records if 'priced by' in r.getMessage()]
  assert len(priced) == 1 and priced[0].startswith('cost: tasks priced by the h100 preset')
  assert priced[0].endswith('every lane is a simulated h100.')
  with open(tmp_path / 'trace.json') as f:
    events = json.load(f)['traceEvents']
  lanes = [e['args']['name'] for e in events if e.get('name') == 'thread_name']
  assert lanes[:4] == [f'stage {k} (h100)' for k in range(4)]
  assert 'link stage 0 (h100) → stage 1 (h100)' in lanes
  assert not [name for name in lanes if 'cpu:' in name]
  assert set(summary['utilization']) <= set(lanes)
  assert summary['sim_time'] > 0
  assert 's simulated); results in' in terminal.final_line(summary, str(tmp_path))


def test_lane_names_of_every_form_take_the_presets_device():
  from jaxsgd.training.outputs import priced_lane_name  # pylint: disable=g-import-not-at-top

  assert priced_lane_name('worker 10 (cuda:1)', 'a100') == 'worker 10 (a100)'
  assert priced_lane_name('stage 0 (stage0: cpu:0 on 192.0.2.2)', 'h100') == (
    'stage 0 (stage0: h100 on 192.0.2.2)'  # an emulated lane on lane processes
  )
  assert priced_lane_name('server', 'h100') == 'server'


# --- settings that make a method degenerate ------------------------------------------------------
def _validate(config, data_dir):
  dataset = data_lib.load(config.dataset, data_dir)
  model = training.build_model(config, dataset)
  return algorithms.get(config.algorithm.name).validate(config, model)


@pytest.mark.parametrize(
  'module, overrides, note',
  [
    (ddg, {'stages': 1}, 'stages=1: DDG with one stage has no stages to decouple'),
    (dcasgd, {'algorithm.lambda0': 0.0}, 'algorithm.lambda0=0: DC-ASGD without delay'),
    (dasgd, {'algorithm.period': 1, 'algorithm.delay': 0}, 'algorithm.period=1: DaSGD'),
    (dasgd, {'algorithm.delay': 0}, 'algorithm.delay=0: DaSGD without delay'),
  ],
)
def test_a_degenerate_setting_is_allowed_with_one_note(data_dir, caplog, module, overrides, note):
  with caplog.at_level(logging.WARNING):
    _validate(_config(module, data_dir, **overrides), data_dir)
  assert [w for w in _warnings(caplog) if w.startswith(note)] == _warnings(caplog)
  assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize('module', [ddg, dcasgd, dasgd, asgd])
def test_the_methods_own_settings_get_no_note(data_dir, caplog, module):
  with caplog.at_level(logging.WARNING):
    _validate(_config(module, data_dir), data_dir)
  assert _warnings(caplog) == []


# --- a resume -------------------------------------------------------------------------------------
def test_a_resume_says_from_which_step(data_dir, tmp_path, caplog):
  config = _config(default, data_dir, train_steps=10, eval_every=10, checkpoint_every=5)
  training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  with caplog.at_level(logging.INFO):
    training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  resuming = [r.getMessage() for r in caplog.records if r.getMessage().startswith('resuming')]
  assert resuming == [f'resuming from step 10 (the checkpoint in {tmp_path}/checkpoints).']


# --- what reaches the terminal --------------------------------------------------------------------
def _record(path: str, level: int) -> logging.LogRecord:
  return logging.LogRecord('absl', level, path, 1, 'message', (), None)


def test_libraries_info_lines_are_left_out_their_warnings_kept():
  tfds = '/site-packages/tensorflow_datasets/core/dataset_info.py'
  ours = os.path.join(REPO, 'jaxsgd', 'training', 'loop.py')
  keep = terminal._is_ours_or_a_warning  # pylint: disable=protected-access
  assert not keep(_record(tfds, logging.INFO))
  assert keep(_record(tfds, logging.WARNING))
  assert keep(_record(ours, logging.INFO))
  assert keep(_record(os.path.join(REPO, 'experiments', 'train.py'), logging.INFO))


FORKS = """
import os, sys, threading
import jax
jax.devices()  # JAX's fork warning is registered with its backend
threading.Thread(target=lambda: None).start()

def fork():
  pid = os.fork()
  if pid == 0:
    os._exit(0)
  os.waitpid(pid, 0)

fork()
print('--- lanes imported', file=sys.stderr, flush=True)
import jaxsgd.scheduler.lanes.cluster
fork()
"""


def test_no_fork_warning_once_the_lanes_cluster_is_imported():
  """The fork Ray's helpers make from the threaded driver (then exec at once) warns in
  JAX; the lanes' cluster module, imported before any, silences exactly that warning."""
  result = subprocess.run(
    [sys.executable, '-c', FORKS],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
    env={**os.environ, 'PYTHONWARNINGS': 'default'},
  )
  before, _, after = result.stderr.partition('--- lanes imported')
  assert 'os.fork() was called' in before  # the warning the filter is for
  assert 'os.fork() was called' not in after
