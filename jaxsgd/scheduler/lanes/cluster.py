"""The engine under the lanes: Ray (see docs/engine.md for why, with measured figures).

Everything that touches Ray's API is here, so that the pool reads as lanes and handles.
A cluster is either started for the run on this machine (`connect(None)`, offline:
no dashboard, no usage statistics, none of Ray's daemons it has no use for
(`_IDLE_DAEMONS`, the API server), a temporary directory of its own) or joined at an
address (`connect('10.0.0.1:6379')`, the several-host case; see docs/engine.md for the
`ray start` commands).

Stopping a cluster started here is fast and complete: Ray's own `shutdown` stops its
processes one at a time, giving each up to a second, so `shutdown` first kills the lane
and worker processes and Ray's other helpers all at once, lets Ray stop its GCS and raylet
(and the raylet its agents, whose death it shares), and kills whatever of the cluster
is still alive after that (found by its directory). A driver killed with SIGKILL stops
nothing: a watcher started with the cluster ends it then (`reaper.py`).
"""

import contextlib
import functools
import gc
import glob
import inspect
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from typing import NoReturn

os.environ.setdefault('RAY_USAGE_STATS_ENABLED', '0')

import psutil
import ray
from ray.util import scheduling_strategies

from jaxsgd import compilation_cache
from jaxsgd.scheduler.lanes import reaper
from jaxsgd.scheduler.lanes.placement import LaneSpec
from jaxsgd.scheduler.lanes.runtime import FAULT_VAR, LaneRuntime, MakerFailed
from jaxsgd.scheduler.lanes.wire import LaneFailure, SourceLost

# JAX warns at every fork of a threaded process; Ray's helpers fork and exec at once, and
# the warning, printed at every start of a cluster, is one a user cannot act on.
warnings.filterwarnings('ignore', message=r'os\.fork\(\) was called', category=RuntimeWarning)
# Ray warns when a thread other than the main one connects (`connect_soon`) that it set
# no SIGTERM handler of its own: the pool's handlers are the run's (`pool._StopSignals`).
logging.getLogger('ray._private.worker').addFilter(
  lambda record: 'SIGTERM handler is not set' not in record.getMessage()
)

_STARTED_HERE = {}  # 'temp_dir': the directory of a cluster that `connect` started
_SOON = {}  # 'thread': a `connect` under way (`connect_soon`); 'start': its event, result
# Lane processes `connect_soon` started before any pool asked for them: 'actors': spec ->
# actor, 'authkey': the key they serve with (`take_early_lanes`); written by the thread
# that connects, taken by the pool's: under `_EARLY_LOCK`
_EARLY = {}
_EARLY_LOCK = threading.Lock()
# Seconds that `connect` waits for a start `connect_soon` began: a cluster starts in
# seconds, but Ray's own start has hung (its GCS up, no raylet ever started).
START_TIMEOUT = 120.0
DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count='  # a driver's, not a lane's
# A run's calls go over the lane's own socket (wire.py); Ray's (`info`, then `watch`) run
# in turn on the lane process's main thread, an actor with no concurrency groups. There
# Ray's task loop checks for signals every 10 ms, taking the process's Python lock each
# time: 100 wake-ups a second in every lane, idle or not, beside the threads that run and
# copy its tasks. `watch`, which never returns while the lane lives, keeps that loop from
# running; every call of Ray's to a lane must therefore come before its `watch`.
_LANE_ACTOR = ray.remote(LaneRuntime)


def connect(address: str | None) -> bool:
  """Joins the cluster at `address`, or starts one here; True if this call started it
  or joined it (then `shutdown` ends the connection). A connection to `address` begun
  by `connect_soon` is waited for, `START_TIMEOUT` at most (then it raises)."""
  soon = _SOON.pop('thread', None)
  if soon is not None:
    begun, start = _SOON.pop('address'), _SOON.pop('start')
    if not start['begun'].wait(START_TIMEOUT):
      start['given_up'] = True  # a start that ends later starts no lanes
      _give_up_start(begun)
    outcome = start['outcome']
    if isinstance(outcome, BaseException):
      raise outcome
    if begun == address:
      return outcome
    if outcome:  # begun for another address: not this run's cluster
      shutdown()
  return _connect_now(address)


