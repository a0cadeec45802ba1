r"""Joins the cluster, then runs a module as `__main__`: what the launcher starts.

    JAXSGD_COORDINATOR_ADDRESS=... JAXSGD_NUM_PROCESSES=... JAXSGD_PROCESS_ID=... \
        python -m jaxsgd.spmd.bootstrap experiments.train --config=... --workdir=...

`jax.distributed.initialize` must come before JAX touches a device, so it runs
here, first. Every process trains; only process 0 writes to the workdir
(`jaxsgd.training.Run.is_primary`).
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
    raise SystemExit(f'error: {e}') from None
  sys.argv = [module] + args
  runpy.run_module(module, run_name='__main__', alter_sys=True)


if __name__ == '__main__':
  main(sys.argv)
