r"""Starts a multi-process JAX run on this machine: `python -m jaxsgd.launch`.

    python -m jaxsgd.launch --processes 2 --devices_per_process 2 -- \
        --config=experiments/configs/dasgd.py --workdir=/tmp/dasgd

starts 2 processes of `experiments.train` (the arguments after `--`), each with 2
CPU devices, joined into one JAX cluster (coordinator on a free local port, gloo
collectives). What follows `--` is either

* flags for `experiments.train` (it starts with `-`), or
* `-m MODULE ARGS...` (or `python -m MODULE ARGS...`): any module, run after joining
  the cluster, or
* any other command, run as is (`python` meaning this interpreter): it must join
  the cluster itself, with `jaxsgd.spmd.initialize_from_env()`, before its first
  JAX operation (an uncaught exception then ends it at once; to fail with a status
  of its own, use `jaxsgd.spmd.distributed.exit_now`, not `sys.exit`, which waits
  in JAX's shutdown barrier).

Each process gets `JAXSGD_COORDINATOR_ADDRESS`, `JAXSGD_NUM_PROCESSES`,
`JAXSGD_PROCESS_ID`, `JAXSGD_INIT_TIMEOUT`, `JAXSGD_HEARTBEAT_TIMEOUT`,
`JAXSGD_STATUS_FILE` (and, with `--devices_per_process D`,
`XLA_FLAGS=--xla_force_host_platform_device_count=D`, `JAX_PLATFORMS=cpu`). Their
output is forwarded line by line, prefixed `[p<id>]` (progress-bar redraws at most
every 10 s). Across hosts, run the same command on
every host with `--coordinator HOST0:PORT --num_processes TOTAL --first_process_id K`.

Nothing hangs, nothing is left behind:

* The moment one process ends with a non-zero status (an exception, `sys.exit(3)`,
  a signal), the others are SIGKILLed: they cannot go on without it (their next
  collective would fail, or wait for it), and JAX takes SIGTERM as a
  pre-emption notice, not as a reason to exit. The launcher
  prints one line, e.g. `jaxsgd.launch: process 1 failed (exit status 1):
  RuntimeError: ...; stopped the other 1 process.`, the reason being what the
  process recorded in its status file (`jaxsgd.spmd.distributed.exit_now`).
* Ctrl-C, SIGTERM or SIGHUP to the launcher is passed on to every process; what is
  still running `--grace_s` seconds later (2 by default; at once on a second
  Ctrl-C) is SIGKILLed. So is everything after `--timeout_s` (passing on SIGTERM).
* If the launcher itself is SIGKILLed, the kernel SIGKILLs the processes
  (`PR_SET_PDEATHSIG`). Each process leads its own session, and the whole session is
  signalled, so what a process started goes with it.
* A cluster that does not form within `--init_timeout_s` ends with a line naming
  the process and what it waited for, not a C++ abort.
* A process that stops without exiting (SIGSTOP, frozen, its host gone) is declared
  dead by JAX after `--heartbeat_timeout_s` (10 s), which ends the others; the line
  then also names the stopped process.

Exit status: 0 when every process exited 0; the status of the first process that
failed (128 + N if signal N killed it) — the first to record its failure, which is the
cause even when a peer whose collective it broke exits before it; 124 after
`--timeout_s`; 128 + N when the launcher got signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); 127 when the command
cannot be started; 2 for bad arguments (among them more `--processes` than this
machine's memory holds, `PROCESS_MEMORY` each).
"""

import argparse
import ctypes
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jaxsgd.spmd import distributed

TRAIN_MODULE = 'experiments.train'
# The memory one JAX process on the CPU takes: JAX and XLA resident after a first jitted
# op, with room for a small model's data. More processes than memory holds would swap or
# be killed one by one instead of being refused.
PROCESS_MEMORY = 256 << 20
_DEVICE_FLAG = re.compile(r'--xla_force_host_platform_device_count=\S+')
_PR_SET_PDEATHSIG = 1
PROGRESS_EVERY_S = 10.0  # Progress-bar redraws forwarded at most this often.
EXIT_TIMEOUT = 124  # As `timeout(1)`.
EXIT_CANNOT_START = 127  # As a shell, for a command it cannot run.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_CAUSE_WAIT_S = 2.0  # for the status of a process that recorded its failure first