def _give_up_start(address: str | None) -> NoReturn:
  """Raises, saying so, for a start `connect_soon` began that did not end in
  `START_TIMEOUT`; a cluster it was starting here is killed first, every process of it
  (its logs stay, for the cause). The start's thread is left to end as Ray lets it."""
  temp_dir = _STARTED_HERE.pop('temp_dir', None)
  if temp_dir is not None:
    _kill(cluster_processes(temp_dir))
    _release_reaper()
  ended = _STARTED_HERE.pop('ended', None)
  if ended is not None:
    ended.set()
  if address:
    where = f'joining {address}'
  else:
    where = (
      f'its logs: {temp_dir}; every process of it killed' if temp_dir else 'no process started'
    )
  raise RuntimeError(f'lanes: the Ray cluster did not start within {START_TIMEOUT:g} s ({where}).')


def _connect_now(address: str | None) -> bool:
  if ray.is_initialized():
    return False
  _HOSTS.clear()  # a connection's lane hosts are its own (its job's actors)
  # Actor lanes and lane hosts are Ray's ready worker processes (no runtime environment
  # of their own, which would make Ray start a new process for each): they find the
  # driver's code by the job's search path (a forked lane is sent it too) and a lane
  # takes its variables in `LaneRuntime.__init__`.
  code = ray.job_config.JobConfig(code_search_path=_code_path())
  if address is None:
    _STARTED_HERE['temp_dir'] = tempfile.mkdtemp(prefix='jaxsgd-ray-')
    # Before the cluster's first process: if this process is killed, even during the
    # start, the watcher ends every process of the cluster (reaper.py).
    _STARTED_HERE['reaper'] = reaper.watch(_STARTED_HERE['temp_dir'])
    with _without_idle_daemons(), _without_api_server(), _without_idle_workers():
      ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        configure_logging=False,
        job_config=code,
        _temp_dir=_STARTED_HERE['temp_dir'],
      )
    return True
  check_joinable(address)
  ray.init(address=address, configure_logging=False, job_config=code)
  return True  # connected here: disconnect (the cluster itself stays up) at close


# Daemons of a Ray head that a cluster started for one run has no use for: the autoscaler's
# monitor (a cluster of this machine alone, never scaled) and the log monitor (it forwards
# the workers' output to the driver's terminal; a lane's is read from its log file where
# its death is said: `lane_output`).
_IDLE_DAEMONS = {'no_monitor': True, 'include_log_monitor': False}


@contextlib.contextmanager
def _without_idle_daemons():
  """`ray.init` starting a head without `_IDLE_DAEMONS`. Each is a Python process whose
  start takes ~0.4 s of CPU from the driver and the lanes starting beside it, on the way
  to the first task (start-up: benchmarks/results/startup.md). Ray's `ray start` has
  these switches (`--no-monitor`, `--include-log-monitor`); `ray.init` passes none, so its
  head's parameters are given them here, as long as Ray's `RayParams` takes them (else
  the head starts as Ray's default)."""
  from ray._private.parameter import RayParams  # (imported by `ray` itself)

  original = RayParams.__init__
  if not set(_IDLE_DAEMONS) <= set(inspect.signature(original).parameters):
    yield
    return

  @functools.wraps(original)  # (its signature is `original`'s: `_without_idle_workers`)
  def without(self, *args, **kwargs):
    original(self, *args, **{**kwargs, **_IDLE_DAEMONS})

  RayParams.__init__ = without
  try:
    yield
  finally:
    RayParams.__init__ = original


# Ray's raylet setting (its environment variable) for how many idle worker processes it
# keeps; those beyond it it ends once idle for a second (Ray's
# `idle_worker_killing_time_threshold_ms`).
IDLE_WORKERS_VAR = 'RAY_num_workers_soft_limit'


