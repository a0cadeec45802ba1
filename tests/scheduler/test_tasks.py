"""Named tasks: built once per process, pickled as their recipe and name."""

import pickle

import pytest

from jaxsgd.scheduler.tasks import Task, TaskRecipe

CALLS = []


def build_adders(offset: int):
  CALLS.append(offset)
  return {'add': lambda x: x + offset, 'sub': lambda x: x - offset}


def test_task_calls_the_function_its_recipe_builds_once():
  recipe = TaskRecipe.of(build_adders, offset=3)
  before = len(CALLS)
  assert Task(recipe, 'add')(4) == 7
  assert Task(recipe, 'sub')(4) == 1
  assert len(CALLS) == before + 1  # one build for both names


def test_task_pickles_as_recipe_and_name():
  task = Task(TaskRecipe.of(build_adders, offset=5), 'add')
  copy = pickle.loads(pickle.dumps(task))
  assert copy == task and copy(1) == 6
  assert b'lambda' not in pickle.dumps(task)


def test_recipe_refuses_a_local_factory():
  def local():
    return {}

  with pytest.raises(ValueError, match='module-level'):
    TaskRecipe.of(local)
