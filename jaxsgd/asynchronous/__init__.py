"""Asynchronous training on the scheduler: ASGD/Hogwild!, DC-ASGD, LPP-SGD, PD-ASGD.

- `server`: a parameter server and M workers (`asgd`, `dcasgd`): `ParameterServer`,
  `AsgdSession`, `server_optimizer`.
- `lppsgd`: Hogwild! workers sharing one replica per device, replicas averaged
  (keep-local merge): `LppSession`.
- `pdasgd`: forward and backward workers with layer-wise (or block) updates:
  `PdSession`.
- `common`: worker speeds and failures, atomic store updates, step counting and
  the summary fields shared by the three.

Each runs on both clocks of `jaxsgd.scheduler` (real: a thread per worker;
virtual: simulated time from a calibrated cost model) and records the staleness
of every update. `jaxsgd.algorithms.asynchronous` registers them as
`asgd`, `dcasgd`, `lppsgd` and `pdasgd`; each module's `train(run)` is the
algorithm's entry point.
"""

from jaxsgd.asynchronous.common import SharedParams, StepCounter, WorkerLog, WorkersFailedError
from jaxsgd.asynchronous.lppsgd import LppSession, LppSettings
from jaxsgd.asynchronous.pdasgd import PdSession, PdSettings
from jaxsgd.asynchronous.server import AsgdSession, ParameterServer, ServerSettings
from jaxsgd.asynchronous.server import server_optimizer
