"""Lane processes forked from one process per host that has imported JAX once.

A lane started as a Ray actor is a fresh Python process: Ray's worker (~0.5 CPU-s), then
`import jax` and the lane's modules (~0.8 CPU-s), before it serves anything; four such
lanes were most of a DDG smoke run's start on two cores. A lane forked from a process
that has imported those modules (and started no JAX backend) spends ~0.14 CPU-s: its
backend's start (benchmarks/results/startup.md).

`LaneHost` is that process: a Ray actor per node, with no GPU, which forks every lane
from one thread of its own (Linux ties a child's parent-death signal to the thread that
forked it, which must therefore live as long as the host). A forked lane:
- is no Ray worker: it never calls Ray (it inherits the host's Ray state, not its
  threads), and closes every descriptor it inherits but its pipe to the host;
- dies with its host (`PR_SET_PDEATHSIG`), as an actor lane dies with its worker;
- writes its standard output and error, on a cluster the run started, to a file of its
  own (`lane-PID.err` in the host's `log_dir`), read where its death is said
  (`cluster.lane_output`: such a cluster has no log monitor); on a joined cluster, to the
  host's, which Ray's log monitor forwards to the driver's terminal;
- builds its `LaneRuntime`, which serves its socket, says through the pipe where it
  serves (or why it failed), and lives until its driver's connection ends (the runtime
  then exits) or it is killed.
The driver watches a forked lane through its host: `LaneHost.watch` returns when the
child's process has ended, and the pool takes a finished watch for a death, as it does
Ray's watch of an actor lane. A lane that ends as it starts fails its `spawn` with
`LaneEnded`, which `cluster.is_death` takes for a death.
"""

import ctypes
import os
import pickle
import queue
import signal
import sys
import threading
import traceback

from ray._raylet import setproctitle  # (C: touches no Ray state, as a forked lane must not)

from jaxsgd.scheduler.lanes import runtime as lane_runtime  # JAX, imported once here

_PR_SET_PDEATHSIG = 1


class LaneEnded(RuntimeError):
  """A forked lane's process ended; `death` marks it as one for `cluster.is_death`."""

  death = True


