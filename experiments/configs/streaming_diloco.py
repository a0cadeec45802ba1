r"""Streaming DiLoCo: staggered, overlapped outer steps on 2 fragments, 4 workers, MNIST-1D.

    python -m experiments.train --config=experiments/configs/streaming_diloco.py \
        --workdir=runs/streaming_diloco
    python -m experiments.train --config=experiments/configs/streaming_diloco.py:smoke ...
    python -m jaxsgd.launch --processes 2 --devices_per_process 2 -- \
        --config=experiments/configs/streaming_diloco.py --workdir=runs/streaming_diloco_mp

Each worker takes inner steps on its own batches. The model is split into
`algorithm.fragments` = P = 2 fragments (the CNN's layers dealt out strided: 0, 2 /
1, 3); fragment p syncs at the steps t with (t − p·H/P) mod H = 0, H =
`algorithm.period` = 8, so one fragment (half the model) is all-reduced every 4
steps. Its outer step (Nesterov SGD 0.7 / 0.9 on θ_p − mean_j s_p, as DiLoCo) is
merged `algorithm.delay` = τ = 1 step later: w_p ← α w_p + (1 − α) θ_p, α =
`algorithm.mix` = 0.5 (α = 0 takes the global value, torchft's default). One
fragment, τ = 0, α = 0 is `diloco` (`dasgd.py:diloco` with period H).
Virtual clock: one all-reduce of 1/P of the weights every H/P steps, τ steps of
compute hidden (`jaxsgd.spmd.timing`). Variants: `smoke`, `full`, `lm`, `lm_smoke`.

Reference: Douillard et al., Streaming DiLoCo with overlapping communication (2025),
arXiv:2501.18512.

Full size (`streaming_diloco.py:full`, GPUs, tfds cifar10 prepared): ResNet-20, CIFAR-10,
4 workers of 128, real clock. Paper: LLMs (up to 4B parameters), H = 100, P up to 4 with
τ up to 5 match data-parallel loss with ~100x less peak bandwidth. Not run here.
"""

import ml_collections

from experiments.configs import default
from experiments.configs import ssgd


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  config = ssgd.get_config()
  config.algorithm = default.algorithm(
    'streaming_diloco',
    period=8,  # H: inner steps between two syncs of a fragment
    fragments=2,  # P: one fragment synced every H / P steps
    delay=1,  # τ < H / P: steps a fragment's all-reduce overlaps
    merge='mix',  # w_p ← α w_p + (1 − α) θ_p
    mix=0.5,
  )  # α
  return default.apply_variants(config, variant, ssgd.variants())
