r"""Starts a multi-process JAX run on this machine: `python -m jaxsgd.launch`.

    python -m jaxsgd.launch --processes 2 --devices_per_process 2 -- \
        --config=experiments/configs/dasgd.py --workdir=/tmp/dasgd

starts 2 processes of `experiments.train` (the arguments after `--`), each with 2
CPU devices, joined into one JAX cluster (coordinator on a free local port, gloo
collectives). What follows `--` is either

* flags for `experiments.train` (it starts with `-`), or
* `-m MODULE ARGS...`: any module, run after joining the cluster, or
* any other command, run as is (`python` meaning this interpreter): it must join
  the cluster itself, with
  `jaxsgd.spmd.initialize_from_env()`, before its first JAX operation.

Each process gets `JAXSGD_COORDINATOR_ADDRESS`, `JAXSGD_NUM_PROCESSES`,
`JAXSGD_PROCESS_ID`, `JAXSGD_INIT_TIMEOUT` (and, with `--devices_per_process D`,
`XLA_FLAGS=--xla_force_host_platform_device_count=D`, `JAX_PLATFORMS=cpu`). Their
output is forwarded line by line, prefixed `[p<id>]` (progress-bar redraws at most
every 10 s). When a process fails, the others get SIGTERM, then SIGKILL
after `--grace_s` (JAX handles SIGTERM itself and may not exit); the launcher
exits with the failed process's status. Across hosts, run the same command on every
host with `--coordinator HOST0:PORT --num_processes TOTAL --first_process_id K`.
"""

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxsgd.spmd import distributed

TRAIN_MODULE = 'experiments.train'
_DEVICE_FLAG = re.compile(r'--xla_force_host_platform_device_count=\S+')
_PR_SET_PDEATHSIG = 1
PROGRESS_EVERY_S = 10.0  # Progress-bar redraws forwarded at most this often.


def free_port() -> int:
  """A TCP port that is free now on this host (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('', 0))
    return s.getsockname()[1]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """Splits `argv` at `--` into the launcher's options and the command."""
  if '--' not in argv:
    raise SystemExit('usage: python -m jaxsgd.launch --processes N [options] -- '
                     'COMMAND_OR_TRAIN_FLAGS (the "--" is required)')
  cut = argv.index('--')
  parser = argparse.ArgumentParser(prog='python -m jaxsgd.launch',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--processes', type=int, required=True,
                      help='processes to start on this host')
  parser.add_argument('--devices_per_process', type=int, default=None,
                      help='fake CPU devices per process (sets XLA_FLAGS, JAX_PLATFORMS=cpu)')
  parser.add_argument('--coordinator', default=None,
                      help='HOST:PORT of process 0 (default: this host, a free port)')
  parser.add_argument('--num_processes', type=int, default=None,
                      help='processes in the whole cluster (default: --processes)')
  parser.add_argument('--first_process_id', type=int, default=0,
                      help='id of the first process started here (other hosts: > 0)')
  parser.add_argument('--init_timeout_s', type=int, default=distributed.DEFAULT_TIMEOUT_S,
                      help='seconds to wait for the cluster to form')
  parser.add_argument('--grace_s', type=float, default=5.0,
                      help='seconds between SIGTERM and SIGKILL when stopping')
  parser.add_argument('--timeout_s', type=float, default=None,
                      help='stop everything after this many seconds (exit 124)')
  args = parser.parse_args(argv[:cut])
  _check_args(parser, args)
  command = argv[cut + 1:]
  if not command:
    parser.error('nothing to run after "--"')
  return args, command


def _check_args(parser, args) -> None:
  if args.processes < 1:
    parser.error(f'--processes: must be >= 1, got {args.processes}')
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error(f'--devices_per_process: must be >= 1, got {args.devices_per_process}')
  total = args.num_processes or args.processes
  if not 0 <= args.first_process_id <= total - args.processes:
    parser.error(f'--first_process_id: {args.first_process_id} + --processes '
                 f'{args.processes} exceeds --num_processes {total}')
  if args.first_process_id > 0 and args.coordinator is None:
    parser.error('--coordinator: needed when process 0 runs on another host '
                 '(--first_process_id > 0)')


def child_command(command: list[str]) -> list[str]:
  """The command each process runs (see the module docstring)."""
  bootstrap = [sys.executable, '-u', '-m', 'jaxsgd.spmd.bootstrap']
  if command[0] == '-m' and len(command) > 1:
    return bootstrap + command[1:]
  if command[0].startswith('-'):
    return bootstrap + [TRAIN_MODULE] + command
  if command[0] in ('python', 'python3'):  # This interpreter (and its virtualenv).
    return [sys.executable] + command[1:]
  return command


