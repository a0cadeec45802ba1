"""Which table of a cost profile prices a run, and what identifies one.

A run's task costs are a table of a profile (`profiles`) measured for the same
computation: the same model (`model_id`: name, shapes, layers, parameter count), batch
size and optimizer (`optimizer_id`: what changes the update task, not the rates), and
a table of the same stage split (`split_of`) and task set (`roles_signature` for the
stage-per-lane families; `server_tasks` for a parameter server; `WORKER_STEP` for a
data-parallel worker). `costs_for` looks the run's table up and `cost_model` makes the
virtual clock's `CostModel` of it; `pipeline_costs` does it for a `PlacedStages`.

The rule: a profile of anything else is refused, in one line naming the field and
saying what to measure (`profiles.ProfileError`); nothing is scaled or guessed.

Reference: docs/simulator.md (the cost sources); tests/scheduler/test_profiles.py.
"""

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxsgd.scheduler.costs import CostModel
from jaxsgd.scheduler.profiles import MODEL_FIELDS, Profile, ProfileError


# --- what identifies a table ------------------------------------------------------------------
def model_id(model) -> dict:
  """What identifies a `StagedModel`'s computation: name, shapes, layers, parameters."""
  variables = jax.eval_shape(lambda key: model.init(key), jax.random.key(0))
  num_params = sum(
    int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(variables.get('params', {}))
  )
  return {
    'name': model.name,
    'input_shape': list(model.input_shape),
    'num_classes': int(model.num_classes),
    'num_layers': int(model.num_layers),
    'num_params': num_params,
  }


def optimizer_id(optimizer) -> str:
  """What of an optimizer changes the update task's computation (not the rates).

  `optimizer`: `config.optimizer` (a mapping) or its `OptimizerSettings`.
  """
  given = (
    dict(optimizer)
    if isinstance(optimizer, Mapping)
    else {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
  )
  kwargs = sorted(dict(given.get('kwargs') or {}))
  return (
    given['name']
    + (f'({",".join(kwargs)})' if kwargs else '')
    + ('+weight_decay' if given.get('weight_decay') else '')
  )


def split_of(stages) -> tuple[tuple[int, int], ...]:
  """`[start, end)` layer range of each stage of `models.split(...)`."""
  return tuple((s.first_layer, s.first_layer + len(s.layers)) for s in stages)


def roles_signature(roles) -> str:
  """The part of each `StageRole` that changes a stage's computation, stage by stage.

  The delay only decides *when* a backward runs, not what it computes, so BP and
  DDG (paper form) share one signature; a delayed backward at the current weights
  (stale graph, recomputation) and auxiliary heads do not.
  """
  return ','.join(
    f'{r.loss}:{"dy" if r.receives_delta else "-"}:{r.sends_delta}'
    f'{"" if r.backward_form == "stored" else ":" + r.backward_form}'
    for r in roles
  )


# `roles_signature(sequential_roles(1))`: one stage, the model's loss, nothing sent
# (a constant, so that this module needs nothing above the engine; tested).
WHOLE_MODEL_WORKER = 'head:-:none'


# The task set of a data-parallel worker's step (forward, backward and inner update
# of the whole model, one table for ssgd, local_sgd, dasgd and diloco): `(0, 'step')`.
WORKER_STEP = 'worker_step'


def server_tasks(algorithm: str) -> str:
  """The task set of a parameter-server algorithm (`asgd`, `dcasgd`): a worker's
  forward and backward of the whole model (one stage) and the server's update,
  whose computation depends on the algorithm (delay compensation)."""
  return f'{WHOLE_MODEL_WORKER}+server:{algorithm}'


# --- looking a run's costs up -----------------------------------------------------------------
def check_matches(
  profile: Profile, *, model, batch_size: int, optimizer: str | None = None, source: str = 'profile'
) -> None:
  """Refuses a profile of another model, batch size or optimizer (one line, the field).

  `model`: a `StagedModel` or its `model_id`; `optimizer`: `optimizer_id(config.optimizer)`
  (None: not checked).
  """
  expected = model if isinstance(model, Mapping) else model_id(model)
  for field in MODEL_FIELDS:
    if profile.model[field] != expected[field]:
      raise ProfileError(
        f'cost.profile {source!r}: model.{field} is '
        f'{profile.model[field]!r} in the profile but {expected[field]!r} '
        f'in this run; measure a profile for this model.'
      )
  if profile.batch_size != batch_size:
    raise ProfileError(
      f'cost.profile {source!r}: batch_size is {profile.batch_size} in the '
      f'profile but {batch_size} in this run; measure one for this batch.'
    )
  if optimizer is not None and profile.optimizer != optimizer:
    raise ProfileError(
      f'cost.profile {source!r}: optimizer is {profile.optimizer!r} in the '
      f'profile but {optimizer!r} in this run (the update task differs); '
      f'measure one for this optimizer.'
    )


def costs_for(
  profile: Profile,
  *,
  model,
  batch_size: int,
  split,
  tasks: str,
  optimizer: str | None = None,
  source: str = 'profile',
) -> dict:
  """The cost table (keys as `CostModel.compute`) of a run, refusing any mismatch: each
  task's cost as the profile holds it (`Table.figures`)."""
  check_matches(profile, model=model, batch_size=batch_size, optimizer=optimizer, source=source)
  try:
    return profile.table(split, tasks).figures()
  except ProfileError as e:
    raise ProfileError(str(e).replace('cost.profile:', f'cost.profile {source!r}:', 1)) from None


def cost_model(
  profile: Profile,
  *,
  model,
  batch_size: int,
  split,
  tasks: str,
  optimizer: str | None = None,
  source: str = 'profile',
  **cost_model_fields,
) -> CostModel:
  """`CostModel(costs_for(...), **cost_model_fields)` (links, speeds, stragglers)."""
  return CostModel(
    costs_for(
      profile,
      model=model,
      batch_size=batch_size,
      split=split,
      tasks=tasks,
      optimizer=optimizer,
      source=source,
    ),
    **cost_model_fields,
  )


# --- stages of a pipeline (`jaxsgd.pipeline.PlacedStages`) ------------------------------------
def pipeline_costs(
  profile: Profile, pipeline, roles, *, optimizer: str | None = None, source: str = 'profile'
) -> dict:
  """`{(stage, kind): seconds}` for `pipeline` in `roles`, from `profile`.

  Refuses a profile of another model, batch size, stage split or task set: what
  `PlacedStages.time_tasks` would have timed (there the fastest call, here the median),
  read from the file instead.
  """
  return costs_for(
    profile,
    model=pipeline.model,
    batch_size=pipeline_batch_size(pipeline),
    split=split_of(pipeline.stages),
    tasks=roles_signature(roles),
    optimizer=optimizer,
    source=source,
  )


def pipeline_batch_size(pipeline) -> int:
  """The batch of one task of `pipeline` (its first stage's input)."""
  return int(pipeline.inputs[0].shape[0])
