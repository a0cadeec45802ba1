"""The model zoo: MLP, small CNN, CIFAR ResNet-20/56/110, ResNet-18, a decoder-only transformer."""

import dataclasses
import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from jaxsgd.models import layers as L
from jaxsgd.models import transformer as T
from jaxsgd.models.split import StagedModel


def mlp(input_shape, num_classes, hidden: Sequence[int] = (256, 256, 256)) -> StagedModel:
  """A ReLU MLP: one layer per hidden width, then a linear classifier."""
  units = tuple(L.DenseLayer(width) for width in hidden)
  units += (L.DenseLayer(num_classes, activate=False),)
  return StagedModel('mlp', units, tuple(input_shape), num_classes)


def cnn(
  input_shape, num_classes, channels: Sequence[int] = (32, 64, 128), kernel: int = 5
) -> StagedModel:
  """A small CNN (1-D or 2-D by input rank): stride-2 conv+ReLU blocks, linear head.

  With the defaults on MNIST-1D (length 40) the feature maps are 20, 10, 5 long; the
  head flattens them, since position matters for MNIST-1D.
  """
  units = tuple(L.ConvLayer(c, kernel=kernel, stride=2) for c in channels)
  units += (L.ClassifierHead(num_classes, flatten=True),)
  return StagedModel('cnn', units, tuple(input_shape), num_classes)


def cifar_resnet(depth: int, input_shape, num_classes, width: int = 16) -> StagedModel:
  """CIFAR ResNet-(6n+2) of He et al. (2016), Sec. 4.2: 3 stacks of n basic blocks.

  Widths `width`, `2 width`, `4 width`; the first block of stacks 2 and 3 halves
  the resolution; option-A (parameter-free) shortcuts; global pool + linear head.
  Layers: stem, 3n blocks, head.
  """
  if (depth - 2) % 6 or depth < 8:
    raise ValueError(f'model.depth: CIFAR ResNets have depth 6n+2 (8, 20, 56, 110), got {depth}.')
  n = (depth - 2) // 6
  units = [L.ConvBNStem(width)]
  for stack in range(3):
    for block in range(n):
      stride = 2 if stack > 0 and block == 0 else 1
      units.append(L.BasicBlock(width * 2**stack, stride=stride, shortcut='pad'))
  units.append(L.ClassifierHead(num_classes))
  return StagedModel(f'resnet{depth}', tuple(units), tuple(input_shape), num_classes)


def resnet18(input_shape, num_classes) -> StagedModel:
  """ResNet-18 (He et al. 2016): [2, 2, 2, 2] basic blocks, 64-512 channels.

  Inputs smaller than 64 px get the usual CIFAR stem (3x3 conv, no max-pool);
  larger ones the ImageNet stem (7x7 stride-2 conv + max-pool).
  """
  small = input_shape[0] < 64
  units = [L.ConvBNStem(64, kernel=3) if small else L.ConvBNStem(64, kernel=7, stride=2, pool=True)]
  for stage, width in enumerate((64, 128, 256, 512)):
    for block in range(2):
      stride = 2 if stage > 0 and block == 0 else 1
      units.append(L.BasicBlock(width, stride=stride, shortcut='project'))
  units.append(L.ClassifierHead(num_classes))
  return StagedModel('resnet18', tuple(units), tuple(input_shape), num_classes)


def transformer(
  input_shape,
  num_classes,
  width: int = 128,
  blocks: int = 4,
  heads: int = 4,
  mlp_ratio: int = 4,
  positions: str = 'learned',
  tied_embeddings: bool = False,
) -> StagedModel:
  """A decoder-only, pre-norm transformer language model (GPT-2 shape; `transformer.py`).

  Inputs are `[B, T]` token ids (`input_shape == (T,)`), outputs `[B, T, num_classes]`
  next-token logits, `num_classes` the vocabulary. Layers: embedding, `blocks` decoder
  blocks of `width` and `heads` heads, head; so `blocks + 2` layers to cut stages from.
  `positions`: 'learned' (a table of T vectors) or 'rotary' (RoPE in every block).
  `tied_embeddings`: the head reuses the embedding matrix (then only `stages=1`).
  """
  (length,) = input_shape
  units = (T.TokenEmbedding(num_classes, width, length, learned_positions=positions == 'learned'),)
  units += tuple(
    T.DecoderBlock(heads, mlp_ratio, rotary=positions == 'rotary') for _ in range(blocks)
  )
  units += (T.LanguageModelHead(num_classes, tied=tied_embeddings),)
  return StagedModel('transformer', units, tuple(input_shape), num_classes, per_token=True)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What `get_model` was called with: hashable and picklable, so another process (a lane)
  builds the same model from it (`ModelSpec.build()`).

  Attributes:
    name, input_shape, num_classes: `get_model`'s arguments.
    kwargs: its keyword arguments as sorted `(name, value)` pairs, lists made tuples.
  """

  name: str
  input_shape: tuple[int, ...]
  num_classes: int
  kwargs: tuple[tuple[str, Any], ...] = ()

  def build(self) -> StagedModel:
    return get_model(self.name, self.input_shape, self.num_classes, **dict(self.kwargs))


def _frozen(value):
  """Lists (from a config) as tuples, so that a `ModelSpec` is hashable."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  return value


