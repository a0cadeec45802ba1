"""Joining a multi-process JAX cluster from environment variables.

`python -m jaxsgd.launch` (or a user, on each host of a real cluster) sets

    JAXSGD_COORDINATOR_ADDRESS   host:port of process 0's coordinator service
    JAXSGD_NUM_PROCESSES         number of processes in the cluster
    JAXSGD_PROCESS_ID            this process's index, 0 .. num_processes - 1
    JAXSGD_INIT_TIMEOUT          seconds to wait for the cluster (default 60)
    JAXSGD_HEARTBEAT_TIMEOUT     seconds after which a silent process is dead (default 10)
    JAXSGD_STATUS_FILE           (launcher) where this process records why it failed

and `initialize_from_env()` calls `jax.distributed.initialize` with them. It must
run before the first JAX operation that touches a device (JAX refuses to join a
cluster once its backend exists), so the launcher runs it first thing
(`jaxsgd.spmd.bootstrap`), and the data-parallel algorithms call it again, as a
no-op, before they look at `jax.devices()`. Without the variables nothing happens
and the run is single-process. On CPU the collectives between processes use gloo.

A process of a cluster never hangs on its way out after a failure. JAX ends a
process with a shutdown barrier that waits for every peer, and a peer still inside a
collective waits for this one: a deadlock that only JAX's timeouts (minutes) would
break. So once joined, an uncaught exception (and, through the bootstrap, a non-zero
`sys.exit`) prints its traceback, records one line in `JAXSGD_STATUS_FILE` and ends
the process at once (`os._exit`), skipping the barrier; the peers' next collective then
fails, and the launcher stops them. A cluster that does not form within the timeout
ends each waiting process with one line saying so (instead of JAX's C++ abort).
"""

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback

import jax

ADDRESS_VAR = 'JAXSGD_COORDINATOR_ADDRESS'
NUM_PROCESSES_VAR = 'JAXSGD_NUM_PROCESSES'
PROCESS_ID_VAR = 'JAXSGD_PROCESS_ID'
TIMEOUT_VAR = 'JAXSGD_INIT_TIMEOUT'
HEARTBEAT_VAR = 'JAXSGD_HEARTBEAT_TIMEOUT'
STATUS_FILE_VAR = 'JAXSGD_STATUS_FILE'
DEFAULT_TIMEOUT_S = 60
# A peer that stops sending heartbeats (stopped, frozen, its host gone) is declared
# dead after this long, and JAX ends the others (JAX's default: 100 s). Peers that
# *exit* are noticed sooner: by the next collective, or by the launcher.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# JAX's own deadline for forming the cluster comes this much after ours, so that ours
# (a clear message) fires first and JAX's (a C++ abort, status 134) never does.
_JAX_INIT_MARGIN_S = 10
CLUSTER_DID_NOT_FORM = 'the cluster did not form'


class CoordinatorUnreachableError(ConnectionError):
  """The coordinator (process 0) could not be reached within the timeout."""


def cluster_from_env(environ=None) -> dict | None:
  """`{'coordinator_address', 'num_processes', 'process_id', 'timeout', 'heartbeat'}`.

  None without `JAXSGD_COORDINATOR_ADDRESS` (a single-process run).

  Raises:
    ValueError: naming the variable, when the variables are incomplete or invalid.
  """
  environ = os.environ if environ is None else environ
  if ADDRESS_VAR not in environ:
    return None
  address = environ[ADDRESS_VAR]
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit():
    raise ValueError(f'{ADDRESS_VAR} (coordinator): expected host:port, got {address!r}.')
  num = _int_var(environ, NUM_PROCESSES_VAR, minimum=1)
  pid = _int_var(environ, PROCESS_ID_VAR, minimum=0)
  if pid >= num:
    raise ValueError(f'{PROCESS_ID_VAR}: {pid} is not < {NUM_PROCESSES_VAR}={num}.')
  timeout = _int_var(environ, TIMEOUT_VAR, minimum=1, default=DEFAULT_TIMEOUT_S)
  heartbeat = _int_var(environ, HEARTBEAT_VAR, minimum=1, default=DEFAULT_HEARTBEAT_TIMEOUT_S)
  return {
    'coordinator_address': address,
    'num_processes': num,
    'process_id': pid,
    'timeout': timeout,
    'heartbeat': heartbeat,
  }


def _int_var(environ, name, *, minimum, default=None):
  raw = environ.get(name)
  if raw is None and default is not None:
    return default
  try:
    value = int(raw)
  except (TypeError, ValueError):
    raise ValueError(
      f'{name}: an integer >= {minimum} is needed with {ADDRESS_VAR}, got {raw!r}.'
    ) from None
  if value < minimum:
    raise ValueError(f'{name}: must be >= {minimum}, got {value}.')
  return value


