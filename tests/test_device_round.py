"""`benchmarks.device_round`: its steps are commands their benchmarks take, and a round
keeps to its budget, goes on past a failed or stopped step and leaves no process."""

import argparse
import importlib
import os
import subprocess
import sys
import time
import zipfile

import pytest

from benchmarks import device_round


class _Parsed(Exception):
  pass


@pytest.mark.parametrize('step', device_round.STEPS, ids=lambda step: step.name)
def test_every_step_is_a_command_its_benchmark_takes(step, monkeypatch):
  """Each step's flags parse with its benchmark's own parser (stopped right after it), so
  that a renamed flag fails here, not on a lent machine's minutes."""
  assert step.argv[0] == '-m'
  module = importlib.import_module(step.argv[1])
  parse = argparse.ArgumentParser.parse_args

  def parse_then_stop(parser, args=None, namespace=None):
    raise _Parsed(parse(parser, args, namespace))

  monkeypatch.setattr(argparse.ArgumentParser, 'parse_args', parse_then_stop)
  monkeypatch.setattr(sys, 'argv', [step.argv[1], *step.argv[2:]])
  with pytest.raises(_Parsed) as parsed:
    module.main()
  assert vars(parsed.value.args[0])  # (a bad flag would have exited 2 instead)


def _python(code: str, budget: float, name: str) -> device_round.Step:
  return device_round.Step(name, ('-c', code), budget)


def test_a_round_skips_what_does_not_fit_and_goes_on_past_failures(tmp_path):
  steps = [
    _python('print("one"); print("figure 1.5")', 30, 'first'),
    _python('import sys; print("broke"); sys.exit(3)', 30, 'failing'),
    _python('print("never")', 500, 'too_long'),  # more than the round has left
    _python('print("last 2.0")', 30, 'last'),
  ]
  outcomes = device_round.run_round(steps, tmp_path, budget=120)
  assert {name: o.status for name, o in outcomes.items()} == {
    'first': 'ran',
    'failing': 'failed (exit 3)',
    'too_long': 'skipped (budget)',
    'last': 'ran',
  }
  assert outcomes['first'].last_line == 'figure 1.5'
  assert outcomes['failing'].last_line == 'broke'
  assert (tmp_path / 'first.txt').read_text().splitlines()[1:] == ['one', 'figure 1.5']
  assert not (tmp_path / 'too_long.txt').exists()


_CHILD_IGNORING_CTRL_C = (
  'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'
)


def _leaving_a_child(pid_file, then: str) -> str:
  """A step that starts a child ignoring Ctrl-C, writes its pid, then runs `then`."""
  return (
    'import signal, subprocess, sys, time\n'
    f'child = subprocess.Popen([sys.executable, "-c", {_CHILD_IGNORING_CTRL_C!r}])\n'
    f'open({str(pid_file)!r}, "w").write(str(child.pid))\n'
    'print("started", flush=True)\n'
    f'{then}\n'
  )


def test_a_step_past_its_budget_is_stopped_with_its_children(tmp_path, monkeypatch):
  """Stopped by its group, a step's child goes too (a benchmark's lanes and Ray), after
  the grace if it ignores Ctrl-C, as does a step that ignores it."""
  child_pid = tmp_path / 'child'
  then = 'signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)'
  monkeypatch.setattr(device_round, 'STOP_GRACE', 1.0)
  began = time.monotonic()
  stuck = _python(_leaving_a_child(child_pid, then), 3, 'stuck')
  outcomes = device_round.run_round([stuck], tmp_path, budget=60)
  assert outcomes['stuck'].status == 'stopped after 3 s'
  assert outcomes['stuck'].last_line == 'started'
  assert time.monotonic() - began < 15
  assert _gone(int(child_pid.read_text()))


def test_a_step_that_ends_leaves_no_child_behind(tmp_path):
  child_pid = tmp_path / 'child'
  done = _python(_leaving_a_child(child_pid, 'print("done")'), 30, 'done')
  assert device_round.run_round([done], tmp_path, budget=60)['done'].status == 'ran'
  assert _gone(int(child_pid.read_text()))


def _gone(pid: int, within: float = 5.0) -> bool:
  deadline = time.monotonic() + within
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.1)
  return not _alive(pid)


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as stat:
      return stat.read().split(') ')[1][0] != 'Z'
  except FileNotFoundError:
    return False


def test_the_driver_of_a_step_runs_jax_on_the_cpu_unless_told(tmp_path):
  show = _python('import os; print(os.environ["JAX_PLATFORMS"])', 30, 'env')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  assert device_round.run_round([show], tmp_path, 60, env)['env'].last_line == 'cpu'
  env['JAX_PLATFORMS'] = 'cuda'
  assert device_round.run_round([show], tmp_path, 60, env)['env'].last_line == 'cuda'