def free_port() -> int:
  """A TCP port that is free now on this host (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('', 0))
    return s.getsockname()[1]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """Splits `argv` at `--` into the launcher's options and the command."""
  if '--' not in argv:
    raise SystemExit(
      'usage: python -m jaxsgd.launch --processes N [options] -- '
      'COMMAND_OR_TRAIN_FLAGS (the "--" is required)'
    )
  cut = argv.index('--')
  parser = argparse.ArgumentParser(
    prog='python -m jaxsgd.launch', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument(
    '--processes', type=int, required=True, help='processes to start on this host'
  )
  parser.add_argument(
    '--devices_per_process',
    type=int,
    default=None,
    help='fake CPU devices per process (sets XLA_FLAGS, JAX_PLATFORMS=cpu)',
  )
  parser.add_argument(
    '--coordinator', default=None, help='HOST:PORT of process 0 (default: this host, a free port)'
  )
  parser.add_argument(
    '--num_processes',
    type=int,
    default=None,
    help='processes in the whole cluster (default: --processes)',
  )
  parser.add_argument(
    '--first_process_id',
    type=int,
    default=0,
    help='id of the first process started here (other hosts: > 0)',
  )
  parser.add_argument(
    '--init_timeout_s',
    type=int,
    default=distributed.DEFAULT_TIMEOUT_S,
    help='seconds to wait for the cluster to form',
  )
  parser.add_argument(
    '--heartbeat_timeout_s',
    type=int,
    default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
    help='seconds without heartbeats after which JAX declares a process '
    'dead (stopped, frozen, host gone) and ends the others',
  )
  parser.add_argument(
    '--grace_s',
    type=float,
    default=2.0,
    help='when the launcher is stopped (Ctrl-C, SIGTERM) or times out: '
    'seconds between passing the signal on and SIGKILL',
  )
  parser.add_argument(
    '--timeout_s',
    type=float,
    default=None,
    help='stop everything after this many seconds (exit 124)',
  )
  args = parser.parse_args(argv[:cut])
  _check_args(parser, args)
  command = argv[cut + 1 :]
  if not command:
    parser.error('nothing to run after "--"')
  return args, command


def _check_args(parser, args) -> None:
  if args.processes < 1:
    parser.error(f'--processes: must be >= 1, got {args.processes}')
  most = max_processes()
  if args.processes > most:
    parser.error(
      f"--processes: {args.processes} JAX processes do not fit in this machine's "
      f'memory (each needs ~{PROCESS_MEMORY >> 20} MiB: at most {most} here)'
    )
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error(f'--devices_per_process: must be >= 1, got {args.devices_per_process}')
  total = args.num_processes or args.processes
  if not 0 <= args.first_process_id <= total - args.processes:
    parser.error(
      f'--first_process_id: {args.first_process_id} + --processes '
      f'{args.processes} exceeds --num_processes {total}'
    )
  if args.first_process_id > 0 and args.coordinator is None:
    parser.error(
      '--coordinator: needed when process 0 runs on another host (--first_process_id > 0)'
    )


def max_processes() -> int:
  """How many JAX processes this machine's memory holds (`PROCESS_MEMORY` each)."""
  try:
    memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError):
    return 1 << 30  # unknown: no limit
  return max(1, memory // PROCESS_MEMORY)


def child_command(command: list[str]) -> list[str]:
  """The command each process runs (see the module docstring)."""
  bootstrap = [sys.executable, '-u', '-m', 'jaxsgd.spmd.bootstrap']
  if command[0] in ('python', 'python3') and command[1:2] == ['-m'] and len(command) > 2:
    command = command[1:]  # `python -m MODULE ...`: a module, joined to the cluster first
  if command[0] == '-m' and len(command) > 1:
    return bootstrap + command[1:]
  if command[0].startswith('-'):
    return bootstrap + [TRAIN_MODULE] + command
  if command[0] in ('python', 'python3'):  # This interpreter (and its virtualenv).
    return [sys.executable] + command[1:]
  return command


def child_env(args, process_id: int, coordinator: str) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
    {
      distributed.ADDRESS_VAR: coordinator,
      distributed.NUM_PROCESSES_VAR: str(args.num_processes or args.processes),
      distributed.PROCESS_ID_VAR: str(process_id),
      distributed.TIMEOUT_VAR: str(args.init_timeout_s),
      distributed.HEARTBEAT_VAR: str(args.heartbeat_timeout_s),
      'PYTHONUNBUFFERED': '1',
    }
  )
  if args.devices_per_process is not None:
    flags = _DEVICE_FLAG.sub('', env.get('XLA_FLAGS', '')).split()
    flags.append(f'--xla_force_host_platform_device_count={args.devices_per_process}')
    env['XLA_FLAGS'] = ' '.join(flags)
    env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _die_with_launcher() -> None:
  """In the child, before exec: get SIGKILL if the launcher dies (Linux prctl).

  Covers the one case `launch` cannot: the launcher itself being SIGKILLed (e.g.
  by a test's timeout), which would otherwise orphan the processes.
  """
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # Not Linux: `launch` still covers its own exits.
    pass


