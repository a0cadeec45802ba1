r"""An ASGD run on lane processes whose workers are SIGKILLed again and again.

    python -m benchmarks.fault_soak                      # 2,000 steps, a kill every ~10 s
    python -m benchmarks.fault_soak --steps=500 --every=5

`experiments.train`'s ASGD (`--workers`, the MLP on MNIST-1D) with
`executor='processes'` and `tolerate_lost_workers=True` trains `--steps` steps; a thread
of this process SIGKILLs one worker's lane process every `--every` seconds (± 20 %, the
workers in turn), from the lane pids the executor knows. The executor replaces each lost
lane by a new lane process on the same placement, and the worker rejoins: it asks the
server for the current parameters and pushes again.

Measured, per kill (from the run's `summary.json` and `trace.json`, one clock): when the
loss was heard, when the new lane process was up, and the rejoin, the seconds from the
kill to the end of the replacement's first backward (its first push). The run must
complete every step, and lose no applied update: the server's Adam step count (its
optimizer state, read from the final checkpoint) equals the updates it applied. Last line:

    fault soak: <n> kills survived, median rejoin <x> s, updates lost <k>
"""

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time

import numpy as np


def killer(executors: list, every: float, stop: threading.Event, kills: list, workers: int):
  """SIGKILLs worker lanes in turn, every `every` s (± 20 %), until `stop` is set."""
  rng = random.Random(0)
  m = 0
  while not stop.wait(every * rng.uniform(0.8, 1.2)):
    executor = executors[0] if executors else None
    pool = getattr(executor, 'pool', None)
    if pool is None:
      continue
    lane = f'worker{m % workers}'
    try:
      pid = pool.pids()[lane]
    except (KeyError, AttributeError, RuntimeError):  # replaced this instant, or closing
      continue
    kills.append((lane, time.time() - executor._t0))  # pylint: disable=protected-access
    os.kill(pid, signal.SIGKILL)
    m += 1


def first_push_after(trace_events, lane: str, after: float) -> float | None:
  """The end (s) of the first backward on `lane` starting after `after` (s)."""
  names = {e['tid']: e['args']['name'] for e in trace_events if e.get('name') == 'thread_name'}
  tids = [tid for tid, name in names.items() if f'({lane}:' in name and not name.startswith('link')]
  ends = [
    (e['ts'] + e['dur']) / 1e6
    for e in trace_events
    if e.get('ph') == 'X'
    and e['tid'] in tids
    and e['name'].startswith('backward')
    and e['ts'] / 1e6 > after
  ]
  return min(ends) if ends else None


def adam_count(workdir: str) -> int:
  """The server's Adam step count in the run's last checkpoint (its optimizer state)."""
  from jaxsgd.training import checkpoints  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  root = checkpoints.directory(workdir)
  step = max(int(n) for n in os.listdir(root) if n.isdigit())
  tree = ocp.PyTreeCheckpointer().restore(os.path.join(root, str(step), 'state'))
  arrays = [np.asarray(a) for a in tree['arrays'].values()]
  counts = [int(a) for a in arrays if a.shape == () and a.dtype == np.int32]
  return max(counts)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--workers', type=int, default=2)
  parser.add_argument('--every', type=float, default=10.0, help='seconds between kills')
  args = parser.parse_args()

  from experiments.configs import asgd as asgd_config  # pylint: disable=g-import-not-at-top
  from jaxsgd import training  # pylint: disable=g-import-not-at-top
  from jaxsgd.scheduler import process as process_lib  # pylint: disable=g-import-not-at-top

  executors = []
  begin = process_lib.ProcessExecutor.begin

  def noted_begin(self, begin=begin):
    executors.append(self)
    begin(self)

  process_lib.ProcessExecutor.begin = noted_begin
  config = asgd_config.get_config()
  config.clock, config.executor = 'real', 'processes'
  config.workers, config.train_steps = args.workers, args.steps
  config.eval_every = args.steps
  config.tolerate_lost_workers = True
  config.checkpoint_every = args.steps  # the last step's state: the server's Adam count
  config.optimizer.name = 'adam'
  workdir = tempfile.mkdtemp(prefix='fault-soak-')
  stop, kills = threading.Event(), []
  thread = threading.Thread(
    target=killer, args=(executors, args.every, stop, kills, args.workers), daemon=True
  )
  print(
    f'machine: {os.cpu_count()} CPU cores; ASGD M={args.workers} on lane processes, '
    f'{args.steps} steps, a worker SIGKILLed every ~{args.every:g} s; workdir {workdir}',
    flush=True,
  )
  started = time.time()
  thread.start()
  try:
    summary = training.train_and_evaluate(config, workdir, show_progress=False)
  finally:
    stop.set()
  wall = time.time() - started
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)['traceEvents']
  lost = summary.get('lost_lanes', [])
  print(
    f'\n{"lane":8s} {"killed s":>9s} {"heard s":>8s} {"new lane up s":>14s} {"first push s":>13s} {"rejoin s":>9s}'
  )
  rejoins = []
  for (lane, killed_at), loss in zip(kills, lost):
    push = first_push_after(events, lane, loss['replaced_at'] or loss['at'])
    rejoin = None if push is None else push - killed_at
    if rejoin is not None:
      rejoins.append(rejoin)
    print(
      f'{lane:8s} {killed_at:9.2f} {loss["at"]:8.2f} {loss["replaced_at"] or float("nan"):14.2f} '
      f'{push if push is not None else float("nan"):13.2f} '
      f'{rejoin if rejoin is not None else float("nan"):9.2f}'
    )
  applied = summary['final']['step']
  count = adam_count(workdir)
  print(
    f'\nsteps {applied} of {args.steps}; kills {len(kills)}, losses heard {len(lost)}, '
    f"replaced {sum(1 for x in lost if x['replaced_at'] is not None)}; the server's Adam "
    f'count {count} (updates applied {applied}); pushes {summary.get("pushes_per_worker")}; '
    f'{wall:.0f} s'
  )
  survived = sum(1 for x in lost if x['replaced_at'] is not None) if applied == args.steps else 0
  median = float(np.median(rejoins)) if rejoins else float('nan')
  print(
    f'fault soak: {survived} kills survived, median rejoin {median:.2f} s, updates lost {abs(applied - count)}'
  )


if __name__ == '__main__':
  main()
