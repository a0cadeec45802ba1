"""Training algorithms, chosen by `config.algorithm.name`.

Each algorithm module defines `ALGORITHM = Algorithm(name, validate, run)` (or a
dict `ALGORITHMS` of them by name, when one module serves several names):
`validate(config, model)` refuses bad settings before anything compiles;
`run(run_context)` trains, reporting each step to the `jaxsgd.training.Run`, and
returns extra summary fields. Modules are imported only when chosen.
"""

import dataclasses
import importlib
from collections.abc import Callable

# name -> module defining ALGORITHM. One line per algorithm.
_MODULES = {
    'bp': 'jaxsgd.algorithms.backprop',
    'ddg': 'jaxsgd.algorithms.ddg',
    'local': 'jaxsgd.algorithms.local',
    'ssgd': 'jaxsgd.algorithms.data_parallel',
    'local_sgd': 'jaxsgd.algorithms.data_parallel',
    'dasgd': 'jaxsgd.algorithms.data_parallel',
    'diloco': 'jaxsgd.algorithms.data_parallel',
    'streaming_diloco': 'jaxsgd.algorithms.data_parallel',
    'asgd': 'jaxsgd.algorithms.asynchronous',
    'dcasgd': 'jaxsgd.algorithms.asynchronous',
    'lppsgd': 'jaxsgd.algorithms.asynchronous',
    'pdasgd': 'jaxsgd.algorithms.asynchronous',
}


@dataclasses.dataclass(frozen=True)
class Algorithm:
  name: str
  validate: Callable  # (config, model) -> None, raises ValueError naming the field
  run: Callable       # (run: jaxsgd.training.Run) -> dict of summary extras
  uses_workers: bool = False  # Reads `config.workers`; others refuse workers != 1.


def names() -> tuple[str, ...]:
  return tuple(_MODULES)


def get(name: str) -> Algorithm:
  """The algorithm called `name`; refuses unknown names, listing the known ones."""
  if name not in _MODULES:
    raise ValueError(f'algorithm.name: unknown algorithm {name!r}; allowed: '
                     f'{", ".join(_MODULES)}.')
  module = importlib.import_module(_MODULES[name])
  return module.ALGORITHMS[name] if hasattr(module, 'ALGORITHMS') else module.ALGORITHM