MODELS = ('mlp', 'cnn', 'resnet8', 'resnet20', 'resnet56', 'resnet110', 'resnet18', 'transformer')


def get_model(name: str, input_shape, num_classes, **kwargs) -> StagedModel:
  """Builds model `name` (one of `MODELS`) for inputs of `input_shape`; the model's `spec`
  says how to build it again."""
  spec = ModelSpec(
    name,
    _frozen(input_shape),
    int(num_classes),
    tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())),
  )
  return dataclasses.replace(_build(name, input_shape, num_classes, **kwargs), spec=spec)


def _build(name: str, input_shape, num_classes, **kwargs) -> StagedModel:
  if name in _BUILDERS:
    check_model_fields(name, kwargs)
  if name == 'mlp':
    return mlp(input_shape, num_classes, **kwargs)
  if name == 'cnn':
    return cnn(input_shape, num_classes, **kwargs)
  if name in ('resnet8', 'resnet20', 'resnet56', 'resnet110'):
    _check_image(name, input_shape)
    return cifar_resnet(int(name[len('resnet') :]), input_shape, num_classes, **kwargs)
  if name == 'resnet18':
    _check_image(name, input_shape)
    return resnet18(input_shape, num_classes, **kwargs)
  if name == 'transformer':
    _check_tokens(name, input_shape)
    return transformer(input_shape, num_classes, **kwargs)
  raise ValueError(f'model.name: unknown model {name!r}; allowed: {", ".join(MODELS)}.')


_BUILDERS = {
  'mlp': mlp,
  'cnn': cnn,
  'resnet8': cifar_resnet,  # one block a stack: the smallest, for smoke tests
  'resnet20': cifar_resnet,
  'resnet56': cifar_resnet,
  'resnet110': cifar_resnet,
  'resnet18': resnet18,
  'transformer': transformer,
}
_NOT_FIELDS = ('input_shape', 'num_classes', 'depth')  # Given by the dataset or the name.


def model_fields(name: str) -> dict:
  """`{field: default}` of the `config.model` fields model `name` takes."""
  parameters = inspect.signature(_BUILDERS[name]).parameters
  return {k: p.default for k, p in parameters.items() if k not in _NOT_FIELDS}


def check_model_fields(name: str, kwargs: dict) -> None:
  """Refuses `config.model` fields model `name` does not take, or values it cannot build.

  Checked before the model is built: unknown fields (with the closest known one),
  widths and channel counts (positive integers), `kernel`, `width`, `blocks`, `heads`
  and `mlp_ratio` (>= 1), the transformer's `positions` and `tied_embeddings`, and
  that its heads divide its width (into an even size, for rotary positions).
  """
  allowed = model_fields(name)
  for key, value in kwargs.items():
    if key not in allowed:
      close = difflib.get_close_matches(key, list(allowed), n=1)
      hint = f' Did you mean model.{close[0]}?' if close else ''
      raise ValueError(
        f'model.{key}: unknown field for model {name!r}.{hint} Allowed: '
        f'{", ".join(allowed) or "none"}.'
      )
    if key in ('hidden', 'channels'):
      if (
        not isinstance(value, (list, tuple))
        or not value
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
      ):
        raise ValueError(
          f'model.{key}: a non-empty tuple of positive integers (one width '
          f'per layer) expected, got {value!r}.'
        )
    elif key in ('kernel', 'width', 'blocks', 'heads', 'mlp_ratio'):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'model.{key}: must be a positive integer, got {value!r}.')
    elif key == 'positions' and value not in T.POSITIONS:
      raise ValueError(f'model.positions: {value!r}; allowed: {", ".join(T.POSITIONS)}.')
    elif key == 'tied_embeddings' and not isinstance(value, bool):
      raise ValueError(f'model.tied_embeddings: True or False, got {value!r}.')
  if name == 'transformer':
    _check_heads({**allowed, **kwargs})


def _check_heads(fields: dict) -> None:
  width, heads = fields['width'], fields['heads']
  if width % heads:
    raise ValueError(f'model.heads: {heads} heads do not divide model.width={width}.')
  if fields['positions'] == 'rotary' and (width // heads) % 2:
    raise ValueError(
      f'model.heads: rotary positions rotate pairs of dimensions, so the head size '
      f'(width / heads = {width // heads}) must be even.'
    )


def _check_tokens(name, input_shape):
  if len(input_shape) != 1:
    raise ValueError(
      f'model.name: {name} needs token sequences of shape (T,); the dataset gives '
      f'{tuple(input_shape)}. Use a text dataset (pydoc_bytes).'
    )


def _check_image(name, input_shape):
  if len(input_shape) != 3:
    raise ValueError(
      f'model.name: {name} needs images of shape (H, W, C); the dataset '
      f'gives {tuple(input_shape)}. Use mlp or cnn for it.'
    )
