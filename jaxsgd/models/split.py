"""Models as ordered lists of layers that can be cut into pipeline stages.

A `StagedModel` is a tuple of Flax layer modules (a "layer" is the unit of
splitting: an MLP layer, a conv block, a residual block, the classifier head).
Every layer is called as `layer(x, train)`. Stage `k` of a split holds layers
`[start_k, end_k)` under their *global* names `layer_{i}`, so a stage's variables
are exactly a subset of the unsplit model's variables:

    full = model.init(key)                  # {'params': {'layer_0':..., ...}, ...}
    stages = split(model, K)
    y = x
    for stage in stages:
      y = stage.apply(stage_variables(full, stage), y)
    # y == model.full().apply(full, x)        (bit for bit)

A stage may carry an auxiliary head (for local losses): global average pooling +
linear for conv features, linear for flat features, stored as `aux_{k}`. A model that
predicts at every position (a language model, `per_token`) gets per-position heads
instead: LayerNorm + linear on each position's features, logits `[B, T, classes]`.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class AuxHead(nn.Module):
  """Local classifier: global-average-pool over spatial axes, then linear.

  `per_token`: no pooling; LayerNorm, then linear at every position (a language model's
  residual stream is not normalized, and its labels are per position).
  """

  num_classes: int
  per_token: bool = False

  @nn.compact
  def __call__(self, h_BxF):
    if self.per_token:
      return nn.Dense(self.num_classes)(nn.LayerNorm()(h_BxF))
    if h_BxF.ndim > 2:
      h_BxF = h_BxF.mean(axis=tuple(range(1, h_BxF.ndim - 1)))
    return nn.Dense(self.num_classes)(h_BxF)


class Stage(nn.Module):
  """Contiguous layers `[first_layer, first_layer + len(layers))` of a model."""

  layers: tuple[nn.Module, ...]
  first_layer: int = 0
  index: int = 0
  aux_classes: int = 0  # > 0 adds an auxiliary head `aux_{index}`.
  aux_per_token: bool = False  # The head predicts at every position (`AuxHead`).

  def setup(self):
    # Global names make stage variables a subset of the full model's variables.
    blocks = []
    for i, layer in enumerate(self.layers):
      shared = {'embedding': self._tied_embedding(blocks)} if _is_tied(layer) else {}
      blocks.append(layer.clone(parent=self, name=f'layer_{self.first_layer + i}', **shared))
    self.blocks = blocks
    if self.aux_classes:
      self.aux_head = AuxHead(
        self.aux_classes, per_token=self.aux_per_token, name=f'aux_{self.index}'
      )

  def _tied_embedding(self, blocks):
    """Layer 0, whose embedding matrix a tied head multiplies by (it must be here)."""
    if self.first_layer != 0:
      raise ValueError(
        'stages: a tied output layer needs the embedding (layer 0) in its stage; '
        'use stages=1 or model.tied_embeddings=False.'
      )
    return blocks[0]

  def __call__(self, x, train: bool = False):
    for block in self.blocks:
      x = block(x, train)
    return x

  def aux_logits(self, h):
    """Logits of the auxiliary head on this stage's output `h`."""
    return self.aux_head(h)

  def forward_with_aux(self, x, train: bool = False):
    """`(output, aux_logits)` in one call (used to initialize the head too)."""
    h = self(x, train)
    return h, self.aux_head(h)

  @property
  def layer_range(self) -> range:
    return range(self.first_layer, self.first_layer + len(self.layers))


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """An ordered tuple of layers plus what is needed to initialize them."""

  name: str
  layers: tuple[nn.Module, ...]
  input_shape: tuple[int, ...]
  num_classes: int
  # How to build it again (`zoo.ModelSpec`), e.g. inside a lane process; set by `get_model`.
  spec: Any = dataclasses.field(default=None, compare=False, repr=False)
  # Outputs `[B, T, num_classes]`, one prediction per position (a language model).
  per_token: bool = False

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def full(self) -> Stage:
    """The unsplit model: one stage holding every layer, no auxiliary head."""
    return Stage(self.layers)

  def init(self, key: jax.Array, batch_size: int = 2):
    """Variables of the unsplit model (`params`, and `batch_stats` if any)."""
    x = jnp.zeros((batch_size,) + self.input_shape, jnp.float32)
    return self.full().init(key, x, train=False)

  def layer_costs(self) -> tuple[float, ...]:
    return _layer_costs(self)


def check_num_stages(model: StagedModel, num_stages: int) -> None:
  if not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
    raise ValueError(f'stages: must be a positive integer, got {num_stages!r}.')
  if num_stages > model.num_layers:
    raise ValueError(
      f'stages: {num_stages} stages asked for, but model {model.name!r} has only '
      f'{model.num_layers} layers to split; use 1 <= stages <= {model.num_layers}.'
    )
  if num_stages > 1 and any(_is_tied(layer) for layer in model.layers):
    raise ValueError(
      f'stages: model {model.name!r} ties its output layer to its embedding '
      f'(model.tied_embeddings=True), so both must sit in one stage; use stages=1 or '
      f'model.tied_embeddings=False (for {num_stages} stages).'
    )