@contextlib.contextmanager
def _without_idle_workers():
  """`ray.init` starting a raylet that keeps no idle worker process once a second has
  passed (`IDLE_WORKERS_VAR` 0 in the raylet's environment alone, given as Ray's
  `RayParams.env_vars`: this process's own is left as it is, since it may be read meanwhile
  by another thread), unless this process's environment sets it (the raylet then inherits
  that), or Ray's `RayParams` takes no `env_vars` (its default then). The raylet
  still starts a worker ahead for each CPU when the driver connects, so the lane host
  (and every actor lane started then) takes a ready one: what the start-up gains from
  them stays (benchmarks/results/startup.md). The one a lane host left idle after that
  is ended: every Ray worker process wakes every 10 ms to check its signals (Ray's task
  loop), ~8-9 ms of CPU a second, which on a host whose every core holds a lane comes
  out of a lane's core for the whole run (docs/engine.md, "Start-up"). A lane started
  later as an actor (a GPU lane that replaces a lost one) waits for a worker started
  for it instead."""
  from ray._private.parameter import RayParams  # (imported by `ray` itself)

  original = RayParams.__init__
  if IDLE_WORKERS_VAR in os.environ or 'env_vars' not in inspect.signature(original).parameters:
    yield
    return

  @functools.wraps(original)  # (its signature is `original`'s: `_without_idle_daemons`)
  def keeping_no_idle_worker(self, *args, env_vars=None, **kwargs):
    original(self, *args, env_vars={IDLE_WORKERS_VAR: '0', **(env_vars or {})}, **kwargs)

  RayParams.__init__ = keeping_no_idle_worker
  try:
    yield
  finally:
    RayParams.__init__ = original


@contextlib.contextmanager
def _without_api_server():
  """Ray's head `Node` starting no API server while `ray.init` runs. It is the dashboard's
  head process: with the dashboard off it loads only Ray's usage statistics (off too:
  `RAY_USAGE_STATS_ENABLED`), yet `ray.init` waits for it to write its address (~0.5 s);
  a head without one runs as Ray's other nodes do. Only where `Node.start_api_server`
  takes `include_dashboard` and `raise_on_failure` alone (else the head starts as Ray's
  default)."""
  from ray._private.node import Node  # (imported by `ray` itself)

  original = Node.start_api_server
  if set(inspect.signature(original).parameters) != {
    'self',
    'include_dashboard',
    'raise_on_failure',
  }:
    yield
    return
  Node.start_api_server = lambda self, *, include_dashboard, raise_on_failure: None
  try:
    yield
  finally:
    Node.start_api_server = original


_RAY_MARK = re.compile(r'^:(job_id|actor_name|task_name):')


def lane_output(pid: int, lines: int = 12) -> str | None:
  """The last `lines` lines a lane process (`pid`) of the cluster started here wrote to
  its standard error (Ray's log file of it: a crash's last words, which no log monitor
  forwards, `_IDLE_DAEMONS`); None for another cluster's (its log monitor forwards them)
  or where there are none."""
  temp_dir = _STARTED_HERE.get('temp_dir')
  if temp_dir is None:
    return None
  found = glob.glob(os.path.join(temp_dir, 'session_*', 'logs', f'worker-*-{pid}.err'))
  found += glob.glob(os.path.join(temp_dir, 'jaxsgd-forked-lanes', f'lane-{pid}.err'))
  if not found:
    return None
  with open(found[0], errors='replace') as f:  # (less Ray's lines naming the job, actor)
    said = [line.rstrip() for line in f if line.strip() and not _RAY_MARK.match(line)]
  return '\n'.join(said[-lines:]) or None


