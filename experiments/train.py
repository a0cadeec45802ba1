r"""Trains one configuration: the only place flags are defined.

    python -m experiments.train --config=experiments/configs/default.py --workdir=runs/demo
    python -m experiments.train --config=experiments/configs/default.py:smoke \
        --workdir=/tmp/smoke --config.dataset=digits

A refusal or a failure is one line on stderr, `error: <field>: <what is allowed>`,
and an exit status:

    0  the run finished (summary.json written)
    2  bad input, refused before anything ran: a config field (including unknown
       --config.* fields, with the closest known name), a missing config file or
       variant, a workdir in use by another run or holding another run's results
       (--overwrite replaces them)
    1  the run failed: a NaN/inf loss (naming the step), failed workers, an error
       in training; its traceback is in WORKDIR/error.log
  143  SIGTERM (pre-emption): the run saved a checkpoint in WORKDIR/checkpoints and
       stopped; the same command resumes it (algorithms without checkpoints stop at
       once).
  130  Ctrl-C: stopped at once, without saving (one line, no traceback); one while a
       checkpoint is saved or read stops the run when that is complete.

`--verbose` also prints the traceback on stderr, and the libraries' INFO lines (tfds
loading a dataset's description, JAX looking for a TPU: left out otherwise). Under
`python -m jaxsgd.launch` the same line is what the launcher reports for the process.

A finished run's last line gives its test accuracy, step and wall time, and on the
virtual clock its simulated time beside them.
"""

import difflib
import importlib.util
import os
import re
import sys
import traceback

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from experiments.terminal import final_line, quiet_libraries, times
from jaxsgd.errors import Preempted
from jaxsgd.spmd import distributed
from jaxsgd.training import files
from jaxsgd.training import train_and_evaluate

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
ERROR_LOG = 'error.log'
# Refused before the run started (exit 2). Anything else is a failed run (exit 1).
BAD_INPUT = (ValueError, files.WorkdirLockedError)

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where metrics, plots and the summary go.')
_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'An ml_collections config file.', lock_config=True
)
_OVERWRITE = flags.DEFINE_bool(
  'overwrite', False, "Replace an earlier run's results in --workdir (refused otherwise)."
)
_VERBOSE = flags.DEFINE_bool(
  'verbose', False, "Print the traceback of a refusal or failure, and the libraries' INFO lines."
)
flags.mark_flags_as_required(['config', 'workdir'])


def fail(status: int, message: str, error: BaseException | None = None) -> None:
  """Ends the program with `error: message` on stderr and `status` (see the docstring)."""
  message = ' '.join(str(message).split())  # One line.
  if error is not None and _verbose():
    traceback.print_exception(error)
  if os.environ.get(distributed.ADDRESS_VAR):  # Launched: tell the launcher, skip JAX's
    distributed.exit_now(status, message)  # shutdown barrier (it waits for peers).
  if status != EXIT_BAD_INPUT:  # The run is over and cleaned up (lane processes ended,
    logging.flush()  # files written whole); the interpreter's teardown of JAX and Ray
    distributed.exit_now(status, message)  # would take 1-3 s more here: end now.
  print(f'error: {message}', file=sys.stderr)
  sys.stderr.flush()
  sys.exit(status)


def _verbose() -> bool:
  """`--verbose`, also when flag parsing itself failed (then read from the command line)."""
  if flags.FLAGS.is_parsed():
    return _VERBOSE.value
  return any(
    a in ('--verbose', '--verbose=true', '--verbose=True', '--verbose=1') for a in sys.argv
  )


# --- the command line ------------------------------------------------------------------------
def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every error as one line (`fail`, status 2)."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # ml_collections defers a config file's load error to here.
    return rest
  except flags.Error as e:  # Unknown flags, bad values, missing required flags.
    fail(EXIT_BAD_INPUT, _config_problem(argv) or _flag_error(str(e)), e)
  except Exception as e:  # pylint: disable=broad-except  # ml_collections: see below.
    fail(EXIT_BAD_INPUT, _config_problem(argv) or _first_line(e), e)
  raise AssertionError('not reached')