def split(
  model: StagedModel,
  num_stages: int,
  *,
  aux_heads: bool = False,
  costs: Sequence[float] | None = None,
) -> tuple[Stage, ...]:
  """Cuts `model` into `num_stages` contiguous stages of balanced cost.

  Args:
    model: the model to cut.
    num_stages: `K`, between 1 and the number of layers.
    aux_heads: give every stage but the last an auxiliary head.
    costs: the cost of each layer; defaults to the forward FLOPs XLA counts.

  Returns:
    `K` stages whose composition is the unsplit model.
  """
  check_num_stages(model, num_stages)
  costs = model.layer_costs() if costs is None else tuple(costs)
  bounds = balanced_boundaries(costs, num_stages)
  return tuple(
    Stage(
      model.layers[start:end],
      first_layer=start,
      index=k,
      aux_classes=model.num_classes if aux_heads and k < num_stages - 1 else 0,
      aux_per_token=model.per_token,
    )
    for k, (start, end) in enumerate(bounds)
  )


def balanced_boundaries(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
  """Contiguous `[start, end)` ranges minimizing the largest stage cost.

  Classic linear partition by dynamic programming (O(K N^2), N = layers), ties
  broken towards earlier cuts so the result is deterministic.
  """
  n = len(costs)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  # best[k][i]: the smallest max-cost splitting layers [0, i) into k stages.
  best = np.full((num_stages + 1, n + 1), np.inf)
  cut = np.zeros((num_stages + 1, n + 1), dtype=int)
  best[0][0] = 0.0
  for k in range(1, num_stages + 1):
    for i in range(k, n + 1):
      for j in range(k - 1, i):
        candidate = max(best[k - 1][j], prefix[i] - prefix[j])
        if candidate < best[k][i] - 1e-9 * abs(candidate):
          best[k][i], cut[k][i] = candidate, j
  bounds, end = [], n
  for k in range(num_stages, 0, -1):
    start = int(cut[k][end])
    bounds.append((start, end))
    end = start
  return bounds[::-1]


def stage_variables(full_variables, stage: Stage):
  """The subset of the unsplit model's variables that `stage` uses."""
  names = {f'layer_{i}' for i in stage.layer_range}
  return {
    col: {k: v for k, v in tree.items() if k in names} for col, tree in full_variables.items()
  }


def merge_variables(stage_variables_list):
  """The unsplit model's variables from every stage's (auxiliary heads dropped)."""
  merged = {}
  for variables in stage_variables_list:
    for col, tree in variables.items():
      merged.setdefault(col, {}).update({k: v for k, v in tree.items() if not k.startswith('aux_')})
  return merged


def init_stages(model: StagedModel, stages: Sequence[Stage], key: jax.Array, batch_size: int = 2):
  """Per-stage variables: slices of one full init, plus freshly drawn aux heads."""
  full_key, aux_key = jax.random.split(key)
  full = model.init(full_key, batch_size)
  result = []
  h = jnp.zeros((batch_size,) + model.input_shape, jnp.float32)
  for stage in stages:
    variables = stage_variables(full, stage)
    if stage.aux_classes:
      head = stage.init(jax.random.fold_in(aux_key, stage.index), h, method=Stage.forward_with_aux)
      variables = {**variables, 'params': {**variables['params'], **_aux_only(head['params'])}}
    h = jax.eval_shape(functools.partial(stage.apply, train=False), variables, h)
    h = jnp.zeros(h.shape, h.dtype)
    result.append(variables)
  return result


def _aux_only(params):
  return {k: v for k, v in params.items() if k.startswith('aux_')}


@functools.lru_cache(maxsize=32)
def _layer_costs(model: StagedModel) -> tuple[float, ...]:
  """Forward FLOPs per example of each layer, as counted by XLA's cost analysis.

  Counted on shapes alone (`jax.eval_shape`, `lower` on `ShapeDtypeStruct`s): a lowering
  depends on nothing else, and the model initialized for real, op by op, took most of a
  second of every process that splits it (the driver and each lane building its stage)."""
  init = functools.partial(model.init, batch_size=1)
  variables = jax.eval_shape(init, jax.random.key(0))
  h = jax.ShapeDtypeStruct((1,) + model.input_shape, jnp.float32)
  costs = []
  for i, layer in enumerate(model.layers):
    stage, stage_vars = _alone(layer, i, variables, h)
    apply = jax.jit(functools.partial(stage.apply, train=False))
    analysis = apply.lower(stage_vars, h).cost_analysis() or {}
    costs.append(max(float(analysis.get('flops', 0.0)), 1.0))
    h = jax.eval_shape(apply, stage_vars, h)
  return tuple(costs)


def _alone(layer, index: int, variables, h):
  """Layer `index` as a stage of its own, and its variables' shapes (`h`: its input's).

  A tied head alone has no embedding to read: it is priced untied (the same matmul),
  with variables of its own.
  """
  if _is_tied(layer):
    stage = Stage((layer.clone(tied=False),), first_layer=index)
    init = functools.partial(stage.init, train=False)
    return stage, jax.eval_shape(init, jax.random.key(0), h)
  stage = Stage((layer,), first_layer=index)
  return stage, stage_variables(variables, stage)


def _is_tied(layer) -> bool:
  """Whether `layer` reads another layer's parameters (a tied output layer).

  Read from the dataclass fields: `getattr` of a missing attribute would run the
  layer's `setup` under the stage and create its parameters there.
  """
  return any(f.name == 'tied' for f in dataclasses.fields(layer)) and bool(layer.tied)
