"""Joining a multi-process JAX cluster from environment variables.

`python -m jaxsgd.launch` (or a user, on each host of a real cluster) sets

    JAXSGD_COORDINATOR_ADDRESS   host:port of process 0's coordinator service
    JAXSGD_NUM_PROCESSES         number of processes in the cluster
    JAXSGD_PROCESS_ID            this process's index, 0 .. num_processes - 1
    JAXSGD_INIT_TIMEOUT          seconds to wait for the cluster (default 60)

and `initialize_from_env()` calls `jax.distributed.initialize` with them. It must
run before the first JAX operation that touches a device (JAX refuses to join a
cluster once its backend exists), so the launcher runs it first thing
(`jaxsgd.spmd.bootstrap`), and the data-parallel algorithms call it again, as a
no-op, before they look at `jax.devices()`. Without the variables nothing happens
and the run is single-process. On CPU the collectives between processes use gloo.
"""

import os
import socket
import time

import jax

ADDRESS_VAR = 'JAXSGD_COORDINATOR_ADDRESS'
NUM_PROCESSES_VAR = 'JAXSGD_NUM_PROCESSES'
PROCESS_ID_VAR = 'JAXSGD_PROCESS_ID'
TIMEOUT_VAR = 'JAXSGD_INIT_TIMEOUT'
DEFAULT_TIMEOUT_S = 60


class CoordinatorUnreachableError(ConnectionError):
  """The coordinator (process 0) could not be reached within the timeout."""


def cluster_from_env(environ=None) -> dict | None:
  """`{'coordinator_address', 'num_processes', 'process_id', 'timeout'}` or None.

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
  return {'coordinator_address': address, 'num_processes': num, 'process_id': pid,
          'timeout': timeout}


def _int_var(environ, name, *, minimum, default=None):
  raw = environ.get(name)
  if raw is None and default is not None:
    return default
  try:
    value = int(raw)
  except (TypeError, ValueError):
    raise ValueError(f'{name}: an integer >= {minimum} is needed with {ADDRESS_VAR}, '
                     f'got {raw!r}.') from None
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
            f'address one this host can reach?') from None
      time.sleep(0.1)


def initialize_from_env(environ=None) -> bool:
  """Joins the cluster described by the `JAXSGD_*` variables, once.

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
  if cluster['process_id'] != 0:  # Process 0 hosts the service; the others dial it.
    wait_for_coordinator(cluster['coordinator_address'], cluster['timeout'])
  jax.distributed.initialize(
      coordinator_address=cluster['coordinator_address'],
      num_processes=cluster['num_processes'], process_id=cluster['process_id'],
      initialization_timeout=cluster['timeout'],
      # Peers that die are detected by the next collective; a short heartbeat makes
      # the survivors' shutdown fail fast instead of after 100 s.
      heartbeat_timeout_seconds=max(10, cluster['timeout']))
  return True
