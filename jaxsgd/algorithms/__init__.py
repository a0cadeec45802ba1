"""Training algorithms, chosen by `config.algorithm.name`: one shape for all of them.

Every algorithm module exports the same three things (`AlgorithmModule`):

    Settings                          a frozen dataclass: the `config.algorithm` fields and
                                      their defaults (defaults live only here)
    validate(config, model) -> Settings   parses the config once; refuses bad input naming
                                      the field, before anything compiles
    train(run, settings) -> dict      trains, reporting each step to `run` (a `RunContext`);
                                      returns extra summary fields

Names are registered once, below; modules are imported only when chosen. To add an
algorithm: write its module here (on a policy of `jaxsgd.pipeline`,
`jaxsgd.asynchronous` or `jaxsgd.spmd`), add one line to `_MODULES`, add its config in
`experiments/configs/` and its test (docs/architecture.md, "Adding an algorithm").
"""

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

# name -> module. One line per algorithm.
_MODULES = {
  'bp': 'jaxsgd.algorithms.backprop',
  'ddg': 'jaxsgd.algorithms.ddg',
  'local': 'jaxsgd.algorithms.local',
  'ssgd': 'jaxsgd.algorithms.data_parallel',
  'local_sgd': 'jaxsgd.algorithms.data_parallel',
  'dasgd': 'jaxsgd.algorithms.data_parallel',
  'diloco': 'jaxsgd.algorithms.data_parallel',
  'streaming_diloco': 'jaxsgd.algorithms.data_parallel',
  'asgd': 'jaxsgd.algorithms.asgd',
  'dcasgd': 'jaxsgd.algorithms.asgd',
  'lppsgd': 'jaxsgd.algorithms.lppsgd',
  'pdasgd': 'jaxsgd.algorithms.pdasgd',
  'async_local_sgd': 'jaxsgd.algorithms.async_local_sgd',
}


class RunContext(Protocol):
  """What an algorithm's `train` may use of the run (`jaxsgd.training.Run` is one)."""

  model: Any  # the `StagedModel`
  dataset: Any  # the `jaxsgd.data.Dataset`
  is_primary: bool  # process 0 of a multi-process run: the one that writes files

  def train_batches(
    self,
    worker: int = 0,
    num_workers: int = 1,
    *,
    batch_size: int | None = None,
    sharding: str = 'stream',
  ) -> Iterator[dict]:
    """Worker `worker`'s deterministic host batch stream."""

  def report(
    self,
    step: int,
    *,
    loss,
    variables,
    samples: int,
    sim_time: float | None = None,
    extra: Callable[[], dict] | dict | None = None,
    stage: str | None = None,
  ) -> None:
    """Records one step's loss; evaluates and writes metrics at evaluation points."""

  def should_evaluate(self, step: int) -> bool:
    """Whether step `step` is an evaluation point (its weights get evaluated)."""

  def write_schedule_outputs(
    self,
    timeline,
    staleness: dict,
    *,
    cost_table: dict | None,
    epochs: float,
    title: str,
    extra: dict | None = None,
  ) -> dict:
    """Writes what a scheduler run leaves (trace, staleness plot); returns summary fields."""

  def write_agreement(self, steps, cosines, title: str) -> None:
    """Writes local parallelism's gradient-agreement series and its plot."""

  def write_arrays(self, name: str, arrays: dict) -> None:
    """Writes `arrays` to `name` in the workdir (process 0 only)."""

  # Checkpoints (an algorithm whose `Settings.resumable` is True uses these two).
  def restore(self, template, streams=()) -> tuple[int, Any] | None:
    """`(step, state)` of the checkpoint this run resumes (state shaped and placed as
    `template`; `streams`, the batch iterators read, moved to their saved positions),
    or None: start at step 0."""

  def maybe_save(self, step: int, state, streams=(), *, steps: int = 1) -> None:
    """After `report(step)`: saves `state` and the streams' positions if a checkpoint
    is due at one of the `steps` steps ending at `step` (every `checkpoint_every`
    steps, the last step, or SIGTERM: then raises `errors.Preempted`)."""


class AlgorithmModule(Protocol):
  """The shape of every algorithm module (see the package docstring)."""

  Settings: type

  def validate(self, config, model) -> Any:
    """Parses `config` once into `Settings`; refuses bad input naming the field."""

  def train(self, run: RunContext, settings: Any) -> dict:
    """Trains; returns extra summary fields."""


def names() -> tuple[str, ...]:
  return tuple(_MODULES)


def get(name: str) -> AlgorithmModule:
  """The module of the algorithm called `name`; refuses unknown names, listing the known."""
  if name not in _MODULES:
    raise ValueError(f'algorithm.name: unknown algorithm {name!r}; allowed: {", ".join(_MODULES)}.')
  return importlib.import_module(_MODULES[name])
