r"""`local`: local parallelism, blocks trained by local losses (Laskin et al., 2020).

The network is cut into N blocks on N lanes (`config.stages`),
h_i = f_i(h_{i−1}; θ_i). Every block but the last has an auxiliary head a_i
(`split(..., aux_heads=True)`: global average pool + linear) giving a local loss
L_i = ℓ(a_i(h_i), y); the last block's loss is the model's. Heads are trained
with their block and dropped at evaluation (`merge_variables`).

Update rules (`algorithm.variant`), sg = stop-gradient:

    greedy:       θ_i ← θ_i − η ∇_{θ_i} L_i(a_i(f_i(sg(h_{i−1}))))
    overlapping:  θ_i ← θ_i − η ∇_{θ_i} [ L_i + L_{i+1}(a_{i+1}(f_{i+1}(f_i(sg(h_{i−1}))))) ]
                  (each loss reaches its block and the one before, then stops)
    chunked:      blocks grouped into C contiguous chunks (`algorithm.chunks`);
                  stop-gradients only at chunk boundaries, each chunk learns from
                  the loss at its last block. C = 1 is BP; C = N is greedy.

Schedule, block i (0-indexed) on its own lane, iteration t:

    h = f_i(θ_i, input of batch t) ; send sg(h) → block i + 1     # forward pipelined
    g = ∇ own loss L_i(a_i(h), y_t) ; send dL_i/dh_{i−1} → block i − 1   (overlapping: at once)
    δ = receive dL/dh_i from block i + 1 (overlapping: of L_{i+1}; chunked: inside a chunk)
    g += vjp_{t−d}(δ) ; send dL/dh_{i−1} → block i − 1             (chunked)
    θ_i ← update(θ_i, g)

`algorithm.pipelined=True` (default): a block never waits for a gradient that
needs a later iteration of its neighbours. The part of its gradient that comes
from downstream is for batch t − d, taken at that forward's weights (stored vjp):
overlapping, d = 1 (the own loss L_i is of the current batch, the L_{i+1} part one
batch older); chunked, d = last block of the chunk − i (DDG's delayed gradients
within each chunk; chunks = 1 is DDG). Greedy blocks need nothing from downstream,
so their updates are exact either way.

`algorithm.pipelined=False`: the idealized lock-step of the paper's analysis:
every update is the exact gradient of the local objective at the current weights
(d = 0; a block waits for the gradients it needs).

Gradient agreement (`algorithm.agreement_every=N`, 0 = off): every N batches, the
cosine between each block's local gradient of batch t and the gradient backprop
would give it from the same forward (same weights, same batch), per block:
`grad_cosine/stage{k}` in metrics.jsonl (the mean of the measurements since the last
record), `grad_cosine.png` and `grad_cosine.npz` in the workdir
(`jaxsgd.pipeline.agreement`).

Each block consumes the upstream output of batch t produced by block i − 1 at
*its* iteration t, i.e. with its weights after t updates: on a lock-step global
clock that is the previous step's output, as in the paper's pipelined setting.
Compute accounting (the trace, utilization) includes the heads and the pipeline
fill.

References:
  M. Laskin, L. Metz, S. Nabarro, M. Saroufim, B. Noune, C. Luschi,
  J. Sohl-Dickstein, P. Abbeel. Parallel Training of Deep Networks with Local
  Updates. 2020. arXiv:2012.03837 (Sec. 3: greedy, overlapping, chunked).
"""

import dataclasses

import numpy as np

from jaxsgd.algorithms import pipelined
from jaxsgd.algorithms.settings import SharedSettings, derived, section
from jaxsgd.pipeline import StageRole

