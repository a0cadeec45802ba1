"""Pipeline policies: a model cut into K stages, one lane each (BP, DDG, local parallelism).

- `roles`: `StageRole` (which loss a stage has, which gradients it receives and sends,
  how late its backward is and at which weights) and the jitted functions a stage runs
  in that role.
- `stale_graph`: backpropagation through a kept forward at weights changed since, as
  PyTorch's autograd does after in-place updates (the public DDG code).
- `agreement`: each block's local gradient against backprop's (cosine per block).
- `session`: `PlacedStages` (the stages on their devices, a factory of per-stage
  functions), `PipelineSession` (the stage processes of one run) and `BatchFeed`.

BP, DDG and local parallelism differ only in their roles; `jaxsgd.algorithms`
turns a config into roles and runs them on an executor of `jaxsgd.scheduler`.
"""

from jaxsgd.pipeline.roles import RoleFunctions, StageRole, role_functions
from jaxsgd.pipeline.session import KINDS, BatchFeed, PipelineSession, PlacedStages
from jaxsgd.pipeline.session import StageParams, check_roles, lane_names, sequential_roles
