r"""What the lanes' figures need real parallel hardware for, as one command that fits a
short loan of a machine with many cores and a GPU.

    make device-wheels                          # here, once: what the machine's image lacks
    python -m benchmarks.device_round --plan    # the steps, their commands and budgets
    # on the lent machine, in the repository's root, `.whl` carried:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site:. python3 -m benchmarks.device_round --out "$OUT"

A lent machine comes bare and for minutes; the checks that only it can make are these
steps, in order, each a benchmark of this folder in a process of its own:

  ddg_k8       `real_speedup --lanes 8` on a 16-layer model: DDG K=8 on eight cores
               against BP on one (lane processes; the goal is 0.9 K)
  ddg_k4       the same at K=4
  ceilings     `neighbour_contention --stages` on the same model: its K=4 and K=8 stages
               computing at once with no executor, the ceiling those cores give
  k2_gpu       `real_speedup --gpu` with DDG and PD-ASGD: K=2 where cores are to spare
               (the driver placed by load on a free one), then DDG K=2 with both stages on
               the GPU (device path, and host path) and with one on it, one on a core
  device_path  `device_path --gpu`: a move between two GPU lanes, device path against host

Each step's output goes to `OUT/<step>.txt` as it prints, and its last lines to the
terminal. A step is given its budget (stopped past it: Ctrl-C, so that its lanes and
Ray cluster end, then killed), and starts only if its budget fits in what is left of
`--budget`; one that fails or is stopped does not stop the round. The driver of each
step runs JAX on the CPU (`JAX_PLATFORMS=cpu`, unless set): its GPU lanes take the GPU.

`make device-wheels` (`--wheels DIR`) downloads what the image of the machines lent to
this project lacks for these steps (Ray, at the version installed here, and the packages
of Ray's that the image has not), for its Python, 3.12: Ray's wheel without its Java
jars, which lanes do not use and which would not fit in what may travel with the tree.
The last line: `device round: <n> of <m> steps ran to the end in <s> s`.
Not a test: speed is measured, not asserted.
"""

import argparse
import dataclasses
import importlib.metadata
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import zipfile

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
    'ceilings',
    ('-m', 'benchmarks.neighbour_contention', '--stages', '--counts', '1,4,8', '--reps', '15')
    + ('--depth', '16', '--features', '1024', '--batch', '256'),
    90,
  ),
  Step(
    'k2_gpu',
    ('-m', 'benchmarks.real_speedup', '--rounds', '3', '--families', 'ddg,pdasgd', '--gpu'),
    180,
  ),
  Step('device_path', ('-m', 'benchmarks.device_path', '--gpu', '--rounds', '3'), 90),
)
STOP_GRACE = 20.0  # seconds a stopped step has to end its lanes and cluster before a kill
TAIL = 3  # last lines of a step's output shown on the terminal


@dataclasses.dataclass
class Outcome:
  status: str  # 'ran', 'failed (exit N)', 'stopped after N s', 'skipped (budget)'
  seconds: float = 0.0
  last_line: str = ''


def run_step(step: Step, out: pathlib.Path, budget: float, env: dict) -> Outcome:
  """Runs `step` with its output written to `out/<name>.txt`; stops it after `budget`
  seconds: SIGINT to its process group (a benchmark's `with` blocks end its lanes and its
  cluster), and SIGKILL if it has not ended `STOP_GRACE` seconds later."""
  began = time.monotonic()
  with open(out / f'{step.name}.txt', 'w') as log:
    log.write(f'# {" ".join(["python", *step.argv])}\n')
    log.flush()
    process = subprocess.Popen(
      [sys.executable, *step.argv],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
      start_new_session=True,  # (its group: a stop reaches its lanes and Ray too)
    )
    lines: list[str] = []
    reader = threading.Thread(target=_copy_lines, args=(process.stdout, log, lines), daemon=True)
    reader.start()
    try:
      process.wait(timeout=budget)
      stopped = False
    except subprocess.TimeoutExpired:
      stopped = True
      _stop(process)
    reader.join(timeout=5)
  seconds = time.monotonic() - began
  last = lines[-1].strip() if lines else ''
  for line in lines[-TAIL:]:
    print(f'  | {line.rstrip()}')
  if stopped:
    return Outcome(f'stopped after {budget:.0f} s', seconds, last)
  if process.returncode:
    return Outcome(f'failed (exit {process.returncode})', seconds, last)
  return Outcome('ran', seconds, last)