VARIANTS = ('greedy', 'overlapping', 'chunked')


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.algorithm` of `local`, and the shared fields (`shared`)."""

  variant: str = 'greedy'
  chunks: int = 1  # chunked only: contiguous groups of stages
  pipelined: bool = True
  agreement_every: int = 0  # > 0: log each block's gradient agreement every N batches
  shared: SharedSettings | None = derived()

  @property
  def resumable(self) -> bool:
    """The whole run is checkpointed (`algorithms.resume`): on the virtual clock between
    any two events, on the real clock at a drained point, in one process or on lanes."""
    return True


def chunk_bounds(num_stages: int, chunks: int) -> list[tuple[int, int]]:
  """`[start, end)` of each of `chunks` contiguous, near-equal groups of stages."""
  sizes = [len(part) for part in np.array_split(np.arange(num_stages), chunks)]
  ends = np.cumsum(sizes)
  return [(int(end - size), int(end)) for size, end in zip(sizes, ends)]


def roles(
  num_stages: int, variant: str = 'greedy', chunks: int = 1, pipelined: bool = True
) -> tuple[StageRole, ...]:
  """The stage roles of a local-parallelism variant (see the module docstring)."""
  if variant == 'overlapping':
    return tuple(_overlapping(k, num_stages, pipelined) for k in range(num_stages))
  chunks = num_stages if variant == 'greedy' else chunks
  roles_ = []
  for start, end in chunk_bounds(num_stages, chunks):
    for k in range(start, end):
      loss = 'head' if k == num_stages - 1 else ('aux' if k == end - 1 else 'none')
      roles_.append(
        StageRole(
          loss=loss,
          receives_delta=k < end - 1,
          sends_delta='total' if k > start else 'none',
          delay=(end - 1 - k) if pipelined else 0,
        )
      )
  return tuple(roles_)


def _overlapping(k: int, num_stages: int, pipelined: bool) -> StageRole:
  downstream = k < num_stages - 1
  return StageRole(
    loss='aux' if downstream else 'head',
    receives_delta=downstream,
    sends_delta='own' if k > 0 else 'none',
    delay=1 if pipelined and downstream else 0,
  )


def validate(config, model) -> Settings:
  settings = section(config.algorithm, Settings, 'algorithm')
  if settings.variant not in VARIANTS:
    raise ValueError(
      f'algorithm.variant: {settings.variant!r} is not a local-parallelism '
      f'variant; allowed: {", ".join(VARIANTS)}.'
    )
  shared = pipelined.validate_pipeline(config, model)
  given = dict(config.algorithm)
  if settings.variant == 'chunked':
    if (
      isinstance(settings.chunks, bool)
      or not isinstance(settings.chunks, int)
      or not (1 <= settings.chunks <= shared.stages)
    ):
      raise ValueError(
        f'algorithm.chunks: must be an integer in [1, stages={shared.stages}], '
        f'got {settings.chunks!r}.'
      )
  elif 'chunks' in given and given['chunks'] != Settings.chunks:
    raise ValueError(
      f'algorithm.chunks: only the chunked variant groups stages into chunks; '
      f'{settings.variant!r} does not use it (got {given["chunks"]!r}): remove '
      f'it or set algorithm.variant=chunked.'
    )
  if isinstance(settings.agreement_every, bool) or settings.agreement_every < 0:
    raise ValueError(
      f'algorithm.agreement_every: must be an integer >= 0 (0: off), got '
      f'{settings.agreement_every!r}.'
    )
  if settings.agreement_every and shared.executor == 'emulated':
    raise ValueError(
      "algorithm.agreement_every: the gradient-agreement probe measures the stages' "
      "gradients, which emulated tasks do not compute; it runs with executor='in_process' "
      "or 'processes' (or clock='virtual'), not 'emulated'."
    )
  return dataclasses.replace(settings, shared=shared)


def train(run, settings: Settings) -> dict:
  return pipelined.train_roles(
    run,
    settings.shared,
    roles(settings.shared.stages, settings.variant, settings.chunks, settings.pipelined),
    title=f'local ({settings.variant}): staleness per stage',
    agreement_every=settings.agreement_every,
    resumable=settings.resumable,
  )
