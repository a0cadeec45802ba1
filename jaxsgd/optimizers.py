"""Optax optimizers from `OptimizerSettings` (name, learning rate, schedule, weight decay).

    settings = OptimizerSettings('sgd', 0.1, schedule='step', weight_decay=1e-4,
                                 kwargs=(('momentum', 0.9),))
    tx = make_optimizer(settings, total_steps=1000)

The settings are a frozen, hashable dataclass (a lane process can rebuild the same
optimizer from them); `jaxsgd.algorithms` parses them from a config's `optimizer`.
"""

import dataclasses
import math

import optax

SCHEDULES = ('constant', 'cosine', 'step')


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """An optax optimizer by name (`optax.<name>(schedule, **kwargs)`).

  Attributes:
    name: any optax alias (`sgd`, `adam`, `adamw`, `momentum`, ...).
    learning_rate: the peak learning rate (> 0, finite).
    schedule: `constant`, `cosine` (to 0 over the run) or `step` (÷10 at 50 % and 75 %).
    weight_decay: classic L2 folded into the gradient first (>= 0, finite).
    kwargs: further keyword arguments of the optax alias, as `(name, value)` pairs.
  """

  name: str = 'sgd'
  learning_rate: float = 0.1
  schedule: str = 'constant'
  weight_decay: float = 0.0
  kwargs: tuple[tuple[str, object], ...] = ()

  def check(self, prefix: str = 'optimizer') -> 'OptimizerSettings':
    """Refuses what cannot build, naming the field; returns self."""
    if not isinstance(self.name, str) or not callable(getattr(optax, self.name, None)):
      raise ValueError(
        f'{prefix}.name: {self.name!r} is not an optax optimizer '
        f"(optimizer.name takes any optax alias, e.g. 'sgd', 'adam', 'adamw', "
        f"'momentum')."
      )
    if not _finite_number(self.learning_rate) or not self.learning_rate > 0:
      raise ValueError(
        f'{prefix}.learning_rate: must be > 0 and finite, got {self.learning_rate!r}.'
      )
    if self.schedule not in SCHEDULES:
      raise ValueError(f'{prefix}.schedule: {self.schedule!r}; allowed: {", ".join(SCHEDULES)}.')
    if not _finite_number(self.weight_decay) or self.weight_decay < 0:
      raise ValueError(
        f'{prefix}.weight_decay: must be >= 0 and finite, got {self.weight_decay!r}.'
      )
    try:  # Building it is cheap (nothing compiles) and catches bad kwargs early.
      _base_optimizer(self, 1)
    except TypeError as e:
      raise ValueError(
        f'{prefix}.kwargs: {dict(self.kwargs)} do not fit optax.{self.name}: {e}'
      ) from e
    return self


def _finite_number(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def learning_rate_schedule(settings: OptimizerSettings, total_steps: int) -> optax.Schedule:
  """`constant`, `cosine` (to 0 over the run) or `step` (÷10 at 50 % and 75 %).

  `step` is the schedule of the DDG and ResNet papers (epochs 150 and 225 of 300).
  """
  lr = settings.learning_rate
  if settings.schedule == 'cosine':
    return optax.cosine_decay_schedule(lr, max(total_steps, 1))
  if settings.schedule == 'step':
    return optax.piecewise_constant_schedule(
      lr, {int(total_steps * 0.5): 0.1, int(total_steps * 0.75): 0.1}
    )
  return optax.constant_schedule(lr)


def make_optimizer(
  settings: OptimizerSettings, total_steps: int, gradient_transforms=()
) -> optax.GradientTransformation:
  """`chain(add_decayed_weights, *gradient_transforms, optax.<name>(schedule, **kwargs))`.

  Weight decay is classic L2, folded into the gradient first (as in the papers'
  SGD), so `gradient_transforms` (delay compensation, staleness scaling) see
  `g + wd·w`: DC-ASGD squares the same gradient the optimizer steps with
  (docs/algorithms.md, DC-ASGD: weight decay is folded into g before squaring).
  """
  parts = list(gradient_transforms) + [_base_optimizer(settings, total_steps)]
  if settings.weight_decay:
    parts.insert(0, optax.add_decayed_weights(settings.weight_decay))
  return optax.chain(*parts)  # A chain passes extra args (worker_id=, ...) through.


def _base_optimizer(settings: OptimizerSettings, total_steps: int):
  return getattr(optax, settings.name)(
    learning_rate_schedule(settings, total_steps), **dict(settings.kwargs)
  )
