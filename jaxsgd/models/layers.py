"""The layers models are built from; each is called as `layer(x, train)`."""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


class DenseLayer(nn.Module):
  """Flatten (if needed), linear, then ReLU unless it is the classifier."""

  features: int
  activate: bool = True

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train  # No train/eval difference.
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(self.features)(x)
    return nn.relu(x) if self.activate else x


class ConvLayer(nn.Module):
  """Convolution + ReLU (+ optional max-pool); 1-D or 2-D from the input rank."""

  features: int
  kernel: int = 3
  stride: int = 1
  pool: int = 1

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    spatial = x.ndim - 2
    x = nn.Conv(
      self.features, (self.kernel,) * spatial, strides=(self.stride,) * spatial, padding='SAME'
    )(x)
    x = nn.relu(x)
    if self.pool > 1:
      x = nn.max_pool(x, (self.pool,) * spatial, strides=(self.pool,) * spatial)
    return x


class ClassifierHead(nn.Module):
  """Global average pool over spatial axes (or flatten), then linear."""

  num_classes: int
  flatten: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if self.flatten:
      x = x.reshape((x.shape[0], -1))
    elif x.ndim > 2:
      x = x.mean(axis=tuple(range(1, x.ndim - 1)))
    return nn.Dense(self.num_classes)(x)


def _batch_norm(train: bool) -> Callable[[jax.Array], jax.Array]:
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)


class ConvBNStem(nn.Module):
  """Conv + BatchNorm + ReLU (ResNet stem), optionally followed by max-pool."""

  features: int
  kernel: int = 3
  stride: int = 1
  pool: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(
      self.features,
      (self.kernel, self.kernel),
      (self.stride, self.stride),
      padding='SAME',
      use_bias=False,
    )(x)
    x = nn.relu(_batch_norm(train)(x))
    if self.pool:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
    return x


class BasicBlock(nn.Module):
  """The residual basic block of He et al. (2016): two 3x3 conv-BN, ReLU after add.

  `shortcut='pad'` is option A of the CIFAR ResNets (identity, subsampled by
  striding and zero-padded in channels: no parameters); `'project'` is option B
  (1x1 conv + BN), used by ResNet-18.
  """

  features: int
  stride: int = 1
  shortcut: str = 'pad'

  @nn.compact
  def __call__(self, x, train: bool = False):
    strides = (self.stride, self.stride)
    y = nn.Conv(self.features, (3, 3), strides, padding='SAME', use_bias=False)(x)
    y = nn.relu(_batch_norm(train)(y))
    y = nn.Conv(self.features, (3, 3), padding='SAME', use_bias=False)(y)
    # Zero-init the last BN scale? No: He et al. initialize gamma to 1.
    y = _batch_norm(train)(y)
    return nn.relu(y + self._shortcut(x, train))

  def _shortcut(self, x, train):
    if self.stride == 1 and x.shape[-1] == self.features:
      return x
    if self.shortcut == 'project':
      x = nn.Conv(self.features, (1, 1), (self.stride, self.stride), use_bias=False)(x)
      return _batch_norm(train)(x)
    x = x[:, :: self.stride, :: self.stride, :]
    extra = self.features - x.shape[-1]
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
