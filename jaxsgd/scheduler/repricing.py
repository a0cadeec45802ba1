"""Re-pricing a profile from a trace: each task costs what it took in a pilot run.

A profile measured alone (`task_timing`) sees a quiet core. A *re-priced* profile
(`reprice_from_trace`) gives each task the mean of its durations in a real run's
trace (`trace_durations`, each lane's first tasks left out: compiling), so the virtual
clock given it replays the machine as the pilot found it: load, neighbours on shared
cores, a slow spell. The mean, not the median a measured profile takes: a run's time is
its tasks' sum, the virtual clock's noise keeps a price's mean, and a slow spell that
slows fewer than half the calls is part of what the pilot found (the median would drop
it). `experiments.reprice` is the command; `benchmarks/simulator_accuracy.py`
measures the same idea in its "repriced" column.

The rule: a re-priced profile is of one run's config (one table), says so in its
`statistic` (`REPRICED`, so that `profiles.merge` never mixes it with measured tables),
and keeps the measured cost of a task the run did not time. The pilot (`check_pilot`)
must be a run on the real clock of the profile's model and batch size, best on lane
processes (the in-process real clock with several stages on one CPU device is none).
Speed factors the simulation applies to lanes (`cost.speeds`, LPP-SGD's workers sharing a
device) scale the re-priced costs again, so LPP-SGD runs with several workers per device
are refused as pilots.

Reference: docs/simulator.md (re-pricing a profile from a pilot run);
tests/test_reprice.py.
"""

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxsgd.scheduler.profiles import Profile, ProfileError, Table, key_text, spread_of

# A profile's `statistic` when its costs are a pilot run's means (`reprice_from_trace`).
# Files re-priced before at the median say 'median of a run' and still load as they are.
REPRICED = 'mean of a run'


def trace_durations(path: str, skip: int) -> dict[tuple[Any, str], list[float]]:
  """Seconds of every compute task of a run's trace (`trace.json`, as
  `Timeline.write_chrome_trace` writes it), by `(stage, kind)`, leaving out each lane's
  first `skip` tasks in time order (compiling, warming up) and the transfers of link
  lanes."""
  if skip < 0:
    raise ProfileError(f'skip: tasks left out per lane, >= 0; got {skip}.')
  try:
    with open(path) as f:
      events = json.load(f)['traceEvents']
    names = {e['tid']: e['args']['name'] for e in events if e.get('name') == 'thread_name'}
    tasks = sorted(
      (
        (e['ts'], e['tid'], (e['args'].get('stage'), e['cat']), e['dur'] / 1e6)
        for e in events
        if e.get('ph') == 'X'
      ),
      key=lambda task: (task[0], repr(task[1])),
    )
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ProfileError(f'trace {path!r}: not a trace.json of a run ({e!r}).') from None
  seen: dict[Any, int] = {}
  durations: dict[tuple[Any, str], list[float]] = {}
  for _, lane, key, seconds in tasks:
    if names.get(lane, '').startswith('link '):
      continue
    seen[lane] = seen.get(lane, 0) + 1
    if seen[lane] > skip:
      durations.setdefault(key, []).append(seconds)
  return durations