def check_joinable(address: str) -> None:
  """Readies this process to join the Ray cluster at `address` (reachable: it answers
  there), or refuses it in one line if the cluster refuses this process.

  Ray (2.59 on) authenticates a cluster's processes by a token: on by default for a
  cluster a local `ray.init()` starts (which writes `~/.ray/auth_token`) and for one
  `ray start --head` starts where that token exists, and turned on in a process that
  joins one only where Ray found the cluster itself (`ray.init()` with no address). A
  process given the address, as a run is (`cluster_address`, 'auto' too, found here),
  kept it off, and Ray refused it after ~20 s, saying only that it could not connect. So
  here, where `RAY_AUTH_MODE` is unset and the cluster refuses this process without a
  token, it joins with its token (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or
  `~/.ray/auth_token`), as Ray joins a cluster it finds; not before (a cluster without
  authentication lost the lanes of a driver that had turned it on), and not kept where
  the cluster refuses that too. A cluster that refuses this process is refused at once;
  where no Ray cluster answers the question, `ray.init` says what it finds.
  """
  try:
    from ray._private.authentication import authentication_token_setup as tokens
    from ray._raylet import InnerGcsClient
  except ImportError:  # a Ray without token authentication
    return
  if address in _JOINABLE:
    return
  given = os.environ.get('RAY_AUTH_MODE')
  try:  # token mode without a token: Ray's client would abort the process
    tokens.ensure_token_if_auth_enabled(None, create_token_if_missing=False)
  except ray.exceptions.AuthenticationError:
    raise ValueError(
      f'cluster_address: RAY_AUTH_MODE={given} here, but this process has no token '
      "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); give it the cluster's "
      '(`ray get-auth-token` on the head prints it).'
    ) from None
  refused = _refuses(InnerGcsClient, address)
  tried_token = False
  if refused and given is None:
    tried_token = tokens.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    if tried_token:
      refused = _refuses(InnerGcsClient, address)
      if refused:  # as it was: its token is not this cluster's
        os.environ.pop('RAY_AUTH_MODE', None)
        ray._raylet.Config.initialize('')  # pylint: disable=protected-access
  if refused:
    how = f'RAY_AUTH_MODE={given}' if given else 'RAY_AUTH_MODE unset'
    how += ', with its token' if tried_token or given == 'token' else ', without a token'
    raise ValueError(
      f"cluster_address: the Ray cluster at {address} refused this process's "
      f"authentication ({how}); give it the cluster's token (RAY_AUTH_TOKEN, "
      'RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; `ray get-auth-token` on the head prints '
      'it), or RAY_AUTH_MODE=disabled where the cluster has none.'
    )
  if refused is False:
    _JOINABLE.add(address)


_JOINABLE = set()  # addresses `check_joinable` let in (asked again when the run connects)
# Milliseconds a cluster's GCS has to answer `check_joinable`'s question (it answers in
# milliseconds; Ray's client waits for it several times over before giving up).
_GCS_ANSWER_MS = 5000


def _refuses(gcs_client, address: str) -> bool | None:
  """Whether the cluster at `address` refuses this process's authentication: a client of
  its GCS asks for the cluster's id at once; None if no answer came (no Ray cluster
  there, or not yet). The line Ray's log writes of a refusal is not shown (a second try
  may be let in; a last refusal is said in one line)."""
  with _stderr_silenced():
    try:
      gcs_client.standalone(address, None, _GCS_ANSWER_MS)
    except ray.exceptions.AuthenticationError:
      return True
    except ray.exceptions.RayError:
      return None
  return False


