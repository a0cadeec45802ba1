"""A driver that starts its cluster in the background (`cluster.connect_soon`), run as
its own process by `test_lanes.py`:

    python tests/lanes/background_start.py use|abandon|crash OUT

`use`: opens a pool on it a second after the start (the thread that started the cluster
has long returned from it), takes the lane the start began, runs a task, closes the pool. `abandon`: no pool ever takes
it (`cluster.abandon`). `crash`: as `use`, but the lane's process kills itself in the
task (the fault hook, set by the test), having said so on its standard error. Writes one
JSON object to the file OUT: the processes it started (Ray's and the lanes', and any
left after) and their command lines, the task's result or error, the lanes the pool
took from the start, and (`use`) the idle Ray workers left 6 s after the task ran. A
file, not stdout: Ray's log thread, where a cluster has one, prints the lanes' output
to the driver's stdout and may split a line printed there.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lane_tasks
import psutil

from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool, cluster
from jaxsgd.scheduler.tasks import Task, TaskRecipe


def main(mode: str, out: str):
  cluster.connect_soon(None, LanePlacement.spread(['a']).lanes)  # lane a starts once up
  started, result, error, taken, idle = {}, None, None, [], []
  if mode in ('use', 'crash'):
    time.sleep(1.0)
    with LanePool(LanePlacement.spread(['a']), verbose=False) as pool:
      started = _running()
      taken = list(pool.started_early)
      recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=1.0)
      try:
        result = float(pool.fetch(pool.run('a', Task(recipe, 'add'), (1.0, 2.0))))
      except LaneError as failed:
        error = str(failed)
      idle = _idle_workers(within=6.0) if mode == 'use' else []
  else:
    while len(psutil.Process().children()) < 2:  # Ray's GCS and raylet are starting
      time.sleep(0.05)
    started = _running()
    cluster.abandon()
  left = [p.pid for p in psutil.Process().children(recursive=True)]  # (lane a, say)
  outcome = {'started': [int(pid) for pid in started] + left, 'commands': started}
  with open(out, 'w') as f:
    json.dump({**outcome, 'result': result, 'error': error, 'taken': taken, 'idle': idle}, f)


def _idle_workers(within: float) -> list[int]:
  """The pids of Ray's idle worker processes (`ray::IDLE`) left after at most `within`
  s (none: as soon as none is left)."""
  deadline = time.monotonic() + within
  while True:
    idle = []
    for process in psutil.Process().children(recursive=True):
      try:
        if process.name() == 'ray::IDLE':
          idle.append(process.pid)
      except psutil.Error:  # ended meanwhile
        pass
    if not idle or time.monotonic() > deadline:
      return idle
    time.sleep(0.1)


def _running() -> dict[int, str]:
  """The command line of each process this one started, by pid."""
  commands = {}
  for process in psutil.Process().children(recursive=True):
    try:
      commands[process.pid] = ' '.join(process.cmdline())
    except psutil.Error:  # ended meanwhile
      pass
  return commands


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2])
