"""Cost profiles: the file that holds measured task costs, written once, read by every run.

The virtual clock needs the seconds each task takes; measured at the start of every run,
they would depend on whatever else the machine did then. A *profile* is measured once
(`task_timing`), saved (`save`) and read back as is (`load`) by every run that names it
(`cost.profile`): two runs with one profile simulate the same times, bit for bit.
`profile_lookup` finds the table that prices a run; `repricing` makes a profile of a
pilot run's task durations. A file is checked field by field where it is read, a bad one
refused in one line naming the field (`ProfileError`); tables measured differently
(statistic, clock, pinning, model, device) are never mixed (`merge`).

File format (JSON, `FORMAT`):

    {"format": "jaxsgd-cost-profile/1",
     "model": {"name": "cnn", "input_shape": [40, 1], "num_classes": 10,
               "num_layers": 6, "num_params": 12345},
     "batch_size": 128, "optimizer": "adam", "device_kind": "cpu", "platform": "cpu",
     "jax_version": "0.10.2", "date": "<ISO 8601, UTC>",
     "statistic": "median", "clock": "wall", "pinned": false, "busy_cores": 0,
     "warmup": 3, "reps": 30,
     "dispatch": {"jax_call": 8e-06, "real": 3e-05, "real_threads": 6e-05},
     "tables": [{"split": [[0, 3], [3, 6]], "tasks": "<roles signature>",
                 "costs": {"0/forward": 0.001, "0/backward": 0.002, ...},
                 "spread": {"0/forward": {"min": ..., "p90": ...}, ...}}]}

A cost is the median of a task's timed calls (`statistic`; `task_timing` says why); a
file of fastest calls (`"min"`, older) loads at the medians its `spread` kept. A profile
holds one table per (stage split, task set): a suite whose methods cut the model the same
way and run the same computations shares one table (BP and DDG), others add their own
(auxiliary heads change the computation). Cost keys are those of `CostModel.compute`:
`(stage, kind)` written `"stage/kind"`, or `kind` alone (every stage). `dispatch`: the
seconds the in-process executors add per task (`lane_timing.measure_dispatch`), for
information only: the virtual clock reads an executor's host from a host profile
(`cost.host`, `jaxsgd.scheduler.host`); older files' process-executor figures there load
unread.

`busy_cores`: how many other cores computed while the tasks were timed (`experiments.profile
--busy_cores`): a core's speed depends on its neighbours' work (shared cache and memory
bus, an all-core clock below the one-core turbo), so a profile for lanes that fill K cores
is measured with K - 1 of them busy. A file without the field was measured with none.

Reference: docs/simulator.md (cost sources, a profile's repeatability);
tests/scheduler/test_profiles.py.
"""

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FORMAT = 'jaxsgd-cost-profile/1'
# A profile's `statistic`: each cost is the median of a task's timed calls (`task_timing.measure`).
STATISTIC = 'median'
# The other figures of each task's repetitions a profile keeps (`Table.spread`).
SPREAD_STATISTICS = ('min', 'p90')
# The `statistic` of files whose costs were each task's fastest call, their median in `spread`.
FASTEST_CALL = 'min'
# A profile's `clock`: what timed its tasks (`task_timing.CLOCKS`).
CLOCK_NAMES = ('wall', 'cpu')
_FIELDS = (
  'format',
  'model',
  'batch_size',
  'optimizer',
  'device_kind',
  'platform',
  'jax_version',
  'date',
  'statistic',
  'clock',
  'pinned',
  'warmup',
  'reps',
  'dispatch',
  'tables',
  'busy_cores',
)
_OPTIONAL = {'busy_cores': 0}  # fields a file may lack (written before them): their value then
# Fields a file holds as the `Profile` does (the others: `format`, `model`, `dispatch`, `tables`).
_PLAIN = ('batch_size', 'optimizer', 'device_kind', 'platform', 'jax_version', 'date')
_PLAIN += ('statistic', 'clock', 'pinned', 'warmup', 'reps', 'busy_cores')
# What two profiles must share to be merged: the model, the batch, how they were measured.
_ALIKE = ('model', 'batch_size', 'optimizer', 'device_kind', 'platform', 'statistic', 'clock')
_ALIKE += ('pinned', 'busy_cores')
# A profile's `model`: what identifies the model's computation (`profile_lookup.model_id`).
MODEL_FIELDS = ('name', 'input_shape', 'num_classes', 'num_layers', 'num_params')