def test_rays_wheel_loses_its_jars_and_their_record_lines(tmp_path):
  wheel = tmp_path / 'ray-9.9.9-cp312-cp312-manylinux2014_x86_64.whl'
  record = 'ray/jars/ray_dist.jar,sha256=x,9\nray/_raylet.so,sha256=y,3\nray/__init__.py,,\n'
  with zipfile.ZipFile(wheel, 'w') as out:
    out.writestr('ray/jars/ray_dist.jar', b'j' * 9)
    out.writestr('ray/_raylet.so', b'abc')
    out.writestr('ray/_private/runtime_env/java_jars.py', b'# kept: not under ray/jars/')
    out.writestr('ray-9.9.9.dist-info/RECORD', record)
  device_round.without_jars(wheel)
  with zipfile.ZipFile(wheel) as kept:
    assert kept.namelist() == [
      'ray/_raylet.so',
      'ray/_private/runtime_env/java_jars.py',
      'ray-9.9.9.dist-info/RECORD',
    ]
    assert kept.read('ray/_raylet.so') == b'abc'
    assert kept.read('ray-9.9.9.dist-info/RECORD').decode() == (
      'ray/_raylet.so,sha256=y,3\nray/__init__.py,,\n'
    )


@pytest.mark.parametrize(
  'argv, line',
  [
    (
      ['--only', 'ddg_k8,k16'],
      '--only: steps of ddg_k8, ddg_k4, k2_gpu, device_path, ceilings; got k16',
    ),
    (['--budget', '0'], '--budget: seconds, a number more than 0; got 0.0'),
    (['--budget', 'nan'], '--budget: seconds, a number more than 0; got nan'),
    (['--out', __file__], f"--out: a folder for the steps' outputs; {__file__!r} is a file"),
  ],
)
def test_bad_input_is_refused_in_one_line(argv, line, capsys):
  with pytest.raises(SystemExit) as exit_:
    device_round.main(argv)
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith(line)


def test_the_plan_lists_the_chosen_steps_and_runs_nothing(capsys):
  device_round.main(['--plan', '--only', 'ceilings,ddg_k4'])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines[:-1]] == ['ddg_k4', 'ceilings']
  assert lines[-1] == '160 s of budgets; --budget 540 s'
  assert sum(step.budget for step in device_round.STEPS) < device_round.BUDGET  # (all fit)


def test_wheels_are_refused_in_one_line_without_ray_or_pip_and_others_are_kept(
  tmp_path, monkeypatch, capsys
):
  kept, old_ray = tmp_path / 'other-1.0-py3-none-any.whl', tmp_path / 'ray-1.0-cp312.whl'
  kept.write_bytes(b'')
  old_ray.write_bytes(b'')
  monkeypatch.setattr(device_round, '_version', lambda name: 'missing')
  with pytest.raises(SystemExit):
    device_round.main(['--wheels', str(tmp_path)])
  assert (
    capsys.readouterr()
    .err.splitlines()[-1]
    .endswith('--wheels: Ray is not installed here: its version is the one to download')
  )
  monkeypatch.setattr(device_round, '_version', lambda name: '9.9.9')
  monkeypatch.setattr(subprocess, 'run', lambda *a, **k: subprocess.CompletedProcess(a, 1))
  with pytest.raises(SystemExit):
    device_round.main(['--wheels', str(tmp_path)])
  assert (
    capsys.readouterr()
    .err.splitlines()[-1]
    .endswith(
      '--wheels: pip could not download ray==9.9.9 and jsonschema, jsonschema-specifications, '
      'referencing, rpds-py (above)'
    )
  )
  assert kept.exists() and not old_ray.exists()  # (only these packages' older wheels go)


def test_device_path_on_a_machine_without_a_gpu_is_refused_in_one_line():
  """Its GPU lanes are checked before anything is measured (a lent machine's step must
  fail fast where no GPU is seen, not in a traceback from inside a measurement)."""
  done = subprocess.run(
    [sys.executable, '-m', 'benchmarks.device_path', '--gpu'],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'CUDA_VISIBLE_DEVICES': ''},
  )
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.splitlines()[-1].endswith(
    "error: --gpu: placement: lane(s) 'source', 'target' ask for 0.5 GPU(s) (gpu=1 each, or "
    "its share), but the driver's host has 0 in the Ray cluster; give fewer lanes a GPU."
  )
  assert 'Traceback' not in done.stderr
