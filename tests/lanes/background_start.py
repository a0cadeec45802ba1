"""A driver that starts its cluster in the background (`cluster.connect_soon`), run as
its own process by `test_lanes.py`:

    python tests/lanes/background_start.py use|abandon OUT

`use`: opens a pool on it a second after the start (the thread that started the cluster
has long returned from it), takes the lane the start began, runs a task, closes the pool. `abandon`: no pool ever takes
it (`cluster.abandon`). Writes one JSON object to the file OUT: the processes it started
(Ray's and the lanes', and any left after), the task's result and the lanes the pool
took from the start. A file, not stdout: Ray's log thread prints
the lanes' output to the driver's stdout and may split a line printed there.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lane_tasks
import psutil

from jaxsgd.scheduler.lanes import LanePlacement, LanePool, cluster
from jaxsgd.scheduler.tasks import Task, TaskRecipe


def main(use: bool, out: str):
  cluster.connect_soon(None, LanePlacement.spread(['a']).lanes)  # lane a starts once up
  started, result, taken = [], None, []
  if use:
    time.sleep(1.0)
    with LanePool(LanePlacement.spread(['a']), verbose=False) as pool:
      started = [p.pid for p in psutil.Process().children(recursive=True)]
      taken = list(pool.started_early)
      recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=1.0)
      result = float(pool.fetch(pool.run('a', Task(recipe, 'add'), (1.0, 2.0))))
  else:
    while len(psutil.Process().children()) < 2:  # Ray's GCS and raylet are starting
      time.sleep(0.05)
    started = [p.pid for p in psutil.Process().children(recursive=True)]
    cluster.abandon()
  left = [p.pid for p in psutil.Process().children(recursive=True)]  # (lane a, say)
  with open(out, 'w') as f:
    json.dump({'started': started + left, 'result': result, 'taken': taken}, f)


if __name__ == '__main__':
  main(sys.argv[1] == 'use', sys.argv[2])
