"""SPMD data parallelism (docs/architecture.md): one jitted step over a `data` mesh.

`DataParallelTrainer` maps one worker's step (`step.make_worker_step`) onto M
workers, over devices with `jax.shard_map` or stacked on one device with
`jax.vmap` (the delayed-averaging methods: a whole period per program, one
all-reduce per period); `distributed` joins a multi-process cluster (launched by
`python -m jaxsgd.launch`); `timing` is the virtual clock (compute + ring
all-reduce, hidden when delayed); `hlo` checks what a compiled all-reduce depends on.
"""

from jaxsgd.spmd.distributed import CoordinatorUnreachableError
from jaxsgd.spmd.distributed import initialize_from_env
from jaxsgd.spmd.mesh import AXIS
from jaxsgd.spmd.mesh import data_mesh
from jaxsgd.spmd.timing import ring_allreduce_time
from jaxsgd.spmd.timing import StepTimeModel
from jaxsgd.spmd.trainer import DataParallelTrainer
from jaxsgd.spmd.trainer import TrainState

__all__ = (
  'AXIS',
  'CoordinatorUnreachableError',
  'data_mesh',
  'DataParallelTrainer',
  'initialize_from_env',
  'ring_allreduce_time',
  'StepTimeModel',
  'TrainState',
)
