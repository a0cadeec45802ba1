"""A driver run as its own process by the signal tests: lanes up, then one long task.

    python tests/lanes/lane_driver.py ADDRESS|local OUT [lost-sigterm]

Writes one JSON object to the file OUT (its pid, its lanes' pids, every process it
started) once the lanes are up (a file, not stdout: Ray's log thread prints the lanes'
output to the driver's stdout and may split a line printed there), then waits on a task
that sleeps for a minute. With `lost-sigterm` it first sends itself SIGTERM from inside a
garbage-collector callback, where the handler's exception is printed and dropped (as
happens under JAX's own callback).
"""

import gc
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lane_tasks
import psutil

from jaxsgd.scheduler.lanes import LanePlacement, LanePool
from jaxsgd.scheduler.tasks import Task, TaskRecipe


def sigterm_lost_in_a_gc_callback() -> None:
  def callback(phase, info):
    del info
    if phase == 'start' and callback in gc.callbacks:
      gc.callbacks.remove(callback)
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(100_000):  # the handler runs here; gc drops its exception
        pass

  gc.callbacks.append(callback)
  gc.collect()


def write_whole(path: str, record: dict) -> None:
  """Writes `record` so that a reader polling `path` sees all of it or nothing."""
  with open(path + '.part', 'w') as f:
    json.dump(record, f)
  os.replace(path + '.part', path)


def main(address: str | None, out: str, lose_sigterm: bool = False):
  with LanePool(LanePlacement.spread(['a', 'b']), address=address, verbose=False) as pool:
    started = [p.pid for p in psutil.Process().children(recursive=True)]
    lanes = list(pool.pids().values())
    write_whole(out, {'driver': os.getpid(), 'lanes': lanes, 'started': started})
    if lose_sigterm:
      sigterm_lost_in_a_gc_callback()
    recipe = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=1.0)
    pool.run('a', Task(recipe, 'hang'), (60.0,))


if __name__ == '__main__':
  main(
    None if sys.argv[1] == 'local' else sys.argv[1], sys.argv[2], sys.argv[3:] == ['lost-sigterm']
  )
