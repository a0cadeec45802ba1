r"""How long a 2-process JAX run takes to end after a fault, and what it leaves behind.

    python -m benchmarks.launch_faults              # 3 rounds, ~2 min on a loaded 2-core CPU
    python -m benchmarks.launch_faults --rounds 1

`python -m jaxsgd.launch --processes 2 --devices_per_process 1` runs a loop of
all-reduces (gloo) in both processes. In each case one thing goes wrong while the
peer is blocked in an all-reduce waiting: process 1 or 0 raises, process 1 calls
`sys.exit(3)`, process 1 is SIGKILLed; or the launcher gets Ctrl-C (SIGINT) or
SIGTERM. Measured: seconds from the fault (a timestamp written just before it, or
the signal being sent) to the launcher's exit, the launcher's status, and the
processes still running afterwards (found by a mark in their environment). The
cases run interleaved, `--rounds` times. The contract (jaxsgd.launch): at most 5 s,
nothing left.
"""

import argparse
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

CASES = ('raise p1', 'raise p0', 'exit p1', 'sigkill p1', 'SIGINT', 'SIGTERM')


def worker(mode: str, failing: int, mark: str) -> None:
  """All-reduces forever; process `failing` fails as `mode` says at step 30."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ('d',))
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('d')), np.ones(1, np.float32))
  print('all-reducing', flush=True)
  for step in itertools.count():
    total(x).block_until_ready()
    if jax.process_index() == failing and step == 30:
      time.sleep(0.5)  # The peer is now blocked in the next all-reduce.
      with open(mark + '.failed_at', 'w') as f:
        f.write(repr(time.time()))
      if mode == 'raise':
        raise RuntimeError(f'boom at step {step}')
      if mode == 'exit':
        sys.exit(3)
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.005)


def leftovers(mark: str) -> int:
  """Processes still running with `mark` in their environment."""
  needle, count = f'JAXSGD_BENCH_MARK={mark}\0'.encode(), 0
  for entry in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{entry}/environ', 'rb') as f:
        found = needle in f.read()
      with open(f'/proc/{entry}/stat') as f:
        zombie = f.read().rsplit(')', 1)[1].split()[0] == 'Z'
      count += found and not zombie
    except OSError:
      pass
  return count


def run_case(case: str, tmp: str) -> tuple[float, int, int]:
  """`(seconds from the fault to the launcher's exit, its status, processes left)`."""
  mark = os.path.join(tmp, uuid.uuid4().hex)
  mode, _, who = case.partition(' ')
  failing = int(who[1:]) if who else -1
  env = dict(os.environ, JAXSGD_BENCH_MARK=mark)
  launcher = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'jaxsgd.launch',
      '--processes',
      '2',
      '--devices_per_process',
      '1',
      '--timeout_s',
      '120',
      '--',
      '-m',
      'benchmarks.launch_faults',
      '--worker',
      mode,
      str(failing),
      mark,
    ],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  if case.startswith('SIG'):
    seen = 0
    while seen < 2:  # Both processes are all-reducing.
      seen += 'all-reducing' in launcher.stdout.readline()
    fault = time.time()
    launcher.send_signal(getattr(signal, case))
  launcher.communicate(timeout=180)
  ended = time.time()
  if not case.startswith('SIG'):
    with open(mark + '.failed_at') as f:
      fault = float(f.read())
  return ended - fault, launcher.returncode, leftovers(mark)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--worker', nargs=3, metavar=('MODE', 'FAILING', 'MARK'))
  args = parser.parse_args()
  if args.worker:
    worker(args.worker[0], int(args.worker[1]), args.worker[2])
    return
  results = {case: [] for case in CASES}
  with tempfile.TemporaryDirectory() as tmp:
    for _ in range(args.rounds):
      for case in CASES:  # Interleaved: the machine's load touches every case alike.
        results[case].append(run_case(case, tmp))
  print(f'{"fault":<12} {"status":>6} {"seconds to end (each round)":>30} {"left":>5}')
  for case, rows in results.items():
    seconds = ' '.join(f'{s:5.2f}' for s, _, _ in rows)
    print(f'{case:<12} {rows[0][1]:>6} {seconds:>30} {sum(r[2] for r in rows):>5}')
  worst = max(s for rows in results.values() for s, _, _ in rows)
  left = sum(r[2] for rows in results.values() for r in rows)
  print(
    f'worst time from a fault to the end of the run: {worst:.2f} s (contract: 5 s); '
    f'processes left behind: {left}'
  )


if __name__ == '__main__':
  main()
