"""The transformer language model: stages compose to the model, stage VJPs are its gradient,
attention is causal, and the per-token loss and metrics are per token."""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import ddg
from experiments.configs import streaming_diloco
from jaxsgd import models
from jaxsgd import training
from jaxsgd.models import stage_functions
from jaxsgd.models import transformer

# The shapes of `:lm_smoke` (bytes, 32-byte windows) and of `StagedModel.init`'s batch of 2:
# the models run eagerly here on the operations their initialization compiled, and the
# training run below finds them compiled too.
LENGTH, VOCAB = 32, 256
TINY = {'width': 32, 'blocks': 2, 'heads': 4}  # 4 layers: embedding, 2 blocks, head.


def _model(**overrides):
  return models.get_model('transformer', (LENGTH,), VOCAB, **{**TINY, **overrides})


def _tokens(key, batch=2):
  return jax.random.randint(jax.random.key(key), (batch, LENGTH), 0, VOCAB)


def _compose(stages, variables, x):
  for stage in stages:
    x = stage.apply(models.stage_variables(variables, stage), x)
  return x


@pytest.mark.parametrize('positions', ['learned', 'rotary'])
def test_composed_stages_equal_the_unsplit_model(positions):
  model = _model(positions=positions)
  variables = model.init(jax.random.key(0))
  x = _tokens(1).astype(jnp.float32)  # The pipeline's input dtype.
  expected = model.full().apply(variables, x)
  assert expected.shape == (2, LENGTH, VOCAB) and model.num_layers == 4
  for k in (2, 3, 4):
    stages = models.split(model, k, costs=[1.0] * model.num_layers)
    chex.assert_trees_all_equal(_compose(stages, variables, x), expected)


def test_stage_vjps_chain_to_the_unsplit_models_gradient():
  model = _model()
  variables = model.init(jax.random.key(0))
  tokens = _tokens(1, batch=16)  # `:lm_smoke`'s batch: its run below reuses the programs.
  x, labels = tokens.astype(jnp.float32), jnp.roll(tokens, -1, axis=1)

  def loss(params):
    return stage_functions.cross_entropy(model.full().apply({'params': params}, x), labels)

  expected_loss, expected = jax.jit(jax.value_and_grad(loss))(variables['params'])
  stages = models.split(model, 2)  # FLOP-balanced: [embedding, block], [block, head].
  assert [s.layer_range for s in stages] == [range(0, 2), range(2, 4)]
  fns = [stage_functions.make_stage_fns(s, input_grad=k > 0) for k, s in enumerate(stages)]
  vjps, h = [], x
  for stage, f in zip(stages[:-1], fns[:-1]):
    h, _, vjp = f.forward(models.stage_variables(variables, stage), h)
    vjps.append(vjp)
  value, _, vjp = fns[-1].loss_forward(models.stage_variables(variables, stages[-1]), h, labels)
  grads, dy = fns[-1].backward(vjp, jnp.ones(()))
  merged = dict(grads)
  for f, vjp in zip(fns[-2::-1], vjps[::-1]):
    grads, dy = f.backward(vjp, dy)
    merged.update(grads)
  np.testing.assert_allclose(value, expected_loss, rtol=1e-6)
  chex.assert_trees_all_close(merged, expected, atol=1e-6, rtol=1e-5)


def test_attention_is_causal():
  model = _model()
  variables = model.init(jax.random.key(0))
  x = _tokens(1).astype(jnp.float32)
  changed = x.at[:, 9].set((x[:, 9] + 1) % VOCAB)
  before, after = (model.full().apply(variables, t) for t in (x, changed))
  chex.assert_trees_all_equal(before[:, :9], after[:, :9])  # The past does not see t = 9.
  assert not np.allclose(before[:, 9:], after[:, 9:])


def test_rotary_scores_depend_only_on_the_offset():
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))
  q_rot = transformer.rotate(jnp.broadcast_to(q, (1, LENGTH, 1, 8)))
  k_rot = transformer.rotate(jnp.broadcast_to(k, (1, LENGTH, 1, 8)))
  scores = jnp.einsum('thk,shk->ts', q_rot[0], k_rot[0])
  for offset in (0, 3, -5):
    # scores[t, t + offset] for every t: one value per offset.
    np.testing.assert_allclose(jnp.diagonal(scores, offset), scores[7, 7 + offset], atol=1e-5)
  np.testing.assert_allclose(scores[0, 0], jnp.vdot(q, k), rtol=1e-6)  # No rotation at 0.


def test_aux_heads_predict_every_position_and_are_dropped_when_merged():
  model = _model()
  stages = models.split(model, 3, aux_heads=True)
  stage_vars = models.init_stages(model, stages, jax.random.key(0))
  h = _tokens(1).astype(jnp.float32)
  for stage, variables in zip(stages[:-1], stage_vars[:-1]):
    h, logits = stage.apply(variables, h, method=models.Stage.forward_with_aux)
    assert logits.shape == (2, LENGTH, VOCAB)
  merged = models.merge_variables(stage_vars)
  assert sorted(merged['params']) == [f'layer_{i}' for i in range(4)]