def spread_of(seconds: Sequence[float]) -> dict[str, float]:
  """A task's `spread` (`SPREAD_STATISTICS`) from its timed calls: the fastest and the
  90th percentile."""
  return {'min': float(np.min(seconds)), 'p90': float(np.quantile(seconds, 0.9))}


class ProfileError(ValueError):
  """A profile file that cannot be read, or does not fit the run."""


@dataclasses.dataclass(frozen=True)
class Table:
  """The measured costs of one stage split and task set.

  Attributes:
    split: `[start, end)` layer range of every stage.
    tasks: names the computations measured (`profile_lookup.roles_signature`, ...).
    costs: seconds keyed like `CostModel.compute`: `(stage, kind)` or `kind`.
    spread: per key, `{'min': s, 'p90': s}` of the same repetitions (diagnostic).
  """

  split: tuple[tuple[int, int], ...]
  tasks: str
  costs: Mapping[Any, float]
  spread: Mapping[Any, Mapping[str, float]] = dataclasses.field(default_factory=dict)

  def figures(self, statistic: str = STATISTIC) -> dict:
    """Seconds per task as `statistic` of the repetitions: `'median'` (`costs`, what the
    virtual clock prices a task at) or `'min'` / `'p90'` (`spread`: the fastest call, and
    how slow one in ten was). Refuses a table that lacks the figure for some task."""
    if statistic == STATISTIC:
      return dict(self.costs)
    if statistic not in SPREAD_STATISTICS:
      raise ProfileError(
        f'statistic: {statistic!r} is not a figure of a profile; allowed: '
        f'{", ".join((STATISTIC, *SPREAD_STATISTICS))}.'
      )
    missing = [key_text(k) for k in self.costs if statistic not in self.spread.get(k, {})]
    if missing:
      raise ProfileError(
        f'cost.profile: no {statistic} for task {missing[0]} (its table\'s "spread" lacks it); '
        f"measure the profile again, or ask for statistic='{STATISTIC}'."
      )
    return {k: float(self.spread[k][statistic]) for k in self.costs}


@dataclasses.dataclass(frozen=True)
class Profile:
  """Measured task costs of one model and batch size on one kind of device."""

  model: Mapping[str, Any]
  batch_size: int
  optimizer: str
  device_kind: str
  platform: str
  jax_version: str
  date: str
  statistic: str
  clock: str
  pinned: bool
  warmup: int
  reps: int
  dispatch: Mapping[str, float]
  tables: tuple[Table, ...]
  busy_cores: int = 0  # other cores of the host computing while the tasks were timed

  def table(self, split: Sequence[Sequence[int]], tasks: str) -> Table:
    """The table of `split` and `tasks`; refuses (naming what it has) when absent."""
    split = as_split(split)
    for table in self.tables:
      if table.split == split and table.tasks == tasks:
        return table
    have = '; '.join(f'split={list(map(list, t.split))} tasks={t.tasks!r}' for t in self.tables)
    raise ProfileError(
      f'cost.profile: no table for split={list(map(list, split))} '
      f'tasks={tasks!r}; the profile has: {have or "none"}.'
    )


# --- reading and writing ----------------------------------------------------------------------
def to_json(profile: Profile) -> dict:
  return {
    'format': FORMAT,
    'model': dict(profile.model),
    **{field: getattr(profile, field) for field in _PLAIN},
    'dispatch': dict(profile.dispatch),
    'tables': [
      {
        'split': [list(r) for r in t.split],
        'tasks': t.tasks,
        'costs': {key_text(k): v for k, v in t.costs.items()},
        'spread': {key_text(k): dict(v) for k, v in t.spread.items()},
      }
      for t in profile.tables
    ],
  }


