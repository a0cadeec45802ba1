r"""What the lanes' figures need real parallel hardware for, as one command that fits a
short loan of a machine with many cores and a GPU.

    make device-wheels                          # here, once: Ray for a machine without it
    python -m benchmarks.device_round --plan    # the steps, their commands and budgets
    # on that machine, in the repository's root, with `.whl` copied there:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site:. python3 -m benchmarks.device_round --out "$OUT"

The checks that only such a machine can make are these steps, in order, each a
benchmark of this folder in a process of its own:

  ddg_k8       `real_speedup --lanes 8` on a 16-layer model: DDG K=8 on eight cores
               against BP on one (lane processes; the goal is 0.9 K)
  ddg_k4       the same at K=4
  k2_gpu       `real_speedup --gpu` with DDG and PD-ASGD: K=2 where cores are to spare
               (the driver placed by load on a free one), then DDG K=2 with both stages on
               the GPU (device path, and host path) and with one on it, one on a core
  device_path  `device_path --gpu`: a move between two GPU lanes, device path against host
  ceilings     `neighbour_contention --stages` on the same model: its K=4 and K=8 stages
               computing at once with no executor, the ceiling those cores give

Each step's output goes to `OUT/<step>.txt` as it prints, and its last lines to the
terminal. A step is given its budget (stopped past it: Ctrl-C to its process group, so
that its lanes and Ray cluster end, and the group killed `STOP_GRACE` seconds later, or
at once when the step has ended: up to ~25 s past its budget), and starts only if its
budget fits in what is left of `--budget` (by default every step's, and room for one
stop); one that fails or is stopped does not stop the round, and Ctrl-C or SIGTERM to
the round stops the step it runs. The driver of each step runs JAX on the CPU
(`JAX_PLATFORMS=cpu`, unless set): its GPU lanes take the GPU.

`make device-wheels` (`--wheels DIR`) downloads, for Python `DEVICE_PYTHON`, what a
machine with JAX but without Ray lacks for these steps: Ray at the version installed here
and the packages of Ray's (`WHEELS`) that such an image may not have; Ray's wheel
without its Java jars, which lanes do not use (~32 of its ~79 MB), so that it travels
with the tree where what travels is limited.
The last line: `device round: <n> of <m> steps ran to the end in <s> s`.
Not a test: speed is measured, not asserted.
"""

import argparse
import contextlib
import dataclasses
import math
import importlib.metadata
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import zipfile

from benchmarks import common as bench_common

# `real_speedup`'s model for K = 4 and 8: 16 hidden layers cut into equal stages.
DEEP = ('--depth', '16', '--features', '1024', '--batch', '256', '--warmup', '4')


@dataclasses.dataclass(frozen=True)
class Step:
  """A benchmark run: `python <argv>`, stopped after `budget` seconds."""

  name: str
  argv: tuple[str, ...]
  budget: float


STEPS = (
  Step(
    'ddg_k8',
    ('-m', 'benchmarks.real_speedup', '--lanes', '8', *DEEP, '--steps', '32', '--rounds', '3')
    + ('--families', 'ddg'),
    120,
  ),
  Step(
    'ddg_k4',
    ('-m', 'benchmarks.real_speedup', '--lanes', '4', *DEEP, '--steps', '28', '--rounds', '3')
    + ('--families', 'ddg'),
    100,
  ),
  Step(
    'k2_gpu',
    ('-m', 'benchmarks.real_speedup', '--rounds', '3', '--families', 'ddg,pdasgd', '--gpu'),
    150,
  ),
  Step('device_path', ('-m', 'benchmarks.device_path', '--gpu', '--rounds', '3'), 80),
  Step(
    'ceilings',
    ('-m', 'benchmarks.neighbour_contention', '--stages', '--counts', '1,4,8', '--reps', '15')
    + ('--depth', '16', '--features', '1024', '--batch', '256'),
    60,
  ),
)
BUDGET = 540.0  # seconds for the round: every step's budget (510) and a stop's overrun
STOP_GRACE = 20.0  # seconds a stopped step has to end its lanes and cluster before a kill
TAIL = 3  # last lines of a step's output shown on the terminal


@dataclasses.dataclass
class Outcome:
  status: str  # 'ran', 'failed (exit N)', 'stopped after N s', 'skipped (budget)'
  seconds: float = 0.0
  last_line: str = ''