@contextlib.contextmanager
def _stderr_silenced():
  """Standard error (file descriptor 2, where Ray's C++ log writes) to /dev/null."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, 'w') as null:
      os.dup2(null.fileno(), 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def connect_soon(address: str | None, lanes: Sequence[LaneSpec] = ()) -> None:
  """Begins `connect(address)` in a thread of its own, so that starting a cluster (seconds)
  overlaps the driver's own set-up (building the model); the pool's `connect` waits for
  it. Once connected, it starts a process for each of `lanes` (the run's, known from its
  settings): a lane process spends its first second importing JAX, which then overlaps
  the driver's set-up too; the pool takes them (`take_early_lanes`). `abandon` ends it
  all if no pool took it."""
  if 'thread' in _SOON:
    return
  _kill_early_lanes()  # an earlier run's that no pool took
  if ray.is_initialized():
    _start_early_lanes(lanes)
    return

  begun, ended = threading.Event(), threading.Event()
  start = {'begun': begun}  # this start's own: one given up on writes nowhere else

  def begin():
    try:
      start['outcome'] = outcome = _connect_now(address)
    except BaseException as error:  # raised again by the `connect` that waits for it
      start['outcome'], outcome = error, None
    if outcome is not None and not start.get('given_up'):
      _start_early_lanes(lanes)  # before `begun`: a pool that connects finds them
    begun.set()
    if outcome is True and address is None:
      # Ray's processes die with the thread that started them (it sets their parent-death
      # signal, which Linux ties to that thread): this one lives until `shutdown`.
      ended.wait()

  _SOON['address'], _SOON['start'], _STARTED_HERE['ended'] = address, start, ended
  _SOON['thread'] = threading.Thread(target=begin, name='jaxsgd-cluster-start', daemon=True)
  _SOON['thread'].start()


def _start_early_lanes(lanes: Sequence[LaneSpec]) -> None:
  """Starts a process for each of `lanes` (as `lane_actor`, no extra environment) for a
  pool to take. Any failure here (a host that is no node, GPUs the cluster lacks) starts
  none: the pool then starts its lanes itself and says what is wrong."""
  if not lanes:
    return
  authkey, actors = os.urandom(16), {}
  try:
    check_gpus(lanes)
    for spec in lanes:
      actors[spec] = lane_actor(spec, {}, authkey)
  except BaseException as error:
    for actor in actors.values():
      kill(actor)
    if not isinstance(error, Exception):  # Ctrl-C, say: the run stops
      raise
    logging.getLogger(__name__).info('lanes: none started early (%s)', error)
    return
  with _EARLY_LOCK:
    _EARLY.update(actors=actors, authkey=authkey)


def take_early_lanes() -> tuple[bytes | None, dict]:
  """`(authkey, {spec: actor})`: the lane processes `connect_soon` started, now the
  caller's (it kills those it does not keep); `(None, {})` if none."""
  with _EARLY_LOCK:
    early = dict(_EARLY)
    _EARLY.clear()
  return early.get('authkey'), early.get('actors', {})


def _kill_early_lanes() -> None:
  for actor in take_early_lanes()[1].values():
    kill(actor)


def abandon() -> None:
  """Ends a connection `connect_soon` began that no pool took (the run stopped before
  its lanes started), and the lane processes it started, so that no process is left."""
  if 'thread' in _SOON:
    try:
      connect(_SOON['address'])  # waits for the start, and the lanes it starts
    except BaseException:  # it never connected
      pass
    else:
      shutdown()  # (the early lanes too)
  _kill_early_lanes()


def started_here() -> bool:
  """Whether this process started the cluster it is connected to: then every process of
  the cluster (raylet, GCS, the lanes) is a descendant of this one."""
  return ray.is_initialized() and 'temp_dir' in _STARTED_HERE


def shutdown() -> None:
  """Disconnects; stops the cluster (and removes its logs) if `connect` started it.

  Every process of a cluster started here is gone when this returns (within ~1 s):
  its workers (the lanes) and helpers are killed at once, Ray stops its GCS and
  raylet, and any process of the cluster still alive is killed.
  """
  for host, _ in _HOSTS.values():  # through Ray first: killed by signal alone, its end
    kill(host)  # was taken for a crash, and Ray said so on the terminal
  _HOSTS.clear()  # (the lanes they forked end with them: their parent-death signal)
  # Garbage that holds Ray's references (a closed pool's watches, in reference cycles)
  # is freed now, while Ray is up: collected by another thread while Ray shuts down,
  # its release reaches a core worker that is gone, and Ray ends the process.
  gc.collect()
  _kill_early_lanes()
  temp_dir = _STARTED_HERE.pop('temp_dir', None)
  if temp_dir is None:
    ray.shutdown()
  else:
    started = cluster_processes(temp_dir)
    _kill([p for p in started if _name(p) not in _STOPPED_BY_RAY])
    ray.shutdown()
    _kill(started)
    shutil.rmtree(temp_dir, ignore_errors=True)
    _release_reaper()
  ended = _STARTED_HERE.pop('ended', None)
  if ended is not None:  # the thread that started the cluster (`connect_soon`) may end now
    ended.set()


