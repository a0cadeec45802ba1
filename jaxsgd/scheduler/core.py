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


Op = Compute | Send | Put | Get


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
    self._links: dict[tuple[int, int], int] = {}
    self._lock = threading.Lock()

  def add_lane(
    self, name: str, device: jax.Device | None = None, *, shares: str | None = None
  ) -> int:
    self.lanes.append(LaneSpec(name, device, shares=shares))
    return len(self.lanes) - 1

  def channel(self, name: str, lane: int) -> Channel:
    return Channel(name, lane, self.lanes[lane].device)

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


@dataclasses.dataclass(eq=False)
class Process:
  """A generator of ops running on `lane`."""

  name: str
  lane: int
  program: Generator[Op, Any, None]
  done: bool = False
  waiting_on: Channel | None = None  # set while blocked in Get

  def close(self) -> None:
    self.done = True
    self.program.close()


def blocked_report(processes: list[Process]) -> str:
  """Which unfinished processes wait on what (for a DeadlockError)."""
  return ', '.join(f'{p.name} waits on {p.waiting_on}' for p in processes if not p.done)
