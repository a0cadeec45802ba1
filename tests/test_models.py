"""Models: composing the stages of any split equals the unsplit model, bit for bit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsgd import models

CASES = [  # (model, input shape, stage counts to try)
  ('mlp', (40, 1), (1, 2, 4)),
  ('cnn', (40, 1), (1, 2, 3, 4)),
  ('cnn', (8, 8, 1), (2,)),
  ('resnet20', (32, 32, 3), (1, 3, 8)),
  ('resnet18', (32, 32, 3), (4,)),
]


def _compose(stages, full_variables, x, train=False):
  for stage in stages:
    x = stage.apply(models.stage_variables(full_variables, stage), x, train=train)
  return x


@pytest.mark.parametrize('name,shape,stage_counts', CASES)
def test_composed_stages_equal_the_unsplit_model(name, shape, stage_counts):
  model = models.get_model(name, shape, 10)
  variables = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (3,) + shape)
  expected = model.full().apply(variables, x, train=False)
  assert expected.shape == (3, 10)
  for k in stage_counts:
    # Uniform costs: the split's balance is tested below; here only composition.
    stages = models.split(model, k, costs=[1.0] * model.num_layers)
    assert len(stages) == k
    assert [i for s in stages for i in s.layer_range] == list(range(model.num_layers))
    chex.assert_trees_all_equal(_compose(stages, variables, x), expected)


def test_deep_cifar_resnets_have_6n_plus_2_layers_and_compose():
  # Uniform costs skip the per-layer cost analysis (55 blocks) to keep this fast.
  for depth, blocks in ((56, 27), (110, 54)):
    model = models.get_model(f'resnet{depth}', (32, 32, 3), 100)
    assert model.num_layers == blocks + 2  # stem + 3n blocks + head
  variables = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  stages = models.split(model, 4, costs=[1.0] * model.num_layers)
  chex.assert_trees_all_equal(_compose(stages, variables, x), model.full().apply(variables, x))


def test_resnet20_parameter_count_matches_he_et_al():
  # He et al. (2016), Table 6: ResNet-20 has 0.27M parameters.
  model = models.get_model('resnet20', (32, 32, 3), 10)
  params = model.init(jax.random.key(0))['params']
  count = sum(p.size for p in jax.tree.leaves(params))
  assert 0.26e6 < count < 0.28e6, count


def test_balanced_boundaries_hand_computed():
  # 1,1,1,1,4 into 2: any cut before the 4 leaves >= 5 on one side, so [0,4)|[4,5).
  assert models.balanced_boundaries([1, 1, 1, 1, 4], 2) == [(0, 4), (4, 5)]
  # Into 3: the bottleneck is the 4; the first 4 layers split 2|2.
  assert models.balanced_boundaries([1, 1, 1, 1, 4], 3) == [(0, 2), (2, 4), (4, 5)]
  # 3,1,1,1,3,3 into 3: no split beats 5 (the last two 3s must part, and then 3|1,1,1|3
  # is impossible without 6); of the splits with 5 the earliest cuts win: 3,1|1,1,3|3.
  assert models.balanced_boundaries([3, 1, 1, 1, 3, 3], 3) == [(0, 2), (2, 5), (5, 6)]
  assert models.balanced_boundaries([5] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_split_balances_xla_flops():
  model = models.get_model('resnet20', (32, 32, 3), 10)
  costs = np.asarray(model.layer_costs())
  stages = models.split(model, 4)
  per_stage = [costs[list(s.layer_range)].sum() for s in stages]
  # No contiguous 4-way split can beat the DP's bottleneck; check against brute force.
  n = len(costs)
  best = min(
    max(costs[:a].sum(), costs[a:b].sum(), costs[b:c].sum(), costs[c:].sum())
    for a in range(1, n)
    for b in range(a + 1, n)
    for c in range(b + 1, n)
  )
  assert max(per_stage) == pytest.approx(best)


def test_more_stages_than_layers_is_refused():
  model = models.get_model('mlp', (40, 1), 10, hidden=(16, 16))
  with pytest.raises(
    ValueError,
    match=r"stages: 4 stages asked for, but model 'mlp' has only "
    r'3 layers.*1 <= stages <= 3',
  ):
    models.split(model, 4)
  with pytest.raises(ValueError, match=r'stages: must be a positive integer'):
    models.split(model, 0)


def test_unknown_model_and_wrong_input_rank_are_refused():
  with pytest.raises(ValueError, match=r"model.name: unknown model 'vgg'.*resnet20"):
    models.get_model('vgg', (32, 32, 3), 10)
  with pytest.raises(ValueError, match=r'resnet20 needs images of shape \(H, W, C\)'):
    models.get_model('resnet20', (40, 1), 10)


def test_aux_heads_live_in_their_stage_and_are_dropped_when_merged():
  model = models.get_model('cnn', (40, 1), 10)
  stages = models.split(model, 3, aux_heads=True)
  stage_vars = models.init_stages(model, stages, jax.random.key(0))
  assert [s.aux_classes for s in stages] == [10, 10, 0]
  assert 'aux_0' in stage_vars[0]['params'] and 'aux_1' in stage_vars[1]['params']
  h = jnp.ones((2, 40, 1))
  for stage, variables in zip(stages[:-1], stage_vars[:-1]):
    h = stage.apply(variables, h)
    assert stage.apply(variables, h, method=models.Stage.aux_logits).shape == (2, 10)
  merged = models.merge_variables(stage_vars)
  assert sorted(merged['params']) == [f'layer_{i}' for i in range(model.num_layers)]
  # The merged layers are exactly one full init's layers (aux heads drawn separately).
  x = jax.random.normal(jax.random.key(2), (2, 40, 1))
  chex.assert_trees_all_equal(_compose(stages, merged, x), model.full().apply(merged, x))


def test_batchnorm_state_is_per_stage_and_updates_in_train_mode():
  model = models.get_model('resnet20', (32, 32, 3), 10)
  variables = model.init(jax.random.key(0))
  stages = models.split(model, 2)
  first = models.stage_variables(variables, stages[0])
  x = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
  _, new_state = stages[0].apply(first, x, train=True, mutable=['batch_stats'])
  assert set(new_state['batch_stats']) == {f'layer_{i}' for i in stages[0].layer_range}
  changed = jax.tree.map(
    lambda a, b: bool(jnp.any(a != b)), first['batch_stats'], new_state['batch_stats']
  )
  assert all(jax.tree.leaves(changed))
