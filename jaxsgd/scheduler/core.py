"""What a policy is made of: lanes, channels, processes, and the ops they yield.

A *lane* is a row of the cluster that runs one task at a time: a device, a worker,
or a link between two lanes (links are added on first use). A *process* is a
Python generator bound to a lane; it yields ops and the executor answers them:

    def worker(store, inbox):                        # a process
      while True:
        snap = store.read()                          # runs at the task's start
        g = yield Compute(grad_fn, (snap.value, x), kind='forward', stage=0)
        yield Send(inbox, (snap.version, g))         # copied over the link
        reply = yield Get(my_channel)                # waits for a message

- `Compute(fn, args)`: run `fn(*args)` (a jitted JAX call) as a task on a lane.
  The process resumes, with the result, when the task *ends*. Code between two
  yields runs at one instant: the end of the previous task, which is the start of
  the next one. So a process reads stores at a task's start and publishes results
  (store writes, sends) at its end, under either clock.
- `Send(channel, value)`: copy `value` to the channel's device as a transfer task
  on the link lane (sender lane → channel lane); delivered when the copy ends.
  The sender does not wait.
- `Put(channel, value)`: deliver at once, no copy (same device, or a control message).
- `Get(channel)`: wait for the next item of a FIFO channel.
- `Ready(value)`: go on with `value` once every task that made a value in it has
  ended. At once under the in-process clocks (a `Compute` resumes at its end); where a
  process runs ahead of its lanes (the process executor and its model) it waits for
  those tasks, so that what it does next — a PD-ASGD layer update, which names the
  layer's next version — is not handed on before its input exists.

An executor (`VirtualExecutor`, `RealExecutor`, both built on `executor.Executor`)
runs the processes of a `Cluster` and returns a `Timeline` of the tasks it ran.
"""

import collections
import dataclasses
import threading
from collections.abc import Callable, Generator
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Compute:
  """Run `fn(*args)` as one task (kind/stage/batch label it and key its cost)."""

  fn: Callable[..., Any]
  args: tuple = ()
  kind: str = 'compute'
  stage: int | None = None
  batch: int | None = None
  lane: int | None = None  # None: the process's own lane.
  nbytes: int = 0  # transfers: bytes moved (the link cost depends on it)
  arrays: int = 1  # transfers: arrays moved (so may the cost: `cost.link_per_array`)
  # Whether the process executor may let the process go on before the task ends (running
  # ahead with handles to its results). False: the process waits for it, so that what it
  # sends next is not queued on a lane before the result it needs exists (LPP-SGD's mean:
  # a merge queued early held the replica's lane while the mean waited for its inputs).
  ahead: bool = True


@dataclasses.dataclass(frozen=True)
class Send:
  channel: 'Channel'
  value: Any
  batch: int | None = None


@dataclasses.dataclass(frozen=True)
class Put:
  channel: 'Channel'
  value: Any


@dataclasses.dataclass(frozen=True)
class Get:
  channel: 'Channel'


@dataclasses.dataclass(frozen=True)
class Ready:
  """Go on with `value` once the tasks that made it have ended (module docstring)."""

  value: Any


Op = Compute | Send | Put | Get | Ready


class DeadlockError(RuntimeError):
  """Every unfinished process waits on a channel that nobody will fill."""


class Channel:
  """A FIFO of messages for processes on lane `lane`, stored on `device`."""

  def __init__(self, name: str, lane: int, device: jax.Device | None = None):
    self.name = name
    self.lane = lane
    self.device = device
    self.items: collections.deque = collections.deque()
    self.waiters: collections.deque = collections.deque()  # processes blocked in Get
    self.condition = threading.Condition()  # for the threaded executor

  def __repr__(self):
    return f'Channel({self.name!r}, lane={self.lane})'


@dataclasses.dataclass(frozen=True)
class LaneSpec:
  name: str
  device: jax.Device | None = None
  link: tuple[int, int] | None = None  # (source lane, destination lane) for links
  # Lanes with one `shares` key are one piece of hardware: on the virtual clock their
  # tasks run one at a time (FIFO). None: the lane is its own hardware.
  shares: str | None = None


class Cluster:
  """The lanes of a run (compute lanes first, links added when first used)."""

  def __init__(self):
    self.lanes: list[LaneSpec] = []
    self.channels: list[Channel] = []  # in creation order (a checkpoint names them by index)
    self._links: dict[tuple[int, int], int] = {}
    self._lock = threading.Lock()
    self.tasks: dict[int, tuple] = {}  # lane -> the tasks it will run (`declare_tasks`)

  def declare_tasks(self, lane: int, tasks) -> None:
    """Names tasks that `lane` will run, known before the run begins: an executor whose
    lanes are processes has them built there as it begins, in every lane at once
    (`LanePool.prepare`), not each at its first call; the others need nothing of it."""
    if not 0 <= lane < len(self.lanes) or self.lanes[lane].link is not None:
      raise ValueError(f'declare_tasks: lane {lane} is not a compute lane of this cluster.')
    self.tasks[lane] = (*self.tasks.get(lane, ()), *tasks)

  def add_lane(
    self, name: str, device: jax.Device | None = None, *, shares: str | None = None
  ) -> int:
    self.lanes.append(LaneSpec(name, device, shares=shares))
    return len(self.lanes) - 1

  def channel(self, name: str, lane: int) -> Channel:
    channel = Channel(name, lane, self.lanes[lane].device)
    self.channels.append(channel)
    return channel

  @property
  def links(self) -> list[tuple[int, int]]:
    """`(source, destination)` of every link lane, in the order they were added."""
    return sorted(self._links, key=self._links.get)

  def link(self, source: int, destination: int) -> int:
    """The lane of the link `source → destination` (created on first use)."""
    lane = self._links.get((source, destination))  # Once made, a link never changes.
    if lane is not None:
      return lane
    with self._lock:
      if (source, destination) not in self._links:
        name = f'link {self.lanes[source].name} → {self.lanes[destination].name}'
        self.lanes.append(LaneSpec(name, link=(source, destination)))
        self._links[(source, destination)] = len(self.lanes) - 1
      return self._links[(source, destination)]


