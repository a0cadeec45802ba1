"""Optax optimizers built from a config's `optimizer` field (name + kwargs)."""

import optax

SCHEDULES = ('constant', 'cosine', 'step')


def check_optimizer(opt_config) -> None:
  """Refuses an unknown optimizer or schedule before anything compiles."""
  name = opt_config.get('name')
  if not isinstance(name, str) or not callable(getattr(optax, name, None)):
    raise ValueError(f'optimizer.name: {name!r} is not an optax optimizer; use e.g. '
                     f"'sgd', 'adam', 'adamw', 'momentum' (any optax alias).")
  if not opt_config.get('learning_rate', 0) > 0:
    raise ValueError(f'optimizer.learning_rate: must be > 0, got '
                     f'{opt_config.get("learning_rate")!r}.')
  schedule = opt_config.get('schedule', 'constant')
  if schedule not in SCHEDULES:
    raise ValueError(f'optimizer.schedule: {schedule!r}; allowed: {", ".join(SCHEDULES)}.')
  if opt_config.get('weight_decay', 0.0) < 0:
    raise ValueError('optimizer.weight_decay: must be >= 0.')
  try:  # Building it is cheap (nothing compiles) and catches bad kwargs early.
    _base_optimizer(opt_config, 1)
  except TypeError as e:
    raise ValueError(f'optimizer.kwargs: {dict(opt_config.get("kwargs", {}) or {})} do not '
                     f'fit optax.{name}: {e}') from e


def learning_rate_schedule(opt_config, total_steps: int) -> optax.Schedule:
  """`constant`, `cosine` (to 0 over the run) or `step` (÷10 at 50 % and 75 %).

  `step` is the schedule of the DDG and ResNet papers (epochs 150 and 225 of 300).
  """
  lr = opt_config.learning_rate
  schedule = opt_config.get('schedule', 'constant')
  if schedule == 'cosine':
    return optax.cosine_decay_schedule(lr, max(total_steps, 1))
  if schedule == 'step':
    return optax.piecewise_constant_schedule(
        lr, {int(total_steps * 0.5): 0.1, int(total_steps * 0.75): 0.1})
  return optax.constant_schedule(lr)


def make_optimizer(opt_config, total_steps: int,
                   gradient_transforms=()) -> optax.GradientTransformation:
  """`chain(add_decayed_weights, *gradient_transforms, optax.<name>(schedule, **kwargs))`.

  Weight decay is classic L2, folded into the gradient first (as in the papers'
  SGD), so `gradient_transforms` (delay compensation, staleness scaling) see
  `g + wd·w`: DC-ASGD squares the same gradient the optimizer steps with
  (docs/algorithms.md, DC-ASGD: weight decay is folded into g before squaring).
  """
  check_optimizer(opt_config)
  parts = list(gradient_transforms) + [_base_optimizer(opt_config, total_steps)]
  weight_decay = opt_config.get('weight_decay', 0.0)
  if weight_decay:
    parts.insert(0, optax.add_decayed_weights(weight_decay))
  return optax.chain(*parts)  # A chain passes extra args (worker_id=, ...) through.


def _base_optimizer(opt_config, total_steps):
  kwargs = dict(opt_config.get('kwargs', {}) or {})
  return getattr(optax, opt_config.name)(learning_rate_schedule(opt_config, total_steps),
                                         **kwargs)
