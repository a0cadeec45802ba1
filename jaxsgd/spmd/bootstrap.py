r"""Joins the cluster, then runs a module as `__main__`: what the launcher starts.

    JAXSGD_COORDINATOR_ADDRESS=... JAXSGD_NUM_PROCESSES=... JAXSGD_PROCESS_ID=... \
        python -m jaxsgd.spmd.bootstrap experiments.train --config=... --workdir=...

`jax.distributed.initialize` must come before JAX touches a device, so it runs
here, first. Every process trains; only process 0 writes to the workdir
(`jaxsgd.training.Run.is_primary`). A failure ends this process at once, without
JAX's shutdown barrier (`jaxsgd.spmd.distributed`): an uncaught exception (through
`install_fail_fast`) and also `sys.exit` with a non-zero status (e.g. absl's usage
errors), which Python would otherwise end through the barrier.
"""

import runpy
import sys

from jaxsgd.spmd import distributed


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    raise SystemExit('usage: python -m jaxsgd.spmd.bootstrap MODULE [ARGS...]')
  module, args = argv[1], argv[2:]
  try:
    distributed.initialize_from_env()
  except (distributed.CoordinatorUnreachableError, ValueError) as e:
    distributed.exit_now(1, str(e))
  sys.argv = [module] + args
  try:
    runpy.run_module(module, run_name='__main__', alter_sys=True)
  except SystemExit as e:
    if e.code not in (None, 0):
      _exit_failed(e.code)
    raise


def _exit_failed(code) -> None:
  if isinstance(code, int):
    distributed.exit_now(code, f'sys.exit({code})', announce=False)
  distributed.exit_now(1, str(code))  # sys.exit('message'): Python prints it, status 1.


if __name__ == '__main__':
  main(sys.argv)
