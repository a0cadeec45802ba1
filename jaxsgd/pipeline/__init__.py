"""Pipeline policies: a model cut into K stages, one lane each (BP, DDG, local parallelism).

- `roles`: `StageRole` (which loss a stage has, which gradients it receives and sends,
  how late its backward is) and the jitted functions a stage runs in that role.
- `session`: `PlacedStages` (the stages on their devices, a factory of per-stage
  functions), `PipelineSession` (the stage processes of one run) and `BatchFeed`.

BP, DDG and local parallelism differ only in their roles; `jaxsgd.algorithms`
turns a config into roles and runs them on an executor of `jaxsgd.scheduler`.
"""

from jaxsgd.pipeline.roles import RoleFunctions, StageRole, role_functions
from jaxsgd.pipeline.session import KINDS, BatchFeed, PipelineSession, PlacedStages
from jaxsgd.pipeline.session import StageParams, check_roles, sequential_roles