def run_step(step: Step, out: pathlib.Path, budget: float, env: dict) -> Outcome:
  """Runs `step` in a process group of its own, its output written to `out/<name>.txt`;
  stops it after `budget` seconds (`_stop`). Whatever of its group is left when it ends
  (a child it did not wait for) is killed, and so is the step if the round is stopped."""
  began = time.monotonic()
  with open(out / f'{step.name}.txt', 'w') as log:
    log.write(f'# {" ".join(["python", *step.argv])}\n')
    log.flush()
    process = subprocess.Popen(
      [sys.executable, *step.argv],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors='replace',
      env=env,
      start_new_session=True,  # (its group: a stop reaches its lanes and Ray too)
    )
    lines: list[str] = []
    reader = threading.Thread(target=_copy_lines, args=(process.stdout, log, lines), daemon=True)
    reader.start()
    stopped = False
    try:
      process.wait(timeout=budget)
    except subprocess.TimeoutExpired:
      stopped = True
      _stop(process)
    except BaseException:  # the round stopped (Ctrl-C, SIGTERM): its step with it
      _stop(process)
      raise
    finally:
      _kill_group(process.pid)
    reader.join(timeout=5)
  seconds = time.monotonic() - began
  shown = [line.rstrip() for line in lines if line.strip()]
  for line in shown[-TAIL:]:
    print(f'  | {line}')
  last = shown[-1].strip() if shown else ''
  if stopped:
    return Outcome(f'stopped after {budget:.0f} s', seconds, last)
  if process.returncode:
    return Outcome(f'failed (exit {process.returncode})', seconds, last)
  return Outcome('ran', seconds, last)


def _copy_lines(stream, log, lines: list) -> None:
  for line in stream:
    lines.append(line)
    if not log.closed:  # (a child left running may print after its step's end)
      log.write(line)
      log.flush()


def _stop(process: subprocess.Popen) -> None:
  """SIGINT to the step's group (a benchmark's `with` blocks end its lanes and cluster),
  then, `STOP_GRACE` seconds later or once the step has ended, SIGKILL to the group."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(process.pid, signal.SIGINT)
  with contextlib.suppress(subprocess.TimeoutExpired):
    process.wait(timeout=STOP_GRACE)
  _kill_group(process.pid)
  with contextlib.suppress(subprocess.TimeoutExpired):
    process.wait(timeout=5.0)


def _kill_group(group: int) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(group, signal.SIGKILL)


def run_round(steps, out: pathlib.Path, budget: float, env: dict | None = None) -> dict:
  """Runs `steps` in order within `budget` seconds in all (a step whose own budget does
  not fit in what is left is skipped, and the next tried); `{name: Outcome}`."""
  out.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ if env is None else env)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env['PYTHONUNBUFFERED'] = '1'
  deadline, outcomes = time.monotonic() + budget, {}
  for step in steps:
    left = deadline - time.monotonic()
    if step.budget > left:
      print(f'{step.name}: skipped, its {step.budget:.0f} s do not fit in the {left:.0f} s left')
      outcomes[step.name] = Outcome('skipped (budget)')
      continue
    print(f'{step.name}: python {" ".join(step.argv)}', flush=True)
    outcomes[step.name] = run_step(step, out, step.budget, env)
  return outcomes


def machine_line() -> str:
  """The cores, the CPU's model, the GPUs and the versions the steps run with."""
  model = ''
  try:
    with open('/proc/cpuinfo') as cpuinfo:
      model = next((ln.split(':', 1)[1].strip() for ln in cpuinfo if 'model name' in ln), '')
  except OSError:
    pass
  try:
    gpus = subprocess.run(
      ['nvidia-smi', '-L'], capture_output=True, text=True, timeout=20
    ).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    gpus = ''
  versions = ', '.join(f'{name} {_version(name)}' for name in ('jax', 'ray', 'flax', 'optax'))
  return (
    f'machine: {os.cpu_count()} CPU cores ({model or "model unknown"}); '
    f'GPUs: {gpus.replace(chr(10), "; ") or "none found"}; Python {sys.version.split()[0]}; '
    f'{versions}'
  )


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return 'missing'


# Ray's needs that a machine with JAX and its usual packages may lack (Ray itself is added at
# the version installed here).
WHEELS = ('jsonschema', 'jsonschema-specifications', 'referencing', 'rpds-py')
DEVICE_PYTHON = '3.12'
PLATFORMS = ('manylinux2014_x86_64', 'manylinux_2_17_x86_64', 'manylinux_2_28_x86_64')