def _release_reaper() -> None:
  watcher = _STARTED_HERE.pop('reaper', None)
  if watcher is not None:
    reaper.release(watcher)


# Ray's own shutdown stops these (the others would each cost it up to 1 s). The raylet
# fate-shares with its agents: killed first, they took the raylet and its object store
# down while this process was still connected, and Ray ended it with status 1 ("The
# connection to the plasma store is failed. Terminate the process"): an in-process run on
# lanes with its own cluster died so at its end, before returning its summary.
_STOPPED_BY_RAY = ('gcs_server', 'raylet', 'ray::DashboardAgent', 'ray::RuntimeEnvAgent')


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
  """Every process of the cluster this process started in `temp_dir`: Ray's own
  (GCS, raylet, monitors; their command lines name the directory) and all they
  started (workers, lanes, agents)."""
  found = []
  for child in psutil.Process().children():
    try:
      if temp_dir in ' '.join(child.cmdline()):
        found += [child, *child.children(recursive=True)]
    except psutil.Error:  # ended meanwhile
      pass
  return found


def _name(process: psutil.Process) -> str:
  try:
    return process.name()
  except psutil.Error:
    return ''


def _kill(processes: list[psutil.Process], timeout: float = 3.0) -> None:
  """SIGKILLs `processes` all at once and waits (up to `timeout`) until they are gone."""
  for process in processes:
    try:
      process.kill()
    except psutil.Error:
      pass
  psutil.wait_procs(processes, timeout=timeout)


def lane_actor(spec: LaneSpec, env: dict[str, str], authkey: bytes | None = None):
  """A lane process on `spec.host` running `LaneRuntime`, serving its socket with
  `authkey` (`LaneRuntime.serve`): without a GPU, a process forked by its node's
  `forked.LaneHost` (`ForkedLane`), unless `FORK_VAR` is 0; with one, a Ray actor of its
  own (Ray sets which GPU it sees)."""
  hook = {FAULT_VAR: os.environ[FAULT_VAR]} if FAULT_VAR in os.environ else {}  # tests only
  variables = {**compilation_cache.variables(), **hook, **spec.environment(), **env}
  variables['XLA_FLAGS'] = lane_xla_flags(os.environ.get('XLA_FLAGS', ''), variables)
  # On its host's node, the driver's without one: left to Ray, a lane without a host went
  # to any node of a cluster joined by address (half of them elsewhere, on two nodes),
  # pinned to cores of a host nobody named.
  node = _node_id(spec)
  if os.environ.get(FORK_VAR, '1') != '0' and not spec.gpu:
    return ForkedLane(_lane_host(node), spec.name, spec.cores, variables, authkey, spec.moves)
  options = dict(num_cpus=0, num_gpus=spec.gpu, max_restarts=0, max_task_retries=0)
  options['scheduling_strategy'] = scheduling_strategies.NodeAffinitySchedulingStrategy(
    node, soft=False
  )
  return _LANE_ACTOR.options(**options).remote(
    spec.name, spec.cores, variables, authkey, spec.moves
  )


# Lanes without a GPU are forked from a process per node that imported JAX once
# (`forked.py`), ~0.14 CPU-s each against ~1.3 for a Ray actor of their own; set to 0,
# every lane is an actor (the variable is read where the lane starts: the driver).
FORK_VAR = 'JAXSGD_FORKED_LANES'
# node id -> (its `LaneHost` actor, the reference of the host's `lifetime`, done once the
# host died), for this connection (`shutdown` forgets them)
_HOSTS = {}