def test_tied_head_multiplies_by_the_embedding_and_stays_in_one_stage():
  model = _model(tied_embeddings=True)
  variables = model.init(jax.random.key(0))
  params = variables['params']
  assert set(params['layer_3']) == {'LayerNorm_0'}
  x = _tokens(1).astype(jnp.float32)
  logits = model.full().apply(variables, x)
  trunk = models.Stage(model.layers[:-1])  # Embedding and blocks: the residual stream.
  stream = trunk.apply(models.stage_variables(variables, trunk), x)
  norm = params['layer_3']['LayerNorm_0']
  mean, var = stream.mean(-1, keepdims=True), stream.var(-1, keepdims=True)
  normed = (stream - mean) / jnp.sqrt(var + 1e-6) * norm['scale'] + norm['bias']
  embedding = params['layer_0']['tokens']['embedding']
  chex.assert_trees_all_close(logits, normed @ embedding.T, atol=1e-5)
  with pytest.raises(ValueError, match=r'ties its output layer.*use stages=1'):
    models.split(model, 2)
  assert len(model.layer_costs()) == 4  # Priced layer by layer all the same.


@pytest.mark.parametrize(
  'fields,message',
  [
    ({'heads': 3}, r'model.heads: 3 heads do not divide model.width=32'),
    ({'heads': 32, 'positions': 'rotary'}, r'head size \(width / heads = 1\) must be even'),
    ({'positions': 'alibi'}, r"model.positions: 'alibi'; allowed: learned, rotary"),
    ({'blocks': 0}, r'model.blocks: must be a positive integer'),
    ({'tied_embeddings': 'yes'}, r'model.tied_embeddings: True or False'),
    ({'depth': 2}, r"model.depth: unknown field for model 'transformer'"),
  ],
)
def test_bad_fields_are_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    _model(**fields)


def test_images_are_refused():
  with pytest.raises(ValueError, match=r'transformer needs token sequences of shape \(T,\)'):
    models.get_model('transformer', (8, 8, 1), 10)


def test_eval_step_counts_tokens_and_masks_padded_examples():
  logits = jax.random.normal(jax.random.key(0), (3, 4, 5))
  labels = jnp.array([[0, 1, 2, 3], [4, 0, 1, 2], [3, 3, 3, 3]])
  mask = jnp.array([1.0, 1.0, 0.0])  # The third example pads the batch.
  step = stage_functions.make_eval_step(lambda v, x, train: logits)
  loss_sum, correct_sum, count = step({}, {'image': jnp.zeros((3, 4)), 'label': labels}, mask)
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits[:2], labels[:2])
  assert count == 8
  np.testing.assert_allclose(loss_sum, per_token.sum(), rtol=1e-6)
  assert correct_sum == (jnp.argmax(logits[:2], -1) == labels[:2]).sum()


def test_ddg_trains_the_language_model_on_the_virtual_clock(data_dir, tmp_path):
  """`ddg.py:lm_smoke` in 2 stages ([embedding, block], [block, head]), virtual clock."""
  config = ddg.get_config('lm_smoke')
  config.update({'data_dir': data_dir, 'train_steps': 20, 'stages': 2})
  # Given costs, not measured ones: the schedule is the same, the test seconds faster.
  config.cost.calibrate = False
  config.cost.compute.update({'forward': 1e-3, 'backward': 2e-3, 'update': 1e-4})
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['step'] for r in records] == [10, 20]
  # 20 steps of 16 windows of 32 bytes; per second of the makespan and of the wall.
  assert summary['tokens'] == 20 * 16 * 32
  rates = summary['tokens_per_second']
  assert rates['simulated'] == pytest.approx(20 * 16 * 32 / summary['sim_time'], rel=1e-12)
  assert rates['wall'] == pytest.approx(20 * 16 * 32 / records[-1]['wall_time'], rel=1e-12)
  # Nats per byte, below a uniform guess over the 256 bytes, and falling.
  assert records[1]['test_loss'] < records[0]['test_loss'] < math.log(256)
  for record in records:  # perplexity: exp(nats per token)
    assert record['test_perplexity'] == pytest.approx(math.exp(record['test_loss']), rel=1e-12)
    assert record['train_perplexity'] == pytest.approx(math.exp(record['train_loss']), rel=1e-12)
  assert records[1]['sim_time'] > 0 and records[1]['staleness_max/stage0'] == 1


def test_a_data_parallel_language_model_reports_its_tokens_and_synchronizations(data_dir, tmp_path):
  """Streaming DiLoCo (H = 8, P = 2, τ = 1) on `:lm_smoke`, 4 workers of 16 windows of 32
  bytes, 12 steps: a fragment every 4 steps merged 1 later (steps 5 and 9: 2 syncs),
  each of half the weights; tokens per second of the last step's simulated time."""
  config = streaming_diloco.get_config('lm_smoke')
  config.update({'data_dir': data_dir, 'train_steps': 12})
  # One per-step program (no cycle programs to compile): the syncs fall on the same steps.
  config.algorithm.update({'stacked': True, 'overlap': False})
  summary = training.train_and_evaluate(config, str(tmp_path), show_progress=False)
  weights = 4 * sum(np.size(x) for x in jax.tree.leaves(_params_of(config)))
  assert summary['communication'] == {
    'synchronizations': 2,
    'steps_between_synchronizations': 4,
    'bytes_per_synchronization': weights / 2,
    'bytes': 2 * weights / 2,
  }
  tokens = 12 * 4 * 16 * 32
  assert summary['tokens'] == tokens
  rates = summary['tokens_per_second']
  assert rates['simulated'] == pytest.approx(tokens / summary['final']['sim_time'], rel=1e-12)


def _params_of(config):
  """The parameters of `config`'s model, as shapes."""
  model = models.get_model(
    config.model.name, (32,), 256, **{k: v for k, v in config.model.items() if k != 'name'}
  )
  return jax.eval_shape(model.init, jax.random.key(0))['params']