def save(profile: Profile, path: str) -> None:
  """Writes `profile` as JSON (atomically: a reader never sees half a file)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  partial = f'{path}.tmp{os.getpid()}'
  with open(partial, 'w') as f:
    json.dump(to_json(profile), f, indent=1, sort_keys=True)
    f.write('\n')
  os.replace(partial, path)


def load(path: str) -> Profile:
  """Reads and checks a profile; a bad file raises `ProfileError` naming the field."""
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    raise ProfileError(f'cost.profile: cannot read {path!r}: {e.strerror}.') from None
  except json.JSONDecodeError as e:
    raise ProfileError(f'cost.profile: {path!r} is not JSON ({e.msg}, line {e.lineno}).') from None
  return from_json(data, source=path)


def from_json(data: Any, source: str = 'profile') -> Profile:
  """A `Profile` from the JSON object `to_json` writes, checked field by field."""
  where = f'cost.profile {source!r}'
  if not isinstance(data, dict):
    raise ProfileError(f'{where}: expected a JSON object, got {type(data).__name__}.')
  if data.get('format') != FORMAT:
    raise ProfileError(f'{where}: field "format" must be {FORMAT!r}, got {data.get("format")!r}.')
  data = {**_OPTIONAL, **data}
  missing = [f for f in _FIELDS if f not in data]
  if missing:
    raise ProfileError(f'{where}: missing field(s) {", ".join(missing)}.')
  unknown = sorted(set(data) - set(_FIELDS))
  if unknown:
    raise ProfileError(
      f'{where}: unknown field(s) {", ".join(unknown)}; allowed: {", ".join(_FIELDS)}.'
    )
  model = data['model']
  if not isinstance(model, dict) or sorted(model) != sorted(MODEL_FIELDS):
    raise ProfileError(
      f'{where}: field "model" must have exactly the keys {", ".join(MODEL_FIELDS)}, got {model!r}.'
    )
  for field in ('batch_size', 'warmup', 'reps'):
    _check_int(data[field], field, where)
  _check_int(data['busy_cores'], 'busy_cores', where, least=0)
  for field in ('optimizer', 'device_kind', 'platform', 'jax_version', 'date', 'statistic'):
    if not isinstance(data[field], str):
      raise ProfileError(f'{where}: field "{field}" must be a string, got {data[field]!r}.')
  if data['clock'] not in CLOCK_NAMES:
    raise ProfileError(
      f'{where}: field "clock" must be one of {", ".join(CLOCK_NAMES)}, got {data["clock"]!r}.'
    )
  if not isinstance(data['pinned'], bool):
    raise ProfileError(f'{where}: field "pinned" must be true or false, got {data["pinned"]!r}.')
  dispatch = data['dispatch']
  if not isinstance(dispatch, dict):
    raise ProfileError(f'{where}: field "dispatch" must be an object, got {dispatch!r}.')
  for name, seconds in dispatch.items():
    _check_seconds(seconds, f'dispatch.{name}', where)
  if not isinstance(data['tables'], list) or not data['tables']:
    raise ProfileError(f'{where}: field "tables" must be a non-empty list.')
  tables = tuple(_table(t, i, where) for i, t in enumerate(data['tables']))
  statistic = data['statistic']
  if statistic == FASTEST_CALL:
    tables = tuple(_priced_at_median(t, i, where) for i, t in enumerate(tables))
    statistic = STATISTIC
  return Profile(
    **{field: data[field] for field in _PLAIN if field != 'statistic'},
    model=dict(model),
    statistic=statistic,
    dispatch={k: float(v) for k, v in dispatch.items()},
    tables=tables,
  )


def merge(old: Profile, new: Profile) -> Profile:
  """`new`'s tables added to `old`'s (replacing a table of the same split and tasks).

  Both must describe the same model, batch size, optimizer and device kind and be
  measured the same way (statistic, clock, pinning, busy cores); the result has `new`'s date,
  jax version, and its dispatch figures added to (or replacing) `old`'s.
  """
  for field in _ALIKE:
    if getattr(old, field) != getattr(new, field):
      raise ProfileError(
        f'cost.profile: cannot add to a profile of another {field} '
        f'({getattr(old, field)!r} there, {getattr(new, field)!r} here).'
      )
  replaced = {(t.split, t.tasks) for t in new.tables}
  kept = tuple(t for t in old.tables if (t.split, t.tasks) not in replaced)
  return dataclasses.replace(
    new, tables=kept + tuple(new.tables), dispatch={**old.dispatch, **new.dispatch}
  )


# --- helpers ----------------------------------------------------------------------------------
def key_text(key) -> str:
  """A cost key as the file writes it: `"stage/kind"`, or `kind`."""
  if isinstance(key, tuple):
    stage, kind = key
    return f'{stage}/{kind}'
  return str(key)


def _key(text: str, where: str):
  if '/' not in text:
    return text
  stage, kind = text.split('/', 1)
  if not stage.isdigit() or not kind:
    raise ProfileError(f'{where}: cost key {text!r} must be "stage/kind" or "kind".')
  return int(stage), kind


def as_split(split) -> tuple[tuple[int, int], ...]:
  """`split` (`[start, end)` layer ranges) as a table keys it: a tuple of int pairs."""
  return tuple((int(a), int(b)) for a, b in split)


def _table(data, index: int, where: str) -> Table:
  field = f'tables[{index}]'
  if not isinstance(data, dict) or not {'split', 'tasks', 'costs'} <= set(data):
    raise ProfileError(f'{where}: field "{field}" must have split, tasks and costs.')
  split = data['split']
  if (
    not isinstance(split, list)
    or not split
    or any(
      not isinstance(r, list)
      or len(r) != 2
      or not all(isinstance(i, int) for i in r)
      or not 0 <= r[0] < r[1]
      for r in split
    )
  ):
    raise ProfileError(
      f'{where}: field "{field}.split" must be a list of [start, end) layer ranges, got {split!r}.'
    )
  if not isinstance(data['tasks'], str):
    raise ProfileError(f'{where}: field "{field}.tasks" must be a string.')
  if not isinstance(data['costs'], dict) or not data['costs']:
    raise ProfileError(f'{where}: field "{field}.costs" must be a non-empty object.')
  costs = {}
  for text, seconds in data['costs'].items():
    _check_seconds(seconds, f'{field}.costs.{text}', where)
    costs[_key(text, where)] = float(seconds)
  kept = data.get('spread') or {}
  if not isinstance(kept, dict) or not all(isinstance(f, dict) for f in kept.values()):
    raise ProfileError(f'{where}: field "{field}.spread" must give each task an object of seconds.')
  spread = {}
  for text, figures in kept.items():
    for name, seconds in figures.items():
      _check_seconds(seconds, f'{field}.spread.{text}.{name}', where)
    spread[_key(text, where)] = {k: float(v) for k, v in figures.items()}
  return Table(as_split(split), data['tasks'], costs, spread)


def _priced_at_median(table: Table, index: int, where: str) -> Table:
  """A table of a file whose costs are each task's fastest call (`FASTEST_CALL`), as one
  measured now: each cost the median its `spread` kept, the fastest call in `spread`."""
  for key in table.costs:
    if 'median' not in table.spread.get(key, {}):
      raise ProfileError(
        f'{where}: field "tables[{index}].spread" has no median for {key_text(key)}, and '
        f'a task costs the median of its calls (this file holds the fastest, "statistic": '
        f'"{FASTEST_CALL}"); measure the profile again (python -m experiments.profile).'
      )
  return dataclasses.replace(
    table,
    costs={k: table.spread[k]['median'] for k in table.costs},
    spread={
      k: {'min': fastest, **{s: v for s, v in table.spread[k].items() if s != 'median'}}
      for k, fastest in table.costs.items()
    },
  )


def _check_int(value, field: str, where: str, least: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    what = 'a positive integer' if least == 1 else f'an integer >= {least}'
    raise ProfileError(f'{where}: field "{field}" must be {what}, got {value!r}.')


def _check_seconds(value, field: str, where: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
    raise ProfileError(
      f'{where}: field "{field}" must be a finite number of seconds >= 0, got {value!r}.'
    )
