"""The model zoo: MLP, small CNN, CIFAR ResNet-20/56/110, ResNet-18."""

from collections.abc import Sequence

from jaxsgd.models import layers as L
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
    raise ValueError(f'model.depth: CIFAR ResNets have depth 6n+2 (20, 56, 110), got {depth}.')
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


MODELS = ('mlp', 'cnn', 'resnet20', 'resnet56', 'resnet110', 'resnet18')


def get_model(name: str, input_shape, num_classes, **kwargs) -> StagedModel:
  """Builds model `name` (one of `MODELS`) for inputs of `input_shape`."""
  if name == 'mlp':
    return mlp(input_shape, num_classes, **kwargs)
  if name == 'cnn':
    return cnn(input_shape, num_classes, **kwargs)
  if name in ('resnet20', 'resnet56', 'resnet110'):
    _check_image(name, input_shape)
    return cifar_resnet(int(name[len('resnet') :]), input_shape, num_classes, **kwargs)
  if name == 'resnet18':
    _check_image(name, input_shape)
    return resnet18(input_shape, num_classes, **kwargs)
  raise ValueError(f'model.name: unknown model {name!r}; allowed: {", ".join(MODELS)}.')


def _check_image(name, input_shape):
  if len(input_shape) != 3:
    raise ValueError(
      f'model.name: {name} needs images of shape (H, W, C); the dataset '
      f'gives {tuple(input_shape)}. Use mlp or cnn for it.'
    )