def wait_for_coordinator(address: str, timeout: float) -> None:
  """Waits until a TCP connection to `address` succeeds, or raises after `timeout` s.

  `jax.distributed.initialize` would also give up after its timeout, but with an
  opaque gRPC error (or, for some failures, by aborting the process); checking the
  port first turns a wrong address or a dead process 0 into a clear message.
  """
  host, _, port = address.rpartition(':')
  host = host.strip('[]')
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(1.0, timeout)):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise CoordinatorUnreachableError(
          f'coordinator ({ADDRESS_VAR} / jaxsgd.launch --coordinator): cannot reach '
          f'{address} within {timeout:g} s ({e}); is process 0 running, and is the '
          f'address one this host can reach?'
        ) from None
      time.sleep(0.1)


def initialize_from_env(environ=None) -> bool:
  """Joins the cluster described by the `JAXSGD_*` variables, once.

  From then on this process fails fast (`install_fail_fast`).

  Returns:
    True when this process is (now) part of a multi-process cluster.

  Raises:
    CoordinatorUnreachableError: within `JAXSGD_INIT_TIMEOUT` seconds when process
      0 cannot be reached.
    RuntimeError: when JAX already touched a device in this process.
  """
  cluster = cluster_from_env(environ)
  if cluster is None:
    return False
  if jax.distributed.is_initialized():
    return True
  start = time.monotonic()
  record_status('joining')
  if cluster['process_id'] != 0:  # Process 0 hosts the service; the others dial it.
    wait_for_coordinator(cluster['coordinator_address'], cluster['timeout'])
  with _exit_unless_formed(cluster, deadline=start + cluster['timeout']):
    jax.distributed.initialize(
      coordinator_address=cluster['coordinator_address'],
      num_processes=cluster['num_processes'],
      process_id=cluster['process_id'],
      initialization_timeout=cluster['timeout'] + _JAX_INIT_MARGIN_S,
      heartbeat_timeout_seconds=cluster['heartbeat'],
    )
  record_status('joined')
  install_fail_fast()
  return True


@contextlib.contextmanager
def _exit_unless_formed(cluster, deadline):
  """Ends the process with one clear line if the block still runs at `deadline`.

  Around `jax.distributed.initialize`: JAX's own timeout aborts the process from C++
  (status 134) with a message that names neither the process nor the cause.
  """
  done = threading.Event()

  def watch():
    if not done.wait(max(0.0, deadline - time.monotonic())):
      exit_now(
        1,
        f'{CLUSTER_DID_NOT_FORM} within {cluster["timeout"]} s: process '
        f'{cluster["process_id"]} waited at {cluster["coordinator_address"]} for '
        f'all {cluster["num_processes"]} processes ({NUM_PROCESSES_VAR}) to join; '
        f'a process was not started, failed before joining, or has another '
        f'coordinator or process count',
      )

  threading.Thread(target=watch, daemon=True, name='jaxsgd-cluster-watchdog').start()
  try:
    yield
  finally:
    done.set()


def record_status(event: str, **fields) -> None:
  """Appends `{"event": event, "time": ..., **fields}` to `JAXSGD_STATUS_FILE`, if set.

  One `write` of one line to a file opened for appending: the launcher reads whole
  lines, even if this process is killed right after.
  """
  path = os.environ.get(STATUS_FILE_VAR)
  if not path:
    return
  line = json.dumps({'event': event, 'time': time.time(), **fields}) + '\n'
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      os.write(fd, line.encode())
    finally:
      os.close(fd)
  except OSError:  # The status file only refines the launcher's message.
    pass


def exit_now(status: int, reason: str, *, announce: bool = True) -> None:
  """Prints `reason` (if `announce`), records it for the launcher, ends the process now.

  `os._exit` skips JAX's shutdown barrier (and every other exit handler), which
  would otherwise wait for peers that are themselves waiting for this process.
  """
  reason = ' '.join(str(reason).split())  # One line.
  status = status if 1 <= status <= 255 else 1  # A status of 256 would read as success.
  if announce:
    print(f'error: {reason}', file=sys.stderr)
  record_status('failed', reason=reason, status=status)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)  # pylint: disable=protected-access


def describe(error: BaseException) -> str:
  """`Type: first line of the message`, what the launcher reports for a failure."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0]}' if lines else type(error).__name__


def _fail_fast_hook(kind, error, tb) -> None:
  traceback.print_exception(kind, error, tb)
  exit_now(130 if isinstance(error, KeyboardInterrupt) else 1, describe(error), announce=False)


def install_fail_fast() -> None:
  """Makes an uncaught exception end this process at once (see the module docstring)."""
  sys.excepthook = _fail_fast_hook
