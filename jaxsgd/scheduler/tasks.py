"""Named tasks: a `Compute` says *which* task to run, not how to build it.

A policy's jitted functions (a stage's forward, a worker's gradient, the server's
apply) are built by a *factory* from picklable settings. A `TaskRecipe` names the
factory and its arguments; a `Task` names one function of what the factory builds.

    recipe = TaskRecipe.of(build_stage_tasks, model=spec, stage=1, optimizer=opt)
    forward = Task(recipe, 'forward')
    y = yield Compute(forward, (params, x), kind='forward', stage=1)

In one process a `Task` is just a callable: the recipe is built once (cached per
process) and the call goes to the jitted function. Pickled, a `Task` is only its
recipe and its name, so an executor whose lanes are other processes sends the name
and each lane builds the same function from the same recipe in its own JAX runtime.
"""

import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

_BUILT: dict['TaskRecipe', Mapping[str, Callable]] = {}
_LOCK = threading.Lock()


def _hash_once(self) -> int:
  """A frozen dataclass's hash (its fields' tuple's, as the dataclass's own), computed
  once per object: the process executor looks a task up several times per dispatch, and a
  recipe's hash walks every setting in it. Not pickled (`_state_without_hash`): a
  string's hash differs from one process to the next."""
  known = self.__dict__.get('_hash')
  if known is None:
    known = self.__dict__['_hash'] = hash(
      tuple(getattr(self, field.name) for field in dataclasses.fields(self))
    )
  return known


def _state_without_hash(self) -> dict:
  return {name: value for name, value in self.__dict__.items() if name != '_hash'}


@dataclasses.dataclass(frozen=True)
class TaskRecipe:
  """`factory(**kwargs)` builds a mapping name -> callable; hashable and picklable.

  Attributes:
    factory: `'package.module:function'`, a module-level function.
    kwargs: its keyword arguments as sorted `(name, value)` pairs; every value must be
      hashable and picklable (frozen dataclasses, tuples, numbers, strings).
  """

  factory: str
  kwargs: tuple[tuple[str, Any], ...] = ()

  __hash__ = _hash_once
  __getstate__ = _state_without_hash

  @classmethod
  def of(cls, factory: Callable[..., Mapping[str, Callable]], **kwargs) -> 'TaskRecipe':
    """The recipe of a module-level `factory` called with `kwargs`."""
    module = factory.__module__
    if module == '__main__':  # A script run with `python -m pkg.mod`: name it as imported.
      spec = getattr(sys.modules['__main__'], '__spec__', None)
      module = spec.name if spec is not None else module
    path = f'{module}:{factory.__qualname__}'
    if '<' in path:
      raise ValueError(f'{path}: a task factory must be a module-level function.')
    return cls(path, tuple(sorted(kwargs.items())))

  def build(self) -> Mapping[str, Callable]:
    """The functions this recipe makes, built once per process."""
    built = _BUILT.get(self)
    if built is None:
      with _LOCK:
        built = _BUILT.get(self)
        if built is None:
          module, name = self.factory.split(':')
          built = _BUILT[self] = getattr(importlib.import_module(module), name)(**dict(self.kwargs))
    return built


@dataclasses.dataclass(frozen=True)
class Task:
  """One named function of a recipe; calling it runs the function built here."""

  recipe: TaskRecipe
  name: str

  __hash__ = _hash_once
  __getstate__ = _state_without_hash

  def __call__(self, *args):
    return self.recipe.build()[self.name](*args)

  def __repr__(self):
    return f'Task({self.name!r} of {self.recipe.factory})'
