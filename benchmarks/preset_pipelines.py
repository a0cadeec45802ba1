r"""What the device presets predict: staged BP vs DDG, simulated on named hardware.

    python -m benchmarks.preset_pipelines [--steps=10] [--stages=4]

ResNet-20 (CIFAR-10 shapes, batch 64, Adam) cut into `--stages` stages, one
device each, free links: staged BP and DDG run `--steps` real iterations on the
virtual clock, with task costs from each device preset (roofline of XLA's
operation counts, `jaxsgd.scheduler.hardware`) and from a profile measured here
at the start (wall clock, both cores, median of 10). Prints the simulated time
per iteration and DDG's speed-up over BP for each; every preset run is done
twice and must give bit-identical simulated times (a preset does not depend on
the machine or its load). Last line: `h100: DDG speed-up over BP <x>, simulated
<y> ms per iteration`.
"""

import argparse

import numpy as np
import optax

from benchmarks.common import print_table
from jaxsgd import models
from jaxsgd.algorithms import ddg
from jaxsgd.pipeline import BatchFeed, PlacedStages, sequential_roles
from jaxsgd.scheduler import CostModel, Placement, VirtualExecutor, hardware, task_timing

SHAPE, CLASSES, BATCH = (32, 32, 3), 10, 64


def batches(seed: int = 0):
  rng = np.random.default_rng(seed)
  while True:
    yield {
      'image': rng.standard_normal((BATCH,) + SHAPE).astype(np.float32),
      'label': rng.integers(0, CLASSES, BATCH).astype(np.int32),
    }


def simulate(stages: PlacedStages, roles, steps: int, cost_model: CostModel) -> float:
  """Simulated seconds of `steps` iterations of `roles` (every task really runs)."""
  feed = BatchFeed(batches(), 1 + sum(r.loss != 'none' for r in roles))
  session = stages.session(roles, feed, steps)
  return VirtualExecutor(cost_model).run(session.cluster, session.processes()).makespan


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--stages', type=int, default=4)
  args = parser.parse_args()
  model = models.get_model('resnet20', SHAPE, CLASSES)
  k = args.stages
  stages = PlacedStages(
    model, k, optax.adam(1e-3), placement=Placement.create(k), batch_size=BATCH, seed=0
  )
  bp, delayed = sequential_roles(k), ddg.roles(k)
  batch = next(batches())
  tables = {'measured here': task_timing.pipeline_table(stages, bp, batch, reps=10).costs}
  for name in hardware.PRESETS:
    tables[name] = hardware.pipeline_costs(stages, bp, batch, hardware.preset(name))
  rows, last = [], None
  for name, table in tables.items():
    runs = {
      method: [simulate(stages, roles, args.steps, CostModel(table)) for _ in range(2)]
      for method, roles in (('bp', bp), ('ddg', delayed))
    }
    for method, (first, second) in runs.items():
      if first != second:
        raise AssertionError(f'{name} {method}: simulated {first} then {second}')
    per_step = {m: 1e3 * t[0] / args.steps for m, t in runs.items()}
    speedup = per_step['bp'] / per_step['ddg']
    rows.append([name, per_step['bp'], per_step['ddg'], speedup])
    if name == 'h100':
      last = (speedup, per_step['ddg'])
  print(
    f'ResNet-20, batch {BATCH}, {k} stages (one device each, free links), {args.steps} '
    f'iterations; every run twice, identical simulated times'
  )
  print_table(['costs', 'BP ms/iter', 'DDG ms/iter', 'DDG speed-up'], rows)
  print(f'h100: DDG speed-up over BP {last[0]:.2f}, simulated {last[1]:.3f} ms per iteration')


if __name__ == '__main__':
  main()
