r"""Re-prices a cost profile from a pilot run's trace: each task costs what it took there.

    python -m experiments.profile --config=experiments/configs/ddg.py --out=/tmp/ddg.json
    python -m experiments.train --config=experiments/configs/ddg.py --workdir=/tmp/pilot \
        --config.clock=real --config.executor=processes --config.train_steps=100
    python -m experiments.reprice --profile=/tmp/ddg.json --run=/tmp/pilot \
        --out=/tmp/ddg_repriced.json
    python -m experiments.train --config=experiments/configs/ddg.py --workdir=/tmp/sim \
        --config.cost.profile=/tmp/ddg_repriced.json

Reads the pilot run's `trace.json` (the real clock's: on lane processes each lane times
its own tasks) and writes a copy of `--profile` (a profile of the run's config: one
table) whose every task costs the mean of its durations in that run (a run's time is
its tasks' sum), each lane's first `--skip` tasks left out (compiling). The virtual clock given it replays the
machine as the pilot found it — load, neighbours on shared cores, a slow spell — where
a profile measured alone sees a quiet core. `benchmarks/simulator_accuracy.py` measures
the same idea in its "repriced" column (each task kind's mean in a warm-up run on
lanes, over its own steady-state window, simulated with the same host profile of the
process executor as its predicted runs, `cost.host`); its results and their history:
benchmarks/results/simulator_history.md.

The pilot must be a run on the real clock of the profile's model and batch size, best
on lane processes: the in-process real clock with several stages on one CPU device is
no pilot (its trace gave 5–15 µs for tasks that take 0.08–0.5 ms alone). Speed factors
the simulation applies (`cost.speeds`) scale the re-priced costs again, and LPP-SGD runs
with several workers per device are refused as pilots (the virtual clock divides those
workers' speed again). Data-parallel runs write no trace.
"""

import os

from absl import app
from absl import flags

from jaxsgd.scheduler import profiles, repricing

_PROFILE = flags.DEFINE_string('profile', None, "A profile of the run's config (one table).")
_RUN = flags.DEFINE_string('run', None, "The pilot run's workdir (its trace.json).")
_OUT = flags.DEFINE_string('out', None, 'The re-priced profile to write.')
_SKIP = flags.DEFINE_integer('skip', 5, "Tasks left out at the start of each lane's trace.")
_REPLACE = flags.DEFINE_bool('replace', False, 'Overwrite --out if it exists.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  for flag in (_PROFILE, _RUN, _OUT):
    if not flag.value:
      raise SystemExit(f'--{flag.name}: required.')
  if os.path.exists(_OUT.value) and not _REPLACE.value:
    raise SystemExit(f'--out: {_OUT.value} exists; --replace overwrites it.')
  try:
    measured = profiles.load(_PROFILE.value)
    repricing.check_pilot(repricing.pilot_config(_RUN.value), measured)
    durations = repricing.trace_durations(os.path.join(_RUN.value, 'trace.json'), _SKIP.value)
    repriced = repricing.reprice_from_trace(measured, durations)
  except profiles.ProfileError as e:
    raise SystemExit(str(e)) from None
  profiles.save(repriced, _OUT.value)
  before, after = measured.tables[0].costs, repriced.tables[0].costs
  print(f'{"task":<14} {"profile ms":>11} {"run ms":>9} {"tasks":>6}')
  for key in before:
    count = len(repricing.timed_durations(measured.tables[0], key, durations))
    shown = f'{1e3 * after[key]:9.3f}' if count else f'{"(kept)":>9}'
    print(f'{profiles.key_text(key):<14} {1e3 * before[key]:11.3f} {shown} {count:6d}')
  unused = sorted(profiles.key_text(k) for k in durations if k not in before and k[1] not in before)
  if unused:
    print(f'timed in the run, not in the profile (left out): {", ".join(unused)}')
  print(
    f'wrote {_OUT.value}: the costs of {_RUN.value} ({_SKIP.value} first tasks per lane left out)'
  )


if __name__ == '__main__':
  app.run(main)
