"""Update rules of the seed papers as Optax gradient transformations.

Delay compensation (DC-ASGD), delayed averaging (DaSGD), local SGD, DiLoCo and
streaming DiLoCo outer steps, asynchronous local SGD's delayed Nesterov outer step,
and staleness-aware learning rates. Each is a plain Optax
`GradientTransformationExtraArgs`: pure, jittable, state in NamedTuples, per-step
facts (stale params, worker id, staleness) passed as keyword extra arguments.
"""

from jaxsgd.transforms.compensation import ADAPTIVE_LAMBDA0
from jaxsgd.transforms.compensation import CONSTANT_LAMBDA0
from jaxsgd.transforms.compensation import dc_asgd
from jaxsgd.transforms.compensation import dc_asgd_server
from jaxsgd.transforms.compensation import delay_compensation
from jaxsgd.transforms.compensation import delay_compensation_server
from jaxsgd.transforms.compensation import DelayCompensationServer
from jaxsgd.transforms.compensation import DelayCompensationServerState
from jaxsgd.transforms.compensation import record_pull
from jaxsgd.transforms.compensation import scale_by_delay_compensation
from jaxsgd.transforms.compensation import ScaleByDelayCompensationState
from jaxsgd.transforms.averaging import delayed_averaging
from jaxsgd.transforms.averaging import DelayedAveragingState
from jaxsgd.transforms.averaging import diloco
from jaxsgd.transforms.averaging import diloco_outer_step
from jaxsgd.transforms.averaging import DiLoCoOuterState
from jaxsgd.transforms.averaging import local_sgd
from jaxsgd.transforms.averaging import MERGES
from jaxsgd.transforms.averaging import snapshot_average
from jaxsgd.transforms.async_outer import delayed_nesterov
from jaxsgd.transforms.async_outer import DelayedNesterovState
from jaxsgd.transforms.staleness import inverse_sqrt_staleness
from jaxsgd.transforms.staleness import inverse_staleness
from jaxsgd.transforms.staleness import power_staleness
from jaxsgd.transforms.staleness import scale_by_staleness
from jaxsgd.transforms.streaming import fragment_leaves
from jaxsgd.transforms.streaming import fragment_snapshot_average
from jaxsgd.transforms.streaming import streaming_diloco
from jaxsgd.transforms.streaming import streaming_diloco_outer_step
from jaxsgd.transforms.streaming import StreamingDiLoCoState

__all__ = (
  'ADAPTIVE_LAMBDA0',
  'CONSTANT_LAMBDA0',
  'dc_asgd',
  'dc_asgd_server',
  'delay_compensation',
  'delay_compensation_server',
  'DelayCompensationServer',
  'DelayCompensationServerState',
  'delayed_averaging',
  'delayed_nesterov',
  'DelayedNesterovState',
  'DelayedAveragingState',
  'diloco',
  'diloco_outer_step',
  'DiLoCoOuterState',
  'fragment_leaves',
  'fragment_snapshot_average',
  'inverse_sqrt_staleness',
  'inverse_staleness',
  'local_sgd',
  'MERGES',
  'power_staleness',
  'record_pull',
  'scale_by_delay_compensation',
  'scale_by_staleness',
  'ScaleByDelayCompensationState',
  'snapshot_average',
  'streaming_diloco',
  'streaming_diloco_outer_step',
  'StreamingDiLoCoState',
)