class LaneHost:
  """Forks lane processes on its node (a threaded Ray actor: `spawn` and `watch` calls
  wait at once)."""

  def __init__(self, log_dir: str | None):
    self.where = {**lane_runtime.ray_whereabouts(), 'gpus': []}
    self.log_dir = log_dir
    if log_dir is not None:
      os.makedirs(log_dir, exist_ok=True)
    self.requests: queue.SimpleQueue = queue.SimpleQueue()
    # token -> pid; None for a fork that failed, or a process reaped (`watch`): its pid
    # may be another process's by then, which `kill` must not signal
    self.children: dict[str, int | None] = {}
    self.killed: set[str] = set()  # tokens killed before their process existed
    # How each lane's process ended, once reaped (`_end_of`), and the tokens being reaped
    self.ended: dict[str, str] = {}
    self.reaping: set[str] = set()
    self.born = threading.Condition()
    threading.Thread(target=self._fork_forever, daemon=True, name='lane-forker').start()

  def spawn(
    self, token: str, code: list, name: str, cores, variables: dict, authkey: bytes, moves: str
  ):
    """Forks the lane `name` (`LaneRuntime`'s arguments) under `token`, with the
    driver's import path `code` ahead of this process's (its tasks' modules are the
    driver's: an actor lane finds them by its job's search path, which is the driver's at
    connection); returns its `info()` once it serves, or raises what its start raised."""
    reply: queue.SimpleQueue = queue.SimpleQueue()
    self.requests.put((token, (code, (name, cores, variables, authkey, moves)), reply))
    pid, read = reply.get()
    if isinstance(pid, BaseException):
      raise pid
    with os.fdopen(read, 'rb') as pipe:
      said = pipe.read()  # until the child closes its end: once it serves, or it failed
    if not said:
      raise LaneEnded(f'lane {name}: its process (pid {pid}) ended as it started')
    kind, value = pickle.loads(said)
    if kind == 'err':
      raise RuntimeError(f'lane {name} (pid {pid}) failed to start:\n{value}')
    return value

  def watch(self, token: str) -> str:
    """Returns once the lane of `token` has ended, saying how: the pool takes a watch
    that finished for a death, as it does an actor lane's, which fails then. (Raised
    here, the end would be an error nobody reads, which Ray prints.)"""
    pid = self._pid(token)
    with self.born:
      if token in self.ended:  # reaped already (killed)
        return self.ended[token]
    if pid is None:
      return 'its process never started'
    return self._end_of(token, pid)

  def lifetime(self) -> None:
    """Never returns: the driver's reference to it ends, failed, when this host dies
    (`cluster._lane_host` then starts another)."""
    threading.Event().wait()

  def kill(self, token: str) -> None:
    """Ends the lane of `token` (SIGKILL), at once or as soon as it is forked, and reaps
    it: a lane nobody watches (one started early that no pool took) would otherwise
    stay a zombie while its host lives."""
    with self.born:
      if token not in self.children:
        self.killed.add(token)
        return
      pid = self.children[token]
    if pid is None:  # never started, or ended and reaped
      return
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self._end_of(token, pid)

  def _end_of(self, token: str, pid: int) -> str:
    """How the lane's process ended, once it has: the first caller (`watch` or `kill`)
    reaps it, any other waits for that and gets the same answer (a second `waitpid`
    would fail: the pid is no child of this process any more)."""
    with self.born:
      if token in self.reaping:
        self.born.wait_for(lambda: token in self.ended)
        return self.ended[token]
      self.reaping.add(token)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
      said = f'its process {pid} was killed by signal {os.WTERMSIG(status)}'
    else:
      said = f'its process {pid} ended with exit status {os.WEXITSTATUS(status)}'
    with self.born:
      self.children[token], self.ended[token] = None, said
      self.born.notify_all()
    return said

  def _pid(self, token: str) -> int | None:
    with self.born:
      self.born.wait_for(lambda: token in self.children)
      return self.children[token]

  def _fork_forever(self) -> None:
    while True:
      token, request, reply = self.requests.get()
      try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the lane
          os.close(read)
          _lane_main(write, request, self.where, self.log_dir)
        os.close(write)
      except BaseException as error:  # pylint: disable=broad-except
        with self.born:
          self.children[token] = None
          self.born.notify_all()
        reply.put((error, None))
        continue
      with self.born:
        self.children[token] = pid
        killed = token in self.killed
        self.born.notify_all()
      if killed:
        os.kill(pid, signal.SIGKILL)
        threading.Thread(target=self._end_of, args=(token, pid), daemon=True).start()
      reply.put((pid, read))


def _lane_main(write: int, request: tuple, where: dict, log_dir: str | None) -> None:
  """The forked lane's whole life: never returns."""
  code, args = request
  try:
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the host died before the signal was asked for
      os._exit(1)
    for signum in (signal.SIGTERM, signal.SIGINT):  # Ray's handlers are the host's
      signal.signal(signum, signal.SIG_DFL)
    # Named as an actor lane's process is (`ray::LaneRuntime...`), less Ray's prefix.
    setproctitle(f'jaxsgd::LaneRuntime {args[0]} (forked)')
    if log_dir is not None:
      output = os.open(
        os.path.join(log_dir, f'lane-{os.getpid()}.err'), os.O_WRONLY | os.O_CREAT | os.O_APPEND
      )
      os.dup2(output, 1)
      os.dup2(output, 2)
    _close_inherited(keep={0, 1, 2, write})
    sys.path[:0] = [path for path in code if path not in sys.path]
    lane = lane_runtime.LaneRuntime(*args, where=where)
    _say(write, ('ok', lane.info()))
    lane.stopped.wait()  # the runtime exits the process once its driver is gone
    os._exit(0)
  except BaseException:  # pylint: disable=broad-except
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    try:
      _say(write, ('err', text))
    finally:
      os._exit(1)


def _say(write: int, message) -> None:
  data = memoryview(pickle.dumps(message))
  while data:
    data = data[os.write(write, data) :]
  os.close(write)


def _close_inherited(keep: set[int]) -> None:
  """Closes the descriptors the host had open (Ray's sockets and files): a lane holding
  one would keep the host's connections open after the host died."""
  for name in os.listdir('/proc/self/fd'):
    fd = int(name)
    if fd not in keep:
      try:
        os.close(fd)
      except OSError:  # the listing's own descriptor, closed meanwhile
        pass
