"""A driver run as its own process by the tests of forked lanes' hosts (its connection's
`LaneHost` is its own, which a test may kill without touching other tests' lanes).

    python tests/lanes/lane_host_driver.py ADDRESS OUT host-dies|unwatched-kill

host-dies       on a connection the driver holds, a pool's lane host is killed (SIGKILL):
                the pool's next task fails with the lane's death, and a later pool's
                lanes start on a new host and run;
unwatched-kill  two lanes started with the connection (`connect_soon`) are killed
                without any watch, as a run that stops before its pool takes them.
Writes one JSON object to OUT: what the test checks.
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lane_tasks
import psutil
import ray

from jaxsgd.scheduler.lanes import LaneError, LanePlacement, LanePool, cluster
from jaxsgd.scheduler.tasks import Task, TaskRecipe

RECIPE = TaskRecipe.of(lane_tasks.build_layer_tasks, scale=0.5)


def host_dies(address: str) -> dict:
  cluster.connect(address)  # the driver's: both pools share it (and its lane host)
  with LanePool(LanePlacement.spread(['a']), address=address, verbose=False) as pool:
    host = psutil.Process(pool.pids()['a']).ppid()
    os.kill(host, signal.SIGKILL)
    try:
      pool.run('a', Task(RECIPE, 'init'), (3,))
      said = None
    except LaneError as error:
      said = str(error)
  # Ray hears of the host's death a few ms after the pool does (the lane's socket
  # ended); a pool started in between still asks the dead host, and fails at start.
  deadline, failed_starts = time.monotonic() + 10, 0
  while True:
    try:
      pool = LanePool(LanePlacement.spread(['b']), address=address, verbose=False)
      break
    except LaneError:
      failed_starts += 1
      assert time.monotonic() < deadline, f'{failed_starts} pools failed to start'
      time.sleep(0.05)
  with pool:
    w = pool.fetch(pool.run('b', Task(RECIPE, 'init'), (3,)))
    new_host = psutil.Process(pool.pids()['b']).ppid()
  return {
    'host': host,
    'said': said,
    'new_host': new_host,
    'shape': list(w.shape),
    'failed_starts': failed_starts,
  }


def unwatched_kill(address: str) -> dict:
  cluster.connect_soon(address, LanePlacement.spread(['a', 'b']).lanes)
  cluster.connect(address)
  _, lanes = cluster.take_early_lanes()
  pids = [ray.get(lane.info.remote())['pid'] for lane in lanes.values()]
  for lane in lanes.values():
    cluster.kill(lane)
  deadline = time.monotonic() + 10
  while (left := [pid for pid in pids if psutil.pid_exists(pid)]) and time.monotonic() < deadline:
    time.sleep(0.05)
  return {'pids': pids, 'left': {pid: psutil.Process(pid).status() for pid in left}}


if __name__ == '__main__':
  address, out, scenario = sys.argv[1:4]
  record = {'host-dies': host_dies, 'unwatched-kill': unwatched_kill}[scenario](address)
  cluster.shutdown()
  with open(out, 'w') as f:
    json.dump(record, f)
