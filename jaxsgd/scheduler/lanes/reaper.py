"""A cluster started by a run ends with the run's driver, however the driver ends.

`cluster.shutdown` stops a cluster started here when the driver closes its pool, after
an error, at Ctrl-C or at SIGTERM. A driver killed with SIGKILL (the out-of-memory
killer, `kill -9`, a batch system's hard limit) runs none of it: Ray's GCS and raylet die
with it (their parent-death signal), the lanes with their hosts, but the raylet's
agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) outlived it (still there 30 s
later), and the cluster's directory of logs stayed in the temporary directory.

So a run that starts a cluster starts this small watcher first (`watch`): a process of
the standard library alone, which reads the cluster's directory from its standard input
and then waits for that input to end. The driver holds the only writing end, which the
kernel closes when the driver ends, in whatever way. The watcher then kills every
process of the cluster until none is left, and removes the directory. A process of the
cluster is one whose command line names the directory (the GCS, the raylet), or that
has a file of it open (every Ray process writes its logs there), or a descendant of one
(workers, lanes): `cluster_pids`. By its open files, since Ray's agents rewrite their
command lines, and once the raylet is gone they are children of no process of the
cluster. The processes are all found before any is killed: a killed parent's children
are handed to another parent.

At an orderly shutdown the driver stops the cluster itself, then tells the watcher so
(`release`), which ends without a look: a process the driver forked holds the driver's
open files of the directory (Ray's logs of the driver), and is no part of the cluster.

The directory goes over the input, not the command line: `cluster.cluster_processes`
finds the cluster's processes by their command lines, and would take the watcher for one.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

# After the driver's end, the raylet may still be starting a worker: the watcher looks
# again until it finds no process of the cluster, for this long at most.
SWEEP_SECONDS = 10.0
RELEASED = b'released'  # what the driver writes at an orderly shutdown (`release`)


def watch(temp_dir: str) -> subprocess.Popen:
  """Starts the watcher of the cluster in `temp_dir` (module docstring); `release` ends it."""
  watcher = subprocess.Popen(
    [sys.executable, '-I', '-S', os.path.abspath(__file__)],
    stdin=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    # Its own session: Ctrl-C on the terminal, or a signal to the driver's group, ends
    # the driver and leaves the watcher to clean up after it.
    start_new_session=True,
  )
  watcher.stdin.write(temp_dir.encode() + b'\n')
  watcher.stdin.flush()
  return watcher


def release(watcher: subprocess.Popen, timeout: float = 5.0) -> None:
  """Tells the watcher that the cluster is stopped (it ends, killing nothing) and reaps it."""
  try:
    watcher.stdin.write(RELEASED)
    watcher.stdin.close()
  except OSError:
    pass
  try:
    watcher.wait(timeout)
  except subprocess.TimeoutExpired:
    watcher.kill()
    watcher.wait()


def cluster_pids(temp_dir: str, proc: str = '/proc') -> set[int]:
  """Every live process whose command line names `temp_dir` or that has a file under it
  open, and all their descendants; neither this process nor its parent."""
  folder = temp_dir.rstrip('/').encode()
  parents, named = {}, set()
  for entry in os.listdir(proc):
    if not entry.isdigit():
      continue
    pid = int(entry)
    try:
      with open(f'{proc}/{entry}/stat', 'rb') as f:
        stat = f.read()
      with open(f'{proc}/{entry}/cmdline', 'rb') as f:
        command = f.read()
    except OSError:  # ended meanwhile
      continue
    # After the command's name, in parentheses (it may hold spaces and parentheses
    # itself): the state, then the parent.
    state, parent = stat[stat.rindex(b')') + 2 :].split()[:2]
    if state in (b'Z', b'X'):  # ended, waiting for its parent to reap it
      continue
    parents[pid] = int(parent)
    names = folder + b'/' in command or folder + b'\0' in command
    if names or _has_open_under(f'{proc}/{entry}/fd', folder + b'/'):
      named.add(pid)
  children = {}
  for pid, parent in parents.items():
    children.setdefault(parent, []).append(pid)
  found, todo = set(), list(named)
  while todo:
    pid = todo.pop()
    if pid not in found:
      found.add(pid)
      todo += children.get(pid, [])
  # Never the watcher, nor its parent: the driver while it lives, else whoever adopted it.
  found -= {os.getpid(), os.getppid()}
  return found


def _has_open_under(fds: str, prefix: bytes) -> bool:
  """Whether a descriptor in the folder `fds` (a process's /proc/<pid>/fd) is a file
  whose path starts with `prefix` (removed since, too: its link then ends in
  ' (deleted)')."""
  try:
    names = os.listdir(fds)
  except OSError:  # ended meanwhile, or another user's
    return False
  for name in names:
    try:
      if os.readlink(os.path.join(fds, name).encode()).startswith(prefix):
        return True
    except OSError:
      pass
  return False


def sweep(temp_dir: str, seconds: float = SWEEP_SECONDS) -> None:
  """Kills the cluster's processes until none is found (`seconds` at most), then removes
  `temp_dir`."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    pids = cluster_pids(temp_dir)
    if not pids:
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:  # gone already
        pass
    time.sleep(0.05)
  shutil.rmtree(temp_dir, ignore_errors=True)


def main() -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  temp_dir = sys.stdin.buffer.readline().decode().strip()
  said = sys.stdin.buffer.read()  # until the driver's end of the pipe is closed
  if temp_dir and said != RELEASED:
    sweep(temp_dir)


if __name__ == '__main__':
  main()
