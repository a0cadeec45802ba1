"""The virtual clock of the data-parallel methods: compute + exposed communication.

A step of every worker takes `compute` seconds (measured once on this machine, or
given as `config.cost.compute.step`). Weights or gradients are averaged with a ring
all-reduce of `nbytes` over `M` workers (Patarasuk & Yuan 2009; Thakur et al.
2005), each link with bandwidth β and latency α:

    T_allreduce = 2 (M − 1) / M · nbytes / β  +  2 (M − 1) · α

An average launched at a snapshot step and merged `delay` steps later runs while
those `delay` steps compute (DaSGD, Zhou et al. 2020, arXiv:2006.00441), so the
merge step waits only for what is left:

    step t takes   compute + max(0, T_allreduce − delay · compute)   if t is a merge step
                   compute                                          otherwise

with merge steps t ≥ period, t ≡ delay (mod period), as in
`jaxsgd.transforms.delayed_averaging`. SSGD is period 1, delay 0: the gradient
all-reduce blocks every step (no overlap with the backward pass is modeled).
Local SGD / DiLoCo: delay 0, one blocking all-reduce every `period` steps.

Streaming DiLoCo: one all-reduce of 1/P of the weights every period/P steps, hidden
behind `delay` steps.

The model charges one all-reduce per period, and that is what the compiled programs
issue: with `overlap=True` each period (streaming DiLoCo: each cycle) runs as one
program whose all-reduce reads the stored snapshot and is merged `delay` steps later
(`jaxsgd.spmd.step.make_worker_period` / `make_worker_cycle`); with `overlap=False`
the all-reduce runs inside a `lax.cond` on the merge step, and nothing is hidden.
"""

import dataclasses
from collections.abc import Callable

import jax

from jaxsgd.scheduler import costs as costs_lib


def ring_allreduce_time(nbytes: float, workers: int, *, bandwidth: float, latency: float) -> float:
  """Seconds of a ring all-reduce of `nbytes` per worker over `workers` workers, on links
  of `bandwidth` bytes/s (`inf`: free) and `latency` seconds per message."""
  if workers <= 1:
    return 0.0
  m = workers
  return 2 * (m - 1) / m * nbytes / bandwidth + 2 * (m - 1) * latency


def ring_allreduce_bandwidth(
  seconds: float, nbytes: float, workers: int, *, latency: float
) -> float:
  """The link bandwidth (bytes/s) at which `ring_allreduce_time` is `seconds`: the
  inverse in β; `inf` where the latency alone takes `seconds` or more."""
  if workers <= 1:
    return 0.0
  m = workers
  left = seconds - 2 * (m - 1) * latency
  return 2 * (m - 1) / m * nbytes / left if left > 0 else float('inf')


def tree_bytes(tree) -> int:
  """Bytes of all the arrays in `tree` (per worker: leading worker axes excluded)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
  """Simulated duration of each step of a data-parallel run.

  Attributes:
    compute: seconds of one step's forward, backward and update on one worker.
    comm: seconds of one all-reduce (`ring_allreduce_time`), 0 without communication.
    period: steps between all-reduces (1: every step).
    delay: steps from a snapshot to the merge of its average (merge steps t ≥ period,
      t ≡ delay mod period).
    hidden: steps of compute the all-reduce overlaps before the merge; None: all `delay`
      of them (0 for an all-reduce run inside the merge step, `overlap=False`).
  """

  compute: float
  comm: float
  period: int = 1
  delay: int = 0
  hidden: int | None = None

  @property
  def hidden_steps(self) -> int:
    return self.delay if self.hidden is None else self.hidden

  @property
  def exposed_comm(self) -> float:
    """Seconds a merge step waits for the all-reduce (after the hidden part)."""
    return max(0.0, self.comm - self.hidden_steps * self.compute)

  def comm_budget(self, throughput: float) -> float:
    """The longest all-reduce (s) that keeps `relative_throughput()` at `throughput` or
    more: `hidden` steps of it hidden, `period · compute · (1/throughput − 1)` exposed."""
    return self.hidden_steps * self.compute + self.period * self.compute * (1 / throughput - 1)

  def merges(self, steps: int) -> int:
    """Merge steps among the first `steps`: t = n·period + delay, n ≥ 1."""
    return max(0, (steps - self.delay) // self.period)

  def is_merge_step(self, step: int) -> bool:
    return step >= self.period and step % self.period == self.delay

  def step_time(self, step: int) -> float:
    """Seconds of (1-based) step `step`."""
    return self.compute + (self.exposed_comm if self.is_merge_step(step) else 0.0)

  def elapsed(self, steps: int) -> float:
    """Seconds from the start to the end of step `steps` (closed form)."""
    return steps * self.compute + self.merges(steps) * self.exposed_comm

  def relative_throughput(self) -> float:
    """Steady-state throughput relative to the same run without communication."""
    return self.period * self.compute / (self.period * self.compute + self.exposed_comm)

  def hidden_fraction(self) -> float:
    """Fraction of each all-reduce's time hidden behind compute (1.0 = all)."""
    return 1.0 if self.comm == 0 else 1.0 - self.exposed_comm / self.comm


def sync_time_model(
  compute: float, comm: float, *, period: int, fragments: int = 1, delay: int = 0, hidden=None
) -> StepTimeModel:
  """The time model of a method that syncs 1/`fragments` of the weights every
  `period / fragments` steps (streaming DiLoCo's staggered fragments; 1: all of them every
  `period`), each all-reduce of `comm` seconds merged `delay` steps after its snapshot."""
  return StepTimeModel(compute, comm, period // fragments, delay, hidden)


def measure_seconds(fn: Callable, *args, repeats: int = 5) -> float:
  """The fastest wall seconds of `fn(*args)` to completion (the measured `compute`),
  after one warm-up call (`costs.time_calls`)."""
  return costs_lib.time_calls({'step': (fn, args)}, reps=repeats)['step']