def _forward(
  stream, prefix: str, lock: threading.Lock, out, progress_every_s: float = PROGRESS_EVERY_S
) -> None:
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
    buffer = buffer[max(buffer.rfind(b'\n'), buffer.rfind(b'\r')) + 1 :]
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
  """The launcher itself was asked to stop (Ctrl-C, SIGTERM, SIGHUP); args[0] is the signal."""


def _raise_stop(signum, frame):
  del frame
  raise _Stop(signum)


def _signal_all(procs, sig) -> None:
  """Sends `sig` to every running process's group (each child leads its own session)."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass


def _kill_all(procs) -> None:
  """SIGKILLs every process group and reaps the processes."""
  _signal_all(procs, signal.SIGKILL)
  for p in procs:
    p.wait()


def _start_waiter(proc, index, exits: queue.Queue) -> None:
  """Puts `(index, status)` on `exits` the moment `proc` ends: the first failure is
  seen at once, and in the order the processes really ended."""
  threading.Thread(target=lambda: exits.put((index, proc.wait())), daemon=True).start()


def _watch(procs, exits: queue.Queue, timeout_s) -> tuple[int | None, int | None]:
  """Waits until all exit 0, one fails, or time runs out: `(failed index, its status)`,
  `(None, None)` when all succeeded, `(None, EXIT_TIMEOUT)` on timeout."""
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  running = set(range(len(procs)))
  while running:
    try:  # Short waits: the launcher's own signals are handled between them.
      index, code = exits.get(timeout=0.1)
    except queue.Empty:
      if deadline is not None and time.monotonic() > deadline:
        return None, EXIT_TIMEOUT
      continue
    running.discard(index)
    if code != 0:
      return index, code
  return None, None


def _stop_gracefully(procs, sig, grace_s: float) -> None:
  """Forwards `sig` to every process, then SIGKILLs what is left after `grace_s`
  (at once on a second Ctrl-C or SIGTERM)."""
  hurry = threading.Event()
  for s in _STOP_SIGNALS:
    signal.signal(s, lambda *_: hurry.set())
  _signal_all(procs, sig)
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and not hurry.is_set() and any(p.poll() is None for p in procs):
    time.sleep(0.02)
  _kill_all(procs)


def _status(code: int) -> int:
  """A process's exit status as a shell reports it: 128 + N for signal N."""
  return code if code >= 0 else 128 - code


def _failure_message(args, local: int, code: int, status_file: str) -> str:
  """One line: which process failed, how, and why (what it recorded, if anything)."""
  pid = args.first_process_id + local
  reason = _recorded_reason(status_file)
  if code < 0:
    how = f'was killed by {signal.Signals(-code).name} (status {_status(code)})'
  else:
    how = f'failed (exit status {code})'
  text = f'process {pid} {how}' + (f': {reason}' if reason else '')
  total = args.num_processes or args.processes
  if reason and reason.startswith(distributed.CLUSTER_DID_NOT_FORM) and total > args.processes:
    text += (
      f' (this launcher starts processes {args.first_process_id}..'
      f'{args.first_process_id + args.processes - 1} of {total}: start the others '
      f'with the same --coordinator on their hosts)'
    )
  return text


def _recorded_reason(status_file: str) -> str | None:
  """The last failure a process recorded in its status file (see `distributed`)."""
  failure = _recorded_failure(status_file)
  return None if failure is None else failure.get('reason')


def _recorded_failure(status_file: str) -> dict | None:
  """The last `failed` record of a status file (`{'time', 'reason', ...}`), or None."""
  try:
    with open(status_file) as f:
      records = [json.loads(line) for line in f if line.endswith('\n')]
  except (OSError, ValueError):
    return None
  failures = [r for r in records if r.get('event') == 'failed']
  return failures[-1] if failures else None


def _first_cause(failed: int, code: int, exits: queue.Queue, status_files: list[str]):
  """`(index, status)` of the process whose failure was recorded first, which may not be
  the first to exit. A process whose collective failed because a peer ended records its
  failure after that peer did (the peer records, then exits, which closes the
  connection), but it can exit first: process 1 was once named for process 0's
  `RuntimeError`. A first failure with no record (a signal, a crash) is taken as it is.
  The process named instead has recorded and is exiting; its status is waited for up
  to `_CAUSE_WAIT_S`."""
  records = [_recorded_failure(path) for path in status_files]
  if records[failed] is None:
    return failed, code
  earliest = min((r['time'], k) for k, r in enumerate(records) if r is not None)[1]
  deadline = time.monotonic() + _CAUSE_WAIT_S
  while earliest != failed and time.monotonic() < deadline:
    try:
      index, status = exits.get(timeout=0.05)
    except queue.Empty:
      continue
    if index == earliest:
      return index, status
  return failed, code


def _status_file(status_dir: str, process_id: int) -> str:
  return os.path.join(status_dir, f'p{process_id}.jsonl')