def _lane_host(node: str):
  """The `LaneHost` of `node`, started at its first lane, and again at the first lane
  after it died (its lanes died with it): a later pool's lanes start on a new one."""
  known = _HOSTS.get(node)
  if known is not None and not ray.wait([known[1]], timeout=0)[0]:
    return known[0]
  from jaxsgd.scheduler.lanes.forked import LaneHost  # pylint: disable=g-import-not-at-top

  temp_dir = _STARTED_HERE.get('temp_dir')  # (a joined cluster's log monitor forwards)
  log_dir = os.path.join(temp_dir, 'jaxsgd-forked-lanes') if temp_dir else None
  host = (
    ray.remote(LaneHost)
    .options(
      num_cpus=0,
      max_concurrency=1000,  # every lane's `spawn` and `watch` wait at once
      max_restarts=0,
      max_task_retries=0,
      scheduling_strategy=scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False),
    )
    .remote(log_dir)
  )
  _HOSTS[node] = (host, host.lifetime.remote())
  return host


class ForkedLane:
  """A lane forked by a `LaneHost`, as the pool sees an actor lane: `info.remote()` (its
  first info, once it serves), `watch.remote()` (done when its process ends: `watch`)
  and `kill`."""

  def __init__(self, host, name, cores, variables, authkey, moves):
    self.host, self.token = host, os.urandom(8).hex()
    spawned = host.spawn.remote(self.token, _code_path(), name, cores, variables, authkey, moves)
    self.info = _Method(lambda: spawned)
    self.watch = _Method(lambda: host.watch.remote(self.token))

  def kill(self) -> None:
    self.host.kill.remote(self.token)


class _Method:
  """`.remote()` of a `ForkedLane` method: a Ray reference, as an actor's method gives."""

  def __init__(self, call):
    self.remote = call


