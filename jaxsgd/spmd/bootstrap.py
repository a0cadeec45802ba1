r"""Joins the cluster, then runs a module as `__main__`: what the launcher starts.

    JAXSGD_COORDINATOR_ADDRESS=... JAXSGD_NUM_PROCESSES=... JAXSGD_PROCESS_ID=... \
        python -m jaxsgd.spmd.bootstrap experiments.train --config=... --workdir=...

`jax.distributed.initialize` must come before JAX touches a device, so it runs
here, first. Processes other than 0 get a private temporary `--workdir` (deleted
at exit): `jaxsgd.training.Run` writes its files wherever it is told, and only
process 0's belong in the user's workdir.
"""

import atexit
import runpy
import shutil
import sys
import tempfile

from jaxsgd.spmd import distributed


def private_workdir(args: list[str], process_id: int) -> list[str]:
  """`args` with `--workdir` pointed at a fresh temporary folder (removed at exit)."""
  tmp = tempfile.mkdtemp(prefix=f'jaxsgd-process{process_id}-')
  atexit.register(shutil.rmtree, tmp, ignore_errors=True)
  out, skip = [], False
  for k, arg in enumerate(args):
    if skip:
      skip = False
    elif arg.startswith('--workdir='):
      out.append(f'--workdir={tmp}')
    elif arg == '--workdir' and k + 1 < len(args):
      out += ['--workdir', tmp]
      skip = True
    else:
      out.append(arg)
  return out


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    raise SystemExit('usage: python -m jaxsgd.spmd.bootstrap MODULE [ARGS...]')
  module, args = argv[1], argv[2:]
  try:
    distributed.initialize_from_env()
  except (distributed.CoordinatorUnreachableError, ValueError) as e:
    raise SystemExit(f'error: {e}') from None
  cluster = distributed.cluster_from_env()
  if cluster is not None and cluster['process_id'] != 0:
    args = private_workdir(args, cluster['process_id'])
  sys.argv = [module] + args
  runpy.run_module(module, run_name='__main__', alter_sys=True)


if __name__ == '__main__':
  main(sys.argv)