class LoopState:
  """A process's loop variables, as attributes, and the `phase` (the yield) it is at.

  A *resumable* process keeps every variable that lives across a yield in its state
  and marks each yield with a phase; its program, started again from a saved state,
  goes straight to the saved phase and yields that op again (built from the state):

      def worker(s):                          # s: a LoopState
        while True:
          if s.enter('pull'):                 # a phase begins with its yield
            s.pulled = yield Get(replies)
          if s.enter('compute'):
            s.result = yield Compute(fn, (s.pulled,))
          ...

  `enter(phase)` is True for the phase to run next: when resuming, False for every
  phase until the saved one (the code of those phases ran before the checkpoint), then
  True as usual. Code outside phases runs again on a resume, so there is none but
  loop control on state fields. `jaxsgd.scheduler.snapshot` saves the states.
  """

  def __init__(self, **fields):
    self.phase: str | None = None  # None: not started
    self._resume_at: str | None = None
    self.__dict__.update(fields)

  def enter(self, phase: str) -> bool:
    if self._resume_at is not None:
      if phase != self._resume_at:
        if phase in self._skipped:  # The loop came round without meeting it.
          raise RuntimeError(f'resume: the program never reaches phase {self._resume_at!r}.')
        self._skipped.add(phase)
        return False
      self._resume_at = None
    self.phase = phase
    return True

  def resuming(self) -> 'LoopState':
    """Makes the program started next from this state go to its saved phase."""
    self._resume_at, self._skipped = self.phase, set()
    return self

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ('_resume_at', '_skipped')}

  def __setstate__(self, fields):
    self.__dict__.update(fields)
    self._resume_at = None

  def __repr__(self):
    return f'LoopState(phase={self.phase!r})'


@dataclasses.dataclass(eq=False)
class Process:
  """A generator of ops running on `lane`.

  A resumable process (`Process.resumable`) also has its `state` (a `LoopState`) and
  the `start` that makes its program from a state, so that a checkpoint can save it
  and a resumed run start it again where it was.

  `on_lost`: a process whose loss the run can survive (an asynchronous worker). An
  executor that tolerates lost lanes (`ProcessExecutor(tolerate_lost=True)`), when
  this process's lane dies or raises, closes the process and runs
  `on_lost(reason)` in its place: a generator that tells the others (`Put`s,
  no `Compute`: its lane is gone). None: losing the lane stops the run.
  `on_rejoin(reason)`: the state a resumable process starts again from once its lost
  lane was replaced by a new lane process (the executor tries that first; `on_lost` if
  it cannot): an asynchronous worker that pulls the current parameters and goes on. It
  returns None where the process holds nothing of the lost lane (it waits for a token,
  or has just handed its last result on): the process then goes on where it is.
  """

  name: str
  lane: int
  program: Generator[Op, Any, None]
  done: bool = False
  waiting_on: Channel | None = None  # set while blocked in Get
  on_lost: Callable[[str], Generator[Op, Any, None]] | None = None
  on_rejoin: Callable[[str], 'LoopState | None'] | None = None
  state: LoopState | None = None
  start: Callable[[LoopState], Generator[Op, Any, None]] | None = None

  @classmethod
  def resumable(
    cls, name: str, lane: int, start: Callable[[LoopState], Generator], state: LoopState
  ) -> 'Process':
    return cls(name, lane, start(state), state=state, start=start)

  def restart(self, state: LoopState) -> None:
    """Continues from `state` (saved at a checkpoint): the program goes to its phase."""
    self.program.close()
    self.state = state.resuming() if state.phase is not None else state
    self.program = self.start(self.state)

  def forget(self) -> None:
    """Drops a finished process's variables, as a finished generator drops its locals
    (values that lane processes hold for them are freed)."""
    if self.state is not None and self.done:
      self.state = LoopState()

  def close(self) -> None:
    """Ends the process when the run ends (its program, its variables and its `start`,
    which refers to the policy: nothing of the run stays reachable from it)."""
    self.done = True
    self.program.close()
    self.forget()
    self.start = None


def blocked_report(processes: list[Process]) -> str:
  """Which unfinished processes wait on what (for a DeadlockError)."""
  return ', '.join(f'{p.name} waits on {p.waiting_on}' for p in processes if not p.done)