def lane_xla_flags(driver_flags: str, variables: dict[str, str]) -> str:
  """A lane's `XLA_FLAGS`: the driver's but its fake CPU device count (a lane is one
  device), then the lane's own (`variables`, its placement's). XLA's code generation
  flags reach the lanes as they reach the driver: a run on lanes computes the bits of
  the same run in process only when both compiled the same code."""
  carried = [f for f in driver_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return ' '.join([*carried, *variables.get('XLA_FLAGS', '').split()])


def node_address() -> str:
  """This process's host, as the cluster names it (a lane's `info()['host']`)."""
  return ray.util.get_node_ip_address()


def watch(actor):
  """A reference that is done as soon as the lane's process dies: an actor's fails then, a
  forked lane's returns how it ended (`forked.LaneHost.watch`); neither is done before."""
  return actor.watch.remote()


def wait(refs: list, timeout: float | None):
  return ray.wait(refs, num_returns=1, timeout=timeout)


def finished(refs: list) -> list:
  """Those of `refs` that are done now (no wait)."""
  return ray.wait(refs, num_returns=len(refs), timeout=0)[0]


def get(ref):
  return ray.get(ref)


def kill(actor) -> None:
  try:
    if isinstance(actor, ForkedLane):
      actor.kill()
    else:
      ray.kill(actor, no_restart=True)
  except Exception:  # already gone, or Ray is stopping
    pass


def describe(error: BaseException) -> str:
  """A short account of a lane's failure: the lane's own exception, or how it died."""
  if isinstance(error, LaneFailure):
    text = str(error)
  elif isinstance(error, ray.exceptions.RayTaskError) and getattr(error.cause, 'death', 0):
    text = str(error.cause)  # a forked lane's end (`forked.LaneEnded`)
  elif isinstance(error, ray.exceptions.RayTaskError):
    cause = error.cause if error.cause is not None else error
    text = f'{type(cause).__name__}: {cause}'
  elif isinstance(error, ray.exceptions.ActorDiedError):
    text = 'killed, or crashed'
  else:
    text = f'{type(error).__name__}: {error}'
  lines = text.strip().splitlines()
  return lines[0] if len(lines) == 1 else lines[0] + ' ...'


def failed_maker(error: BaseException) -> tuple[str, int] | None:
  """`(lane, call key)` of the call whose failure `error` comes of (a value it was to
  make could not be exported: `runtime.MakerFailed`, however deep among the causes), or
  None."""
  for cause in _causes(error):
    if isinstance(cause, MakerFailed) and hasattr(cause, 'key'):
      return cause.lane, cause.key
  return None


def lost_source(error: BaseException) -> str | None:
  """`host:port` of the lane process whose death made a call fail while taking in a value
  it was to send (`wire.SourceLost`, however deep among the causes), or None."""
  for cause in _causes(error):
    if isinstance(cause, SourceLost) and hasattr(cause, 'source'):
      return cause.source
  return None


def _causes(error: BaseException):
  """`error`, then its `cause`, that one's, and so on (each once)."""
  cause, seen = error, set()
  while cause is not None and id(cause) not in seen:
    seen.add(id(cause))
    yield cause
    cause = getattr(cause, 'cause', None)


def is_death(error: BaseException) -> bool:
  """Whether a failed call failed because a process died (an actor, or the owner of an
  object it needed), rather than because a task raised."""
  if getattr(error, 'death', False) or getattr(getattr(error, 'cause', None), 'death', False):
    return True  # (a lane's: a value it needed was in a lane that died, wire.SourceLost)
  cause = error
  while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
    if cause.cause is cause:
      break
    cause = cause.cause
  return isinstance(cause, ray.exceptions.RayError) and not isinstance(
    cause, ray.exceptions.RayTaskError
  )


def _gpus_needed(shares) -> int:
  """GPUs that lanes asking for `shares` (1, or a part of one) need: a lane's share is
  never split over GPUs, so the parts are packed first-fit, largest first (three 0.6
  shares need 3 GPUs, not 1.8)."""
  free: list[float] = []
  for share in sorted(shares, reverse=True):
    for i, room in enumerate(free):
      if share <= room + 1e-9:
        free[i] -= share
        break
    else:
      free.append(1.0 - share)
  return len(free)


def check_gpus(lanes) -> None:
  """Refuses, in one line, GPU lanes (`gpu=1`, or shares of one) that their node cannot
  take: Ray would wait for a free GPU forever. Lanes' GPUs are added up per node (a lane
  without a host is on the driver's, `lane_actor`) against the node's total GPUs (ones
  another job holds still make a lane wait)."""
  wanted: dict[str, list[LaneSpec]] = {}
  for spec in lanes:
    if spec.gpu:
      wanted.setdefault(_node_id(spec), []).append(spec)
  if not wanted:
    return
  nodes = {n['NodeID']: n for n in ray.nodes() if n.get('Alive')}
  for node_id, specs in wanted.items():
    gpus = int(nodes.get(node_id, {}).get('Resources', {}).get('GPU', 0))
    asked = sum(spec.gpu for spec in specs)
    if gpus < _gpus_needed([spec.gpu for spec in specs]):
      names = ', '.join(repr(spec.name) for spec in specs)
      host = specs[0].host
      where = f'host {host}' if host else "the driver's host"
      raise ValueError(
        f'placement: lane(s) {names} ask for {asked:g} GPU(s) (gpu=1 each, or its share), '
        f'but {where} has {gpus} in the Ray cluster; give fewer lanes a GPU.'
      )


def _node_id(spec: LaneSpec) -> str:
  if spec.host is None:
    return ray.get_runtime_context().get_node_id()
  nodes = [n for n in ray.nodes() if n.get('Alive')]
  for node in nodes:
    if spec.host in (node.get('NodeManagerAddress'), node.get('NodeManagerHostname')):
      return node['NodeID']
  hosts = sorted(n.get('NodeManagerAddress') for n in nodes)
  raise ValueError(
    f'placement: lane {spec.name!r}: host {spec.host!r} is not a node of '
    f'the Ray cluster; its nodes: {hosts}.'
  )


def _code_path() -> list[str]:
  """The lane processes' import path: the driver's, so they import the same code.

  (On other hosts, the same directories where they exist; install jaxsgd there.)
  """
  parts = [os.path.abspath(p or '.') for p in sys.path]
  return list(dict.fromkeys(p for p in parts if os.path.isdir(p)))
