"""What the SPMD equivalence tests share: a small MLP and per-worker random batches."""

import numpy as np

from jaxsgd import models

FEATURES, CLASSES = 12, 5


def small_mlp():
  """The MLP every SPMD equivalence test trains (12 features, 16 hidden, 5 classes)."""
  return models.get_model('mlp', (FEATURES,), CLASSES, hidden=(16,))


def worker_batches(steps: int, workers: int, batch: int, seed: int = 0) -> list[list[dict]]:
  """`steps` steps of per-worker batches, `batches[t][m]`, drawn from one seeded stream."""
  rng = np.random.default_rng(seed)
  return [
    [
      {
        'image': rng.normal(size=(batch, FEATURES)).astype(np.float32),
        'label': rng.integers(0, CLASSES, size=batch).astype(np.int32),
      }
      for _ in range(workers)
    ]
    for _ in range(steps)
  ]