def reprice_from_trace(
  profile: Profile, durations: Mapping[tuple[Any, str], Sequence[float]]
) -> Profile:
  """`profile` (one table) with each task's cost the mean of its durations in a real
  run (`trace_durations`), its `min` and `p90` theirs: what the run's tasks took as
  they ran there, load and neighbours included. A task the run did not time keeps its
  measured cost; a `kind` key (the stages without a key of their own) takes the mean
  over those stages' tasks of that kind. Its `statistic`
  says so (`REPRICED`), so that `merge` refuses to mix it with measured tables.

  The virtual clock given it replays the run's task costs: the idea of
  `benchmarks/simulator_accuracy.py`'s "repriced" column (docs/simulator.md). Speed
  factors the simulation applies to lanes (`cost.speeds`, LPP-SGD's workers sharing a
  device) scale these costs again, and an in-process run's folded backward-and-update
  of PD-ASGD and LPP-SGD is timed as one backward.
  """
  if len(profile.tables) != 1:
    have = '; '.join(f'split={list(map(list, t.split))} tasks={t.tasks!r}' for t in profile.tables)
    raise ProfileError(
      f"cost.profile: re-pricing needs a profile of one table (the run's); this one "
      f"has {len(profile.tables)}: {have}. Measure one for the run's config."
    )
  (table,) = profile.tables
  if not any(timed_durations(table, key, durations) for key in table.costs):
    raise ProfileError(
      f"cost.profile: the run timed none of the profile's tasks "
      f'({", ".join(map(key_text, table.costs))}); it timed '
      f'{", ".join(sorted(map(key_text, durations))) or "none (skip larger than its lanes ran?)"}.'
    )
  repriced = repriced_table(table, durations)
  return dataclasses.replace(
    profile,
    tables=(repriced,),
    statistic=REPRICED,  # so that `merge` never mixes it with measured tables
    clock='wall',
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
  )


def timed_durations(table: Table, key, durations: Mapping[tuple[Any, str], Sequence[float]]):
  """The durations (`trace_durations`) that task `key` of `table` costs: its own, or for a
  `kind` key those of the stages without a key of their own (`CostModel.compute` looks
  those up first)."""
  if isinstance(key, tuple):
    return list(durations.get(key, ()))
  return [
    d
    for (stage, kind), ds in durations.items()
    if kind == key and (stage, kind) not in table.costs
    for d in ds
  ]


def repriced_table(table: Table, durations: Mapping[tuple[Any, str], Sequence[float]]) -> Table:
  """`table` with every task the durations time costing their mean, its spread
  (`min`, `p90`) theirs; the others keep their cost and spread (`reprice_from_trace`)."""
  costs, spread = dict(table.costs), dict(table.spread)
  for key in table.costs:
    found = timed_durations(table, key, durations)
    if found:
      costs[key] = float(np.mean(found))
      spread[key] = spread_of(found)
  return dataclasses.replace(table, costs=costs, spread=spread)


def pilot_config(run: str) -> dict:
  """The config of the run at `run` (its summary.json)."""
  try:
    with open(os.path.join(run, 'summary.json')) as f:
      return json.load(f)['config']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ProfileError(f'--run: {run} has no summary.json of a run ({e!r}).') from None


def check_pilot(config: dict, profile: Profile) -> None:
  """Refuses a run (its config, `pilot_config`) that cannot re-price `profile`, in one
  line naming the field: not on the real clock, emulated tasks, another model or batch
  size, or lanes
  whose simulated speed the virtual clock scales again (LPP-SGD's workers sharing a
  device); warns of an in-process pilot."""
  if config.get('clock') != 'real':
    raise ProfileError(
      f'--run: a run on the {config.get("clock")!r} clock; a pilot runs on the real clock '
      '(--config.clock=real --config.executor=processes).'
    )
  if config.get('executor') == 'emulated':
    raise ProfileError(
      "--run: a run with executor='emulated': its tasks waited their prices, so its trace "
      "holds the prices, not what the tasks took; re-price from executor='processes'."
    )
  model, batch = config.get('model', {}).get('name'), config.get('batch_size')
  if model != profile.model['name'] or batch != profile.batch_size:
    raise ProfileError(
      f'--run: model {model!r}, batch {batch}; the profile is of model '
      f'{profile.model["name"]!r}, batch {profile.batch_size}.'
    )
  algorithm = config.get('algorithm', {})
  if algorithm.get('name') == 'lppsgd' and algorithm.get('workers_per_device', 1) > 1:
    raise ProfileError(
      '--run: LPP-SGD with algorithm.workers_per_device > 1: the virtual clock divides '
      "those workers' speed by it, and the pilot's durations already carry that sharing; "
      're-price from a run with one worker per device.'
    )
  if config.get('executor') != 'processes':
    logging.warning(
      'an in-process pilot: its durations are task costs only with a device per lane (on '
      'one CPU device they are not; docs/simulator.md).'
    )