def child_env(args, process_id: int, coordinator: str) -> dict[str, str]:
  env = dict(os.environ)
  env.update({distributed.ADDRESS_VAR: coordinator,
              distributed.NUM_PROCESSES_VAR: str(args.num_processes or args.processes),
              distributed.PROCESS_ID_VAR: str(process_id),
              distributed.TIMEOUT_VAR: str(args.init_timeout_s),
              'PYTHONUNBUFFERED': '1'})
  if args.devices_per_process is not None:
    flags = _DEVICE_FLAG.sub('', env.get('XLA_FLAGS', '')).split()
    flags.append(f'--xla_force_host_platform_device_count={args.devices_per_process}')
    env['XLA_FLAGS'] = ' '.join(flags)
    env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _die_with_launcher() -> None:
  """In the child, before exec: get SIGKILL if the launcher dies (Linux prctl).

  Covers the one case `stop_all` cannot: the launcher itself being SIGKILLed (e.g.
  by a test's timeout), which would otherwise orphan the processes.
  """
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # Not Linux: stop_all still covers normal exits.
    pass


def _forward(stream, prefix: str, lock: threading.Lock, out,
             progress_every_s: float = PROGRESS_EVERY_S) -> None:
  """Copies `stream` to `out` line by line, each line prefixed with the process id.

  Segments ended by `\r` (progress-bar redraws) are forwarded at most once every
  `progress_every_s` seconds, each as a line of its own.
  """
  buffer, last_progress = b'', -progress_every_s
  for chunk in iter(lambda: stream.read1(1 << 16), b''):
    buffer += chunk
    for segment, is_redraw in _segments(buffer):
      if is_redraw:
        if not segment.strip() or time.monotonic() - last_progress < progress_every_s:
          continue
        last_progress = time.monotonic()
      _emit(out, lock, prefix, segment)
    buffer = buffer[max(buffer.rfind(b'\n'), buffer.rfind(b'\r')) + 1:]
  if buffer.strip():
    _emit(out, lock, prefix, buffer.decode(errors='replace'))
  stream.close()


def _segments(buffer: bytes):
  """`(text, ended_by_carriage_return)` for each complete segment of `buffer`."""
  for piece in re.finditer(rb'([^\r\n]*)([\r\n])', buffer):
    yield piece.group(1).decode(errors='replace'), piece.group(2) == b'\r'


def _emit(out, lock, prefix, text) -> None:
  with lock:
    out.write(f'{prefix}{text}\n')
    out.flush()


class _Stop(Exception):
  """The launcher itself was asked to stop (SIGTERM, SIGHUP)."""


def _raise_stop(signum, frame):
  del frame
  raise _Stop(signum)


def stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM every running process group, then SIGKILL what is left after `grace_s`."""
  _signal_all(procs, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.05)
  _signal_all(procs, signal.SIGKILL)
  for p in procs:
    p.wait()


def _signal_all(procs, sig) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, sig)  # Each child leads its own session (start_new_session).
      except ProcessLookupError:
        pass


def _wait(procs, timeout_s) -> tuple[int, int | None]:
  """Polls until all exit 0, one fails, or time runs out; returns (status, failed id)."""
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  while True:
    codes = [p.poll() for p in procs]
    for k, code in enumerate(codes):
      if code not in (None, 0):
        return (code if code > 0 else 128 - code), k
    if all(code == 0 for code in codes):
      return 0, None
    if deadline is not None and time.monotonic() > deadline:
      return 124, None
    time.sleep(0.05)


def launch(args, command: list[str], out=sys.stdout) -> int:
  """Runs the processes to completion or first failure; returns the exit status."""
  coordinator = args.coordinator or f'127.0.0.1:{free_port()}'
  cmd = child_command(command)
  lock, procs, threads = threading.Lock(), [], []
  previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
  status, failed = 1, None
  try:
    for local in range(args.processes):
      pid = args.first_process_id + local
      procs.append(subprocess.Popen(cmd, env=child_env(args, pid, coordinator),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_launcher))
      thread = threading.Thread(target=_forward, args=(procs[-1].stdout, f'[p{pid}] ',
                                                       lock, out), daemon=True)
      thread.start()
      threads.append(thread)
    status, failed = _wait(procs, args.timeout_s)
  except (KeyboardInterrupt, _Stop):
    status = 130
  finally:
    stop_all(procs, args.grace_s)
    for thread in threads:
      thread.join(timeout=5)
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if failed is not None:
    out.write(f'jaxsgd.launch: process {args.first_process_id + failed} exited with '
              f'status {status}; stopped the others.\n')
  elif status == 124:
    out.write(f'jaxsgd.launch: timed out after {args.timeout_s} s; stopped all processes.\n')
  return status


def main(argv=None) -> int:
  args, command = parse_args(sys.argv[1:] if argv is None else argv)
  return launch(args, command)


if __name__ == '__main__':
  sys.exit(main())
