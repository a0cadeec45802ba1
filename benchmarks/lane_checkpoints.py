r"""How long a checkpoint holds a run on lane processes (DDG K=2).

    python -m benchmarks.lane_checkpoints              # 2 rounds, ~1 min
    python -m benchmarks.lane_checkpoints --rounds=3 --every=5

The smoke config's DDG with 2 stages on lane processes (`executor='processes'`),
`--steps` steps, run with `checkpoint_every=--every` and without, interleaved, `--rounds`
times. A checkpoint holds the run from the start of its drain (every dispatched task
finished, every copy landed) until the driver goes on (each lane's values exported, the
state written by orbax): `summary.json`'s `checkpoint_pauses_ms`. The first save of a run
also creates orbax's folders. Last line:

    lane checkpoints: median pause <x> ms per save (DDG K=2, lane processes)
"""

import argparse
import os
import shutil
import tempfile

import numpy as np


def one_run(every: int, steps: int, root: str) -> dict:
  from experiments.configs import default  # pylint: disable=g-import-not-at-top
  from jaxsgd import training  # pylint: disable=g-import-not-at-top

  config = default.get_config('smoke')
  config.clock, config.executor = 'real', 'processes'
  config.algorithm, config.stages = default.algorithm('ddg'), 2
  config.train_steps, config.checkpoint_every = steps, every
  workdir = os.path.join(root, f'every{every}')
  shutil.rmtree(workdir, ignore_errors=True)
  summary = training.train_and_evaluate(config, workdir, show_progress=False)
  return {'wall': summary['final']['wall_time'], 'pauses': summary.get('checkpoint_pauses_ms', [])}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--every', type=int, default=10)
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix='lane-checkpoints-')
  print(
    f'machine: {os.cpu_count()} CPU cores; DDG K=2 on lane processes, {args.steps} steps',
    flush=True,
  )
  rows, pauses = [], []
  for r in range(args.rounds):
    for every in (0, args.every):
      result = one_run(every, args.steps, root)
      later = result['pauses'][1:]  # the first save also creates orbax's folders
      pauses += later
      rows.append((r, every, result['wall'], result['pauses']))
  print(f'\n{"round":>5s} {"checkpoint_every":>16s} {"wall s":>7s}  pauses ms (each save)')
  for r, every, wall, each in rows:
    print(f'{r:5d} {every:16d} {wall:7.1f}  {each}')
  median = float(np.median(pauses)) if pauses else float('nan')
  print(f'lane checkpoints: median pause {median:.0f} ms per save (DDG K=2, lane processes)')


if __name__ == '__main__':
  main()