def _copy_lines(stream, log, lines: list) -> None:
  for line in stream:
    log.write(line)
    log.flush()
    lines.append(line)


def _stop(process: subprocess.Popen) -> None:
  for sig, grace in ((signal.SIGINT, STOP_GRACE), (signal.SIGKILL, 5.0)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(timeout=grace)
      return
    except subprocess.TimeoutExpired:
      continue


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


# What the steps import that the lent machines' image lacks: Ray, and Ray's needs that are
# not in the image (docs of the device tool list the image's packages).
WHEELS = ('jsonschema', 'jsonschema-specifications', 'referencing', 'rpds-py')
DEVICE_PYTHON = '3.12'
PLATFORMS = ('manylinux2014_x86_64', 'manylinux_2_17_x86_64', 'manylinux_2_28_x86_64')


def download_wheels(folder: pathlib.Path) -> list[pathlib.Path]:
  """The wheels for the lent machine in `folder` (emptied of wheels first), Ray's without
  its Java jars (`without_jars`)."""
  folder.mkdir(parents=True, exist_ok=True)
  for old in folder.glob('*.whl'):
    old.unlink()
  platforms = [arg for platform in PLATFORMS for arg in ('--platform', platform)]
  subprocess.run(
    [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary=:all:']
    + ['--python-version', DEVICE_PYTHON, '--implementation', 'cp', *platforms, '-d', str(folder)]
    + [f'ray=={_version("ray")}', *WHEELS],
    check=True,
  )
  for wheel in folder.glob('ray-*.whl'):
    without_jars(wheel)
  return sorted(folder.glob('*.whl'))


def without_jars(wheel: pathlib.Path) -> None:
  """Rewrites Ray's `wheel` without `ray/jars/` (Ray's Java workers: ~32 of its ~79 MB)
  and without their lines in its RECORD, which pip checks against the files."""
  kept = wheel.with_suffix('.tmp')
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


def print_outcomes(outcomes: dict, seconds: float) -> None:
  width = max(len(name) for name in outcomes)
  print(f'{"step".ljust(width)}  {"status":<20}  {"seconds":>7}  last line')
  for name, outcome in outcomes.items():
    print(f'{name.ljust(width)}  {outcome.status:<20}  {outcome.seconds:7.1f}  {outcome.last_line}')
  ran = sum(outcome.status == 'ran' for outcome in outcomes.values())
  print(f'device round: {ran} of {len(outcomes)} steps ran to the end in {seconds:.0f} s')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.environ.get('OUT', 'runs/device_round'))
  parser.add_argument('--budget', type=float, default=480.0, help='seconds for every step')
  names = ', '.join(step.name for step in STEPS)
  parser.add_argument('--only', default='', help=f'comma-separated steps, of {names}')
  parser.add_argument('--plan', action='store_true', help='print the steps and exit')
  parser.add_argument('--wheels', default='', help="download the machine's wheels here, exit")
  args = parser.parse_args(argv)
  wanted = [name.strip() for name in args.only.split(',') if name.strip()]
  unknown = sorted(set(wanted) - {step.name for step in STEPS})
  if unknown:
    parser.error(f'--only: steps of {names}; got {", ".join(unknown)}')
  if args.budget <= 0:
    parser.error(f'--budget: seconds, more than 0; got {args.budget}')
  steps = [step for step in STEPS if not wanted or step.name in wanted]
  if args.wheels:
    for wheel in download_wheels(pathlib.Path(args.wheels)):
      print(f'{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel}')
    return
  if args.plan:
    for step in steps:
      print(f'{step.name:<12} {step.budget:4.0f} s  python {" ".join(step.argv)}')
    print(f'{sum(step.budget for step in steps):.0f} s of budgets; --budget {args.budget:.0f} s')
    return
  print(machine_line(), flush=True)
  began = time.monotonic()
  outcomes = run_round(steps, pathlib.Path(args.out), args.budget)
  print_outcomes(outcomes, time.monotonic() - began)


if __name__ == '__main__':
  main()