def _start(args, cmd, coordinator, status_dir, out, lock, procs, threads) -> None:
  """Starts the processes into `procs`, and their output-forwarding threads."""
  for local in range(args.processes):
    pid = args.first_process_id + local
    env = child_env(args, pid, coordinator)
    env[distributed.STATUS_FILE_VAR] = _status_file(status_dir, pid)
    procs.append(
      subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_launcher,
      )
    )
    thread = threading.Thread(
      target=_forward, args=(procs[-1].stdout, f'[p{pid}] ', lock, out), daemon=True
    )
    thread.start()
    threads.append(thread)


def launch(args, command: list[str], out=sys.stdout, err=sys.stderr) -> int:
  """Runs the processes to completion or first failure; returns the exit status.

  The status (see the module docstring): 0 when every process exited 0; the first
  failed process's status (128 + N when signal N killed it); `EXIT_TIMEOUT` (124)
  after `--timeout_s`; 128 + N when the launcher itself got signal N (130 for
  Ctrl-C, 143 for SIGTERM). Anything but 0 comes with one line on `err`.
  """
  coordinator = args.coordinator or f'127.0.0.1:{free_port()}'
  cmd = child_command(command)
  lock, exits = threading.Lock(), queue.Queue()
  procs, threads = [], []
  status_dir = tempfile.mkdtemp(prefix='jaxsgd-launch-')
  status_files = [
    _status_file(status_dir, args.first_process_id + k) for k in range(args.processes)
  ]
  previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
  for s in _STOP_SIGNALS:
    if previous[s] != signal.SIG_IGN:  # Started with `nohup` or `&`: keep ignoring.
      signal.signal(s, _raise_stop)
  status, message = 1, None
  try:
    try:
      _start(args, cmd, coordinator, status_dir, out, lock, procs, threads)
      for k, p in enumerate(procs):
        _start_waiter(p, k, exits)
      failed, code = _watch(procs, exits, args.timeout_s)
      if failed is not None:
        failed, code = _first_cause(failed, code, exits, status_files)
        stopped = [k for k, p in enumerate(procs) if k != failed and _is_stopped(p.pid)]
        _kill_all(procs)  # Its peers cannot go on (their collectives need it): no grace.
        status = _status(code)
        message = (
          _failure_message(args, failed, code, status_files[failed])
          + _stopped_cause(args, stopped)
          + _stopped_others(len(procs) - 1)
        )
      elif code == EXIT_TIMEOUT:
        _stop_gracefully(procs, signal.SIGTERM, args.grace_s)
        status = EXIT_TIMEOUT
        message = f'timed out after {args.timeout_s:g} s (--timeout_s); stopped all processes.'
      else:
        status = 0
    except OSError as e:  # The command could not be started (the others are killed).
      status, message = EXIT_CANNOT_START, f'cannot start {cmd[0]!r}: {e.strerror}.'
    except _Stop as stop:
      sig = signal.Signals(stop.args[0])
      _stop_gracefully(procs, sig, args.grace_s)
      status = 128 + sig
      message = f'stopped by {sig.name}; stopped all {len(procs)} processes.'
  finally:
    for sig in _STOP_SIGNALS:  # Cleaning up now; a late signal must not interrupt it.
      signal.signal(sig, signal.SIG_IGN)
    _kill_all(procs)  # Whatever happened above, nothing is left running.
    for thread in threads:  # Their pipes close with the processes; rarely held longer.
      thread.join(timeout=1)
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    shutil.rmtree(status_dir, ignore_errors=True)
  if message:
    err.write(f'jaxsgd.launch: {message}\n')
    err.flush()
  return status


def _is_stopped(pid: int) -> bool:
  """Whether `pid` is stopped (SIGSTOP, or a debugger), by its state in /proc (Linux)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] in ('T', 't')
  except (OSError, IndexError):
    return False


def _stopped_cause(args, stopped: list[int]) -> str:
  """Names the stopped processes: JAX ends the others when one misses its heartbeats."""
  if not stopped:
    return ''
  ids = ', '.join(str(args.first_process_id + k) for k in stopped)
  return (
    f', after process {ids} was stopped (SIGSTOP or a debugger) for longer than the '
    f'heartbeat timeout ({args.heartbeat_timeout_s} s)'
  )


def _stopped_others(n: int) -> str:
  return f'; stopped the other {n} process{"es" if n > 1 else ""}.' if n else '.'


def main(argv=None) -> int:
  args, command = parse_args(sys.argv[1:] if argv is None else argv)
  return launch(args, command)


if __name__ == '__main__':
  _status_code = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # Every process is reaped and the status files removed: nothing is left to clean
  # up, and tearing down the interpreter (JAX is imported with `jaxsgd`) takes ~1 s.
  os._exit(_status_code)  # pylint: disable=protected-access
