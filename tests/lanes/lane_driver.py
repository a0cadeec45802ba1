"""A driver run as its own process by the signal tests: lanes up, then one long task.

    python tests/lanes/lane_driver.py ADDRESS|local

Prints one JSON line (its pid, its lanes' pids, every process it started) once the
lanes are up, then waits on a task that sleeps for a minute.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lane_tasks
import psutil

from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe


def main(address: str | None):
  with LanePool(LanePlacement.spread(['a', 'b']), address=address, verbose=False) as pool:
    started = [p.pid for p in psutil.Process().children(recursive=True)]
    print(
      json.dumps({'driver': os.getpid(), 'lanes': list(pool.pids().values()), 'started': started}),
      flush=True,
    )
    recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=1.0)
    pool.run('a', Task(recipe, 'hang'), (60.0,))


if __name__ == '__main__':
  main(None if sys.argv[1] == 'local' else sys.argv[1])