def _config_problem(argv: list[str]) -> str | None:
  """What is wrong with `--config` and its `--config.*` overrides, if anything.

  ml_collections raises a bare `AttributeError: "'foo'"` for an override of an
  unknown field and a multi-line `OSError` for a missing file; this loads the config
  file again and names the first override that does not exist, with the closest
  known field.
  """
  path = next((a.split('=', 1)[1] for a in argv if a.startswith(('--config=', '-config='))), None)
  if path is None:
    return None
  try:
    config = load_config(path)
  except FileNotFoundError:
    return f'--config: no config file {path.partition(":")[0]!r}.'
  except Exception as e:  # pylint: disable=broad-except
    return f'--config={path}: {_first_line(e)}'
  for arg in argv:
    name = arg.lstrip('-').split('=', 1)[0]
    if name.startswith('noconfig.'):
      name = name[2:]
    if name.startswith('config.'):
      problem = unknown_field(config, name[len('config.') :])
      if problem:
        return problem
  return None


def load_config(path: str) -> ml_collections.ConfigDict:
  """`get_config(variant)` of the config file `FILE[:variant]`."""
  filename, _, variant = path.partition(':')
  if not os.path.isfile(filename):
    raise FileNotFoundError(filename)
  spec = importlib.util.spec_from_file_location('config_file', filename)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def unknown_field(config, dotted: str) -> str | None:
  """`'<field>: unknown field ...'` if `dotted` is not a field of `config`, else None."""
  node, parts = config, dotted.split('.')
  for depth, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict):
      parent = '.'.join(parts[:depth])
      return f'{dotted}: {parent} is a value, not a section with fields.'
    if part not in node:
      parent = '.'.join(parts[:depth])
      known = sorted(node.keys())
      close = difflib.get_close_matches(part, known, n=1)
      hint = f' Did you mean {parent + "." if parent else ""}{close[0]}?' if close else ''
      where = f'{parent} ' if parent else ''
      return (
        f'{dotted}: unknown field.{hint} Allowed {where}fields: '
        f'{", ".join(known) or "none (the config file defines none here)"}.'
      )
    node = node[part]
  return None


def _flag_error(message: str) -> str:
  """absl's `flag --config.seed=abc: invalid literal ...` as `seed: invalid literal ...
  (--config.seed=abc)`: the field first, as every other refusal."""
  match = re.match(r'flag --config\.([\w.]+)=(.*?): (.*)', message, re.DOTALL)
  if not match:
    return message
  field, value, problem = match.groups()
  return f'{field}: {problem} (--config.{field}={value})'


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


# --- the run -------------------------------------------------------------------------------
def main(argv):
  if len(argv) > 1:
    fail(
      EXIT_BAD_INPUT,
      f'unexpected arguments: {" ".join(argv[1:])} (flags are '
      f'--config, --workdir, --config.FIELD=VALUE, --overwrite, --verbose)',
    )
  workdir = _WORKDIR.value
  if not _VERBOSE.value:
    quiet_libraries()
  try:
    summary = train_and_evaluate(_CONFIG.value, workdir, overwrite=_OVERWRITE.value)
  except Preempted as e:
    fail(Preempted.EXIT_STATUS, str(e))
  except KeyboardInterrupt as e:
    fail(
      EXIT_INTERRUPTED,
      'Ctrl-C: stopped at once, the step it was in not saved (a checkpoint being written or '
      'read is finished first); the same command resumes from the newest checkpoint, if any.',
      e,
    )
  except Exception as e:  # pylint: disable=broad-except
    if is_bad_input(e):
      fail(EXIT_BAD_INPUT, str(e), e)
    log = _write_error_log(workdir, e)
    fail(EXIT_FAILED, f'{distributed.describe(e)}' + (f' (traceback in {log})' if log else ''), e)
  final = summary['final']
  logging.info(
    'Done: step %d, test accuracy %.4f, test loss %.4f, %s.',
    final['step'],
    final['test_accuracy'],
    final['test_loss'],
    times(summary),
  )
  print(final_line(summary, workdir))


def is_bad_input(error: BaseException) -> bool:
  """A refusal of the input (exit 2), not a run that failed (exit 1)."""
  if isinstance(error, FileNotFoundError):  # A dataset not prepared in the data_dir.
    return str(error).startswith('dataset:')
  return isinstance(error, BAD_INPUT)


def _write_error_log(workdir: str, error: BaseException) -> str | None:
  """The failure's traceback in `WORKDIR/error.log` (process 0 only); its path."""
  if os.environ.get(distributed.PROCESS_ID_VAR, '0') != '0' or not os.path.isdir(workdir):
    return None
  path = os.path.join(workdir, ERROR_LOG)
  try:
    files.atomic_write(path, ''.join(traceback.format_exception(error)))
  except OSError:
    return None
  return path


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