def download_wheels(folder: pathlib.Path) -> list[pathlib.Path]:
  """The wheels for the lent machine in `folder` (its older wheels of these packages
  removed first), Ray's without its Java jars (`without_jars`); raises `ValueError` if
  Ray is not installed here (its version is the one downloaded) or pip fails."""
  ray = _version('ray')
  if ray == 'missing':
    raise ValueError('Ray is not installed here: its version is the one to download')
  folder.mkdir(parents=True, exist_ok=True)
  for name in ('ray', *WHEELS):
    for old in folder.glob(f'{name.replace("-", "_")}-*.whl'):
      old.unlink()
  platforms = [arg for platform in PLATFORMS for arg in ('--platform', platform)]
  command = [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps']
  command += ['--only-binary=:all:', '--python-version', DEVICE_PYTHON, '--implementation']
  command += ['cp', *platforms, '-d', str(folder), f'ray=={ray}', *WHEELS]
  if subprocess.run(command).returncode:
    raise ValueError(f'pip could not download ray=={ray} and {", ".join(WHEELS)} (above)')
  for wheel in folder.glob('ray-*.whl'):
    without_jars(wheel)
  return sorted(folder.glob('*.whl'))


def without_jars(wheel: pathlib.Path) -> None:
  """Rewrites Ray's `wheel` without `ray/jars/` (Ray's Java workers: ~32 of its ~79 MB)
  and without their lines in its RECORD (the files it lists)."""
  kept = wheel.with_suffix('.tmp')
  try:
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(kept, 'w', zipfile.ZIP_DEFLATED) as out:
      for item in source.infolist():
        if item.filename.startswith('ray/jars/'):
          continue
        data = source.read(item)
        if item.filename.endswith('.dist-info/RECORD'):
          lines = data.decode().splitlines(keepends=True)
          data = ''.join(ln for ln in lines if not ln.startswith('ray/jars/')).encode()
        out.writestr(item, data)
    kept.replace(wheel)
  finally:
    kept.unlink(missing_ok=True)


def print_outcomes(outcomes: dict, seconds: float) -> None:
  rows = [(name, o.status, f'{o.seconds:.1f}', o.last_line) for name, o in outcomes.items()]
  bench_common.print_table(('step', 'status', 'seconds', 'last line'), rows)
  ran = sum(outcome.status == 'ran' for outcome in outcomes.values())
  print(f'device round: {ran} of {len(outcomes)} steps ran to the end in {seconds:.0f} s')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.environ.get('OUT', 'runs/device_round'))
  parser.add_argument('--budget', type=float, default=BUDGET, help='seconds for every step')
  names = ', '.join(step.name for step in STEPS)
  parser.add_argument('--only', default='', help=f'comma-separated steps, of {names}')
  parser.add_argument('--plan', action='store_true', help='print the steps and exit')
  parser.add_argument('--wheels', default='', help="download the machine's wheels here, exit")
  args = parser.parse_args(argv)
  wanted = [name.strip() for name in args.only.split(',') if name.strip()]
  unknown = sorted(set(wanted) - {step.name for step in STEPS})
  if unknown:
    parser.error(f'--only: steps of {names}; got {", ".join(unknown)}')
  if not (math.isfinite(args.budget) and args.budget > 0):
    parser.error(f'--budget: seconds, a number more than 0; got {args.budget}')
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    parser.error(f"--out: a folder for the steps' outputs; {args.out!r} is a file")
  steps = [step for step in STEPS if not wanted or step.name in wanted]
  if args.wheels:
    try:
      wheels = download_wheels(pathlib.Path(args.wheels))
    except ValueError as error:
      parser.error(f'--wheels: {error}')
    for wheel in wheels:
      print(f'{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel}')
    return
  if args.plan:
    for step in steps:
      print(f'{step.name:<12} {step.budget:4.0f} s  python {" ".join(step.argv)}')
    print(f'{sum(step.budget for step in steps):.0f} s of budgets; --budget {args.budget:.0f} s')
    return
  signal.signal(signal.SIGTERM, _exit_on_sigterm)  # (a step running is stopped: `run_step`)
  print(machine_line(), flush=True)
  began = time.monotonic()
  outcomes = run_round(steps, pathlib.Path(args.out), args.budget)
  print_outcomes(outcomes, time.monotonic() - began)


def _exit_on_sigterm(signum, frame) -> None:
  del frame
  sys.exit(128 + signum)


if __name__ == '__main__':
  main()
