"""A training run's driver, `python -m experiments.train`, as a process of its own in the
background, for the tests that do something to it while it trains."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_driver_left():
  """Kills what a failed test left running (its driver and all it started), so that a
  failure here does not load the machine for the tests after it."""
  yield
  for driver in Driver.started:
    if driver.process.poll() is None:
      _kill([psutil.Process(driver.process.pid), *_family(driver.process.pid)])
  Driver.started.clear()


class Driver:
  """`python -m experiments.train` (`config`: ASGD smoke; lane processes) running in the
  background, in this process's environment with `env`'s variables set (None: unset)."""

  started: list['Driver'] = []

  def __init__(self, workdir, data_dir, *flags, env=None, config='asgd.py:smoke'):
    self.workdir = str(workdir)
    self.log_path = os.path.join(os.path.dirname(self.workdir), 'driver.log')
    self.log = open(self.log_path, 'w')
    command = [
      sys.executable,
      '-m',
      'experiments.train',
      f'--config=experiments/configs/{config}',
      f'--workdir={self.workdir}',
      f'--config.data_dir={data_dir}',
      '--config.clock=real',
      '--config.executor=processes',
      '--config.eval_every=20',
      *flags,
    ]
    self.process = subprocess.Popen(
      command,
      cwd=REPO,
      stdout=self.log,
      stderr=subprocess.STDOUT,
      # faulthandler: a run that does not end is made to print its threads' stacks.
      env=_environment({**os.environ, 'PYTHONFAULTHANDLER': '1', **(env or {})}),
    )
    Driver.started.append(self)

  def output(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def wait_for_step(self, step: int, timeout: float = 240) -> None:
    """Until `metrics.jsonl` holds step `step` (the run is training)."""
    deadline = time.monotonic() + timeout
    path = os.path.join(self.workdir, 'metrics.jsonl')
    while time.monotonic() < deadline:
      assert self.process.poll() is None, self.output()[-3000:]
      if os.path.exists(path):
        with open(path) as f:
          if any(json.loads(line)['step'] >= step for line in f if line.strip()):
            return
      time.sleep(0.2)
    raise TimeoutError(f'step {step} not reached:\n{self.output()[-3000:]}')

  def lane_pid(self, lane: str) -> int:
    """The pid of `lane` from the placement printed at start (`  worker1: host=... pid=N`)."""
    for line in self.output().splitlines():
      if line.startswith(f'  {lane}: host='):
        return int(line.split(' pid=')[1].split()[0])
    raise AssertionError(f'no lane {lane} in the placement:\n{self.output()[-3000:]}')

  def finish(self, timeout: float = 300) -> tuple[int, str]:
    """The exit status and the last line of the output (after the progress bar). A run
    that has not ended within `timeout` s fails the test with its output and its threads'
    stacks (SIGABRT, which faulthandler answers), and is killed."""
    try:
      status = self.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      family = _family(self.process.pid)  # (once it is gone, its children cannot be found)
      self.process.send_signal(signal.SIGABRT)
      try:
        self.process.wait(timeout=20)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
      _kill(family)
      raise AssertionError(
        f'the run had not ended within {timeout} s:\n{self.output()[-12000:]}'
      ) from None
    self.log.close()
    lines = [line for line in self.output().replace('\r', '\n').splitlines() if line.strip()]
    return status, lines[-1]


def _environment(variables: dict) -> dict:
  """`variables` without those set to None (`Driver(env=...)`: left unset)."""
  return {name: value for name, value in variables.items() if value is not None}


def _kill(processes: list[psutil.Process]) -> None:
  for process in processes:
    try:
      process.kill()
    except psutil.NoSuchProcess:
      pass
  psutil.wait_procs(processes, timeout=10)


def _family(pid: int) -> list[psutil.Process]:
  try:
    return psutil.Process(pid).children(recursive=True)
  except psutil.NoSuchProcess:
    return []


def _descendants(pid: int) -> list[int]:
  return [p.pid for p in _family(pid)]
