"""A decoder-only transformer (pre-norm, GPT-2 shape) as layers that stages are cut from.

Layers, each called as `layer(x, train)` like every layer of the zoo:

    TokenEmbedding   tokens [B, T] (float32 ids) -> h [B, T, D]   (+ learned positions)
    DecoderBlock x N h -> h + attn(LN(h)); h -> h + MLP(LN(h))      (causal attention)
    LanguageModelHead h -> LN(h) W                  -> logits [B, T, V]

A split cuts only between layers, so between whole blocks; the residual stream `h` is
what crosses a stage boundary. No BatchNorm and no dropout: a layer has no state and
train and eval modes compute the same function. Positions are learned (GPT-2) or
rotary (RoPE, applied to queries and keys inside every block). With tied embeddings
the head multiplies by the embedding matrix of layer 0, so both must sit in one stage.

References: Vaswani et al. (2017), "Attention is all you need" (scaled dot-product
attention, Eq. 1); Radford et al. (2019), GPT-2 (pre-norm blocks, a final LayerNorm,
tied embeddings, N(0, 0.02) embedding init); Su et al. (2021), "RoFormer" (rotary
positions, Eq. 34, in the half-split form of GPT-NeoX).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

_EMBEDDING_INIT = nn.initializers.normal(stddev=0.02)  # GPT-2's.
POSITIONS = ('learned', 'rotary')


class TokenEmbedding(nn.Module):
  """Token ids to vectors, plus a learned position vector unless positions are rotary.

  Ids arrive as float32 (the pipeline's one input dtype) and are cast back to integers.
  """

  vocab_size: int
  width: int
  max_length: int
  learned_positions: bool = True

  def setup(self):
    self.tokens = nn.Embed(self.vocab_size, self.width, embedding_init=_EMBEDDING_INIT)
    if self.learned_positions:
      self.positions = self.param('positions', _EMBEDDING_INIT, (self.max_length, self.width))

  def __call__(self, ids_BxT, train: bool = False):
    del train  # No train/eval difference.
    h_BxTxD = self.tokens(ids_BxT.astype(jnp.int32))
    if self.learned_positions:
      h_BxTxD = h_BxTxD + self.positions[: ids_BxT.shape[1]]
    return h_BxTxD

  def attend(self, h_BxTxD):
    """`h E^T`: logits from the embedding matrix (the tied head)."""
    return self.tokens.attend(h_BxTxD)


def rotate(x_BxTxHxK, base: float = 10_000.0):
  """Rotary position embedding (Su et al. 2021, Eq. 34), GPT-NeoX's half-split layout.

  Dimension pair `(i, i + K/2)` at position `t` is rotated by the angle
  `t * base^(-2i/K)`, so `q_t . k_s` depends on the positions only through `t - s`.
  """
  t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
  inv_freq_K2 = base ** (-jnp.arange(0, k // 2, dtype=jnp.float32) * 2 / k)
  angles_TxK2 = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq_K2[None]
  cos, sin = (f(angles_TxK2)[None, :, None, :] for f in (jnp.cos, jnp.sin))
  x1, x2 = x_BxTxHxK[..., : k // 2], x_BxTxHxK[..., k // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class CausalSelfAttention(nn.Module):
  """Multi-head attention of each position to itself and the positions before it.

  `softmax(q k^T / sqrt(K) + M) v` per head (Vaswani et al. 2017, Eq. 1), `M` the
  causal mask (`-inf` above the diagonal), then a linear map back to the width.
  """

  heads: int
  rotary: bool = False

  @nn.compact
  def __call__(self, h_BxTxD):
    t, d = h_BxTxD.shape[1], h_BxTxD.shape[2]
    qkv_BxTx3xHxK = nn.DenseGeneral((3, self.heads, d // self.heads), name='qkv')(h_BxTxD)
    q, k, v = (qkv_BxTx3xHxK[:, :, i] for i in range(3))
    if self.rotary:
      q, k = rotate(q), rotate(k)
    logits_BxHxTxT = jnp.einsum('bthk,bshk->bhts', q, k) / jnp.sqrt(d // self.heads)
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    logits_BxHxTxT = jnp.where(causal_TxT, logits_BxHxTxT, jnp.finfo(logits_BxHxTxT.dtype).min)
    weights = jax.nn.softmax(logits_BxHxTxT, axis=-1)
    out_BxTxHxK = jnp.einsum('bhts,bshk->bthk', weights, v)
    return nn.DenseGeneral(d, axis=(-2, -1), name='out')(out_BxTxHxK)


class DecoderBlock(nn.Module):
  """Pre-norm decoder block: `h + attn(LN(h))`, then `+ MLP(LN(.))` (GELU, `mlp_ratio` D)."""

  heads: int
  mlp_ratio: int = 4
  rotary: bool = False

  @nn.compact
  def __call__(self, h_BxTxD, train: bool = False):
    del train
    d = h_BxTxD.shape[-1]
    h_BxTxD = h_BxTxD + CausalSelfAttention(self.heads, self.rotary)(nn.LayerNorm()(h_BxTxD))
    y = nn.gelu(nn.Dense(self.mlp_ratio * d)(nn.LayerNorm()(h_BxTxD)))
    return h_BxTxD + nn.Dense(d)(y)


class LanguageModelHead(nn.Module):
  """Final LayerNorm, then logits over the vocabulary at every position.

  `tied`: the logits are `LN(h) E^T` with `E` the embedding of layer 0, which the stage
  holding both passes in as `embedding` (`Stage.setup`); untied, a linear layer.
  """

  vocab_size: int
  tied: bool = False
  embedding: nn.Module | None = None

  @nn.compact
  def __call__(self, h_BxTxD, train: bool = False):
    del train
    h_BxTxD = nn.LayerNorm()(h_BxTxD)
    if self.tied:
      return self.embedding.attend(h_BxTxD)
    return nn.Dense(self.vocab_size)(h_BxTxD)
