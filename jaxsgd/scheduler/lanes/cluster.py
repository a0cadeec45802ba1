"""The engine under the lanes: Ray (see docs/engine.md for why, with measured figures).

Everything that touches Ray's API is here, so that the pool reads as lanes and handles.
A cluster is either started for the run on this machine (`connect(None)`, offline:
no dashboard, no usage statistics, a temporary directory of its own) or joined at an
address (`connect('10.0.0.1:6379')`, the several-host case; see docs/engine.md for the
`ray start` commands).
"""

import os
import shutil
import sys
import tempfile

os.environ.setdefault('RAY_USAGE_STATS_ENABLED', '0')

import ray
from ray.util import scheduling_strategies

from jaxsgd.scheduler.lanes.placement import LaneSpec
from jaxsgd.scheduler.lanes.runtime import LaneRuntime

WATCH_GROUP = 'watch'
_STARTED_HERE = {}  # 'temp_dir': the directory of a cluster that `connect` started
# Calls run one at a time, in the order sent; `watch` waits in a thread of its own.
_LANE_ACTOR = ray.remote(concurrency_groups={WATCH_GROUP: 1})(LaneRuntime)


def connect(address: str | None) -> bool:
  """Joins the cluster at `address`, or starts one here; True if this call started it."""
  if ray.is_initialized():
    return False
  if address is None:
    _STARTED_HERE['temp_dir'] = tempfile.mkdtemp(prefix='jaxsgd-ray-')
    ray.init(
      num_cpus=os.cpu_count(),
      include_dashboard=False,
      configure_logging=False,
      _temp_dir=_STARTED_HERE['temp_dir'],
    )
    return True
  ray.init(address=address, configure_logging=False)
  return True  # connected here: disconnect (the cluster itself stays up) at close


def shutdown() -> None:
  """Disconnects; stops the cluster (and removes its logs) if `connect` started it."""
  ray.shutdown()
  temp_dir = _STARTED_HERE.pop('temp_dir', None)
  if temp_dir is not None:
    shutil.rmtree(temp_dir, ignore_errors=True)


def lane_actor(spec: LaneSpec, env: dict[str, str]):
  """A Ray actor running `LaneRuntime` in a process of its own, on `spec.host`."""
  variables = {**_code_path(), **spec.environment(), **env}
  options = dict(
    num_cpus=0,
    num_gpus=1 if spec.gpu else 0,
    max_restarts=0,
    max_task_retries=0,
    runtime_env={'env_vars': variables},
  )
  if spec.host is not None:
    options['scheduling_strategy'] = scheduling_strategies.NodeAffinitySchedulingStrategy(
      _node_id(spec), soft=False
    )
  return _LANE_ACTOR.options(**options).remote(spec.name, spec.cores)


def watch(actor):
  """A reference that fails as soon as the actor's process dies (it never succeeds)."""
  return actor.watch.options(concurrency_group=WATCH_GROUP).remote()


def wait(refs: list, timeout: float | None):
  return ray.wait(refs, num_returns=1, timeout=timeout)


def get(ref):
  return ray.get(ref)


def kill(actor) -> None:
  try:
    ray.kill(actor, no_restart=True)
  except Exception:  # already gone, or Ray is stopping
    pass


def describe(error: BaseException) -> str:
  """A short account of a lane's failure: the lane's own exception, or how it died."""
  if isinstance(error, ray.exceptions.RayTaskError):
    cause = error.cause if error.cause is not None else error
    text = f'{type(cause).__name__}: {cause}'
  elif isinstance(error, ray.exceptions.ActorDiedError):
    text = 'the process died (killed, or crashed)'
  else:
    text = f'{type(error).__name__}: {error}'
  lines = text.strip().splitlines()
  return lines[0] if len(lines) == 1 else lines[0] + ' ...'


def _node_id(spec: LaneSpec) -> str:
  nodes = [n for n in ray.nodes() if n.get('Alive')]
  for node in nodes:
    if spec.host in (node.get('NodeManagerAddress'), node.get('NodeManagerHostname')):
      return node['NodeID']
  hosts = sorted(n.get('NodeManagerAddress') for n in nodes)
  raise ValueError(
    f'placement: lane {spec.name!r}: host {spec.host!r} is not a node of '
    f'the Ray cluster; its nodes: {hosts}.'
  )


def _code_path() -> dict[str, str]:
  """PYTHONPATH for lane processes: the driver's import path, so they import the same code.

  (On other hosts, the same directories where they exist; install jaxsgd there.)
  """
  parts = [os.path.abspath(p or '.') for p in sys.path]
  return {'PYTHONPATH': os.pathsep.join(dict.fromkeys(p for p in parts if os.path.isdir(p)))}
