"""A Ray head node started by `ray start --head`, as on the first host of a cluster.

Tests join it by address — the code path of a run over several hosts — and stop it
by ending the processes it started (its own process group, and the lane workers
found by its session directory), never with `ray stop`, which would stop any Ray
on the machine. A head whose test process dies stops by itself.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


# Runs as the head's process before it becomes `ray start`: asks Linux for SIGTERM once
# the thread that started it ends (prctl's parent-death signal, kept across exec; the
# test process's main thread: when it crashes, say), which `ray start --block`, once it
# blocks, answers by stopping every process of the node (before, the signal ends `ray
# start` alone, and its GCS and raylet may stay); a parent already gone ends it. A
# process of its own rather than `preexec_fn`, which runs Python in a forked child of
# the threaded test process (JAX warns of it).
_STOP_WITH_PARENT = """
import ctypes, os, signal, sys
try:
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux: the fixture stops the head
  pass
if os.getppid() != int(sys.argv[1]):
  sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _name(process: psutil.Process) -> str | None:
  try:
    return process.name()
  except (psutil.Error, OSError):
    return None


def alive(pid: int) -> bool:
  """Whether `pid` runs: a zombie (killed, its parent gone or not reaping it) is not."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def gone(pids, within: float = 5.0) -> list[int]:
  """The pids still alive (not zombies) after waiting up to `within` seconds."""
  deadline = time.monotonic() + within
  while True:
    still = [p for p in pids if alive(p)]
    if not still or time.monotonic() > deadline:
      return still
    time.sleep(0.1)


class RayHead:
  """`ray start --head --block` in a process group of its own."""

  def __init__(self, temp_dir: str, env: dict[str, str]):
    self.temp_dir = temp_dir
    self.port = free_port()
    ray = os.path.join(os.path.dirname(sys.executable), 'ray')
    self.process = subprocess.Popen(
      [
        sys.executable,
        '-c',
        _STOP_WITH_PARENT,
        str(os.getpid()),
        ray,
        'start',
        '--head',
        f'--port={self.port}',
        '--num-cpus=2',
        '--include-dashboard=false',
        '--disable-usage-stats',
        f'--temp-dir={temp_dir}',
        '--block',
      ],
      env=env,
      start_new_session=True,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    self.address = f'127.0.0.1:{self.port}'
    self._wait_ready(timeout=60)

  def _wait_ready(self, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f'ray start exited with {self.process.returncode}')
      if self._raylet_up():
        return
      time.sleep(0.2)
    raise TimeoutError('ray start --head: not ready')

  def _raylet_up(self) -> bool:
    return any(_name(p) == 'raylet' for p in self.processes())

  def processes(self) -> list[psutil.Process]:
    """Every process of this head node: its group, whatever runs in its session dir, and
    what those started (its workers: a lane process is the raylet's child, in a session
    of its own, its command line Ray's title for it, `ray::LaneRuntime`)."""
    found = {}
    for p in psutil.process_iter(['pid', 'name', 'cmdline']):
      try:
        if os.getpgid(p.pid) == self.process.pid or self.temp_dir in ' '.join(
          p.info['cmdline'] or ()
        ):
          found[p.pid] = p
      except (psutil.Error, ProcessLookupError):
        pass
    for p in list(found.values()):
      try:
        found.update((child.pid, child) for child in p.children(recursive=True))
      except (psutil.Error, OSError):  # it ended meanwhile
        pass
    return list(found.values())

  def stop(self):
    """Kills every process of the node, again until none is found (one the raylet was
    starting meanwhile too). SIGTERM to `ray start --block` stops the node in order, but
    took ~2 s of every module that has a head; nothing of a test's node needs that."""
    for _ in range(100):
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      processes = [p for p in self.processes() if p.pid != self.process.pid and alive(p.pid)]
      if not processes:
        break
      for p in processes:
        try:
          p.kill()
        except psutil.Error:
          pass
      time.sleep(0.05)
    self.process.wait()


def serve_head(temp_dir: str):
  """A module fixture's body: a head with Ray's token auth off (as every cluster of the
  tests: conftest.py), yielded, then stopped; asserts that none of its processes is
  alive afterwards."""
  env = {**os.environ, 'RAY_AUTH_MODE': 'disabled', 'RAY_USAGE_STATS_ENABLED': '0'}
  node = RayHead(temp_dir, env)
  yield node
  import ray  # pylint: disable=g-import-not-at-top

  ray.shutdown()
  node.stop()
  assert gone([p.pid for p in node.processes()]) == []
