"""The comparison runner: runs a suite's methods and seeds, writes the report."""

import json
import os

import numpy as np

from experiments import report
from experiments import suites


def test_suite_runs_every_method_and_seed_and_writes_a_report(tmp_path, data_dir):
  suite = suites.Suite(
    name='test_two_bp',
    title='Two learning rates',
    claim='none',
    methods=(
      suites.Method(
        'BP lr=3e-3',
        'experiments/configs/default.py',
        (('data_dir', data_dir), ('train_steps', 40)),
      ),
      suites.Method(
        'BP lr=1e-4',
        'experiments/configs/default.py',
        (('data_dir', data_dir), ('train_steps', 40), ('optimizer.learning_rate', 1e-4)),
      ),
    ),
    seeds=(0, 1),
    target_accuracy=0.3,
  )
  suites.register(suite)
  path = suites.run_suite('test_two_bp', str(tmp_path), smoke=True, seeds=(0, 1))
  text = open(path).read()
  rows = [line for line in text.splitlines() if line.startswith('| BP')]
  assert len(rows) == 2 and '| 2 |' in rows[0]
  for label, lr in (('bp_lr_3e_3', 3e-3), ('bp_lr_1e_4', 1e-4)):
    for seed in (0, 1):
      saved = json.load(open(tmp_path / 'runs' / label / f'seed{seed}' / 'summary.json'))
      assert saved['config']['seed'] == seed
      assert saved['config']['optimizer']['learning_rate'] == lr
      assert saved['config']['train_steps'] == 40  # The override beats the smoke value.
  assert (tmp_path / 'accuracy.png').stat().st_size > 10_000
  assert not (tmp_path / 'staleness.png').exists()  # BP records no staleness.
  assert 'No staleness plot' in text
  # 40 steps: checked every step (ceil of 1 %), 2.5 % of the run.
  assert 'checked every step of a 40-step run' in text and 'to 2.5 % of the run' in text
  data = json.load(open(tmp_path / 'report.json'))
  assert data['suite'] == 'test_two_bp' and data['target_accuracy'] == 0.3
  fast = data['methods']['BP lr=3e-3']
  assert fast['seeds'] == [0, 1] and fast['final_accuracy']['n'] == 2
  assert fast['resolution_steps'] == 1 and fast['resolution_checked']


def test_a_diverged_run_is_reported_and_the_suite_goes_on(tmp_path, data_dir):
  base = (('data_dir', data_dir), ('train_steps', 20))
  suite = suites.Suite(
    name='test_diverges',
    title='One method diverges',
    claim='none',
    methods=(
      suites.Method(
        'SGD lr=1e9',
        'experiments/configs/default.py',
        base + (('optimizer.name', 'sgd'), ('optimizer.learning_rate', 1e9)),
      ),
      suites.Method('BP', 'experiments/configs/default.py', base),
    ),
    seeds=(0,),
    target_accuracy=0.3,
  )
  suites.register(suite)
  text = open(suites.run_suite('test_diverges', str(tmp_path), smoke=True)).read()
  assert [line.split(' | ')[0] for line in text.splitlines() if line.startswith('| ')][1:] == [
    '| BP'
  ]  # The header, then BP alone: the diverged method has no row.
  assert '- SGD lr=1e9, seed 0: training loss became' in text


def test_table_rows_hand_computed():
  def run(acc, hit):
    return {
      'summary': {'final': {'test_accuracy': acc}, 'mean_staleness': 2.0, 'time_to_target': hit},
      'records': [{'wall_time': 10.0, 'sim_time': 4.0}],
    }

  rows = report.table_rows(
    {'A': [run(0.90, {'step': 5, 'sim_time': 1.0, 'wall_time': 3.0}), run(0.94, None)]}
  )
  # mean 92.00, sample std of (90, 94) = 2.83; one of two runs reached the target.
  assert rows == [['A', '2', '92.00 ± 2.83', '1/2', '1', '3.0', '2.00', '4 ± 0', '10.0']]
  slower = run(0.94, {'step': 5, 'sim_time': 3.0, 'wall_time': 3.0})
  slower['records'] = [{'wall_time': 10.0, 'sim_time': 6.0}]
  rows = report.table_rows(
    {'B': [run(0.90, {'step': 5, 'sim_time': 1.0, 'wall_time': 3.0}), slower]}
  )
  # Simulated times to target (1, 3) and in all (4, 6): mean ± sample std √2 = 1.4.
  assert rows[0][4] == '2 ± 1.4' and rows[0][7] == '5 ± 1.4'


def test_language_model_rows_hand_computed():
  def run(perplexity, rates, sent=None):
    summary = {'final': {'test_perplexity': perplexity}, 'tokens_per_second': rates}
    return {'summary': {**summary, **({'communication': sent} if sent else {})}}

  sync = {'synchronizations': 75, 'bytes_per_synchronization': 986_112.0}
  rows = report.language_model_rows(
    {
      'BP': [run(5.0, {'wall': 900.0, 'simulated': 40_000.0}), run(6.0, {'wall': 1100.0})],
      'DiLoCo': [run(4.5, {'wall': 500.0, 'simulated': 60_000.0}, sync)],
    }
  )
  # BP: mean 5.5, sample sd of (5, 6) = 0.71; simulated rate of the one run that has it.
  assert rows == [
    ['BP', '5.5 ± 0.71', '40,000', '1,000', '—', '—'],
    ['DiLoCo', '4.5', '60,000', '500', '75', '0.986'],
  ]
  image_model = {'summary': {'final': {'test_accuracy': 0.9}}}
  assert report.language_model_rows({'BP': [image_model]}) == []


def test_seed_band_is_mean_and_min_max_on_the_union_of_times():
  def run(times, accuracies):
    return {'records': [{'sim_time': t, 'test_accuracy': a} for t, a in zip(times, accuracies)]}

  # Seed b, interpolated at 1.5 and 2.0: 0.3, 0.4; seed a at 2.5: 0.55. Span: 1.5 to 3.0.
  times, mean, low, high = report.seed_band(
    [run([1.0, 2.0, 3.0], [0.2, 0.5, 0.6]), run([1.5, 2.5, 3.5], [0.3, 0.5, 0.7])]
  )
  np.testing.assert_allclose(times, [1.5, 2.0, 2.5, 3.0])
  np.testing.assert_allclose(low, [30, 40, 50, 60])
  np.testing.assert_allclose(high, [35, 50, 55, 60])
  np.testing.assert_allclose(mean, [32.5, 45, 52.5, 60])


def test_the_perplexity_plot_bands_each_methods_seeds(tmp_path):
  def run(times, perplexities):
    records = [{'sim_time': t, 'test_perplexity': p} for t, p in zip(times, perplexities)]
    return {'records': records}

  seeds = [run([1.0, 2.0], [8.0, 6.0]), run([1.0, 2.0], [10.0, 5.0])]
  times, mean, low, high = report.seed_band(seeds, lambda r: r['test_perplexity'])
  np.testing.assert_allclose(mean, [9.0, 5.5])
  np.testing.assert_allclose(low, [8.0, 5.0])
  np.testing.assert_allclose(high, [10.0, 6.0])
  report.plot_perplexity({'A': seeds, 'B': seeds[:1]}, str(tmp_path / 'perplexity.png'))
  assert (tmp_path / 'perplexity.png').stat().st_size > 0


def test_every_registered_suite_has_valid_configs(data_dir):
  from jaxsgd import training  # pylint: disable=g-import-not-at-top

  assert {'ddg', 'local', 'dasgd'} <= set(suites.SUITES)
  for suite in suites.SUITES.values():
    labels = {method.label for method in suite.methods}
    assert all({c.method, c.baseline} <= labels for c in suite.claims), suite.name
    assert all(c.kind in ('faster', 'matches', 'better') for c in suite.claims)
    for method in suite.methods:
      config = suites.method_config(method, seed=0, target=suite.target_accuracy, smoke=True)
      config.data_dir = data_dir
      training.check_config(config)  # Names, ranges, algorithm: no compile, no data.
      assert config.train_steps <= suites.SMOKE_STEPS


def test_a_smoke_run_takes_the_seconds_long_form_of_its_methods_variant():
  assert suites.smoke_variant('') == 'smoke'
  assert suites.smoke_variant('lm') == 'lm_smoke'
  assert suites.smoke_variant('diloco,lm') == 'diloco,lm_smoke'
  assert suites.smoke_variant('diloco') == 'diloco,smoke'


def test_every_method_of_the_language_model_suite_sees_the_same_19200_windows():
  """Per step for the one-model methods, per update for the asynchronous ones (H inner
  batches each for asynchronous local SGD), summed over the workers for data-parallel."""
  data_parallel = ('ssgd', 'local_sgd', 'dasgd', 'diloco', 'streaming_diloco')
  for method in suites.SUITES['lm'].methods:
    config = suites.method_config(method, seed=0, target=0.45, smoke=False)
    assert config.model.name == 'transformer' and config.dataset == 'pydoc_bytes/64'
    windows = config.train_steps * config.batch_size
    if config.algorithm.name in data_parallel:
      windows *= config.workers
    if config.algorithm.name == 'async_local_sgd':
      windows *= config.algorithm.inner_steps
    assert windows == 19_200, method.label


def test_every_paper_config_has_a_valid_full_size_variant():
  from jaxsgd import training  # pylint: disable=g-import-not-at-top

  for name in ('ddg', 'local', 'dasgd', 'ssgd', 'asgd', 'dcasgd', 'lppsgd', 'pdasgd'):
    config = suites.load_config(f'experiments/configs/{name}.py', 'full')
    training.check_config(config)
    assert config.dataset == 'cifar10' and config.model.name.startswith('resnet')
    assert config.optimizer.schedule == 'step' and config.train_steps >= 60_000


def test_reuse_keeps_only_runs_of_the_same_config(tmp_path, data_dir, monkeypatch):
  """`--reuse` keeps a run whose summary.json records the config it would run; a run
  of other settings (here: a smoke run, for a 30-step suite) is run again."""
  trained = []
  real = suites.train_and_evaluate
  monkeypatch.setattr(
    suites,
    'train_and_evaluate',
    lambda config, workdir, **kw: (trained.append(config.train_steps), real(config, workdir, **kw))[
      1
    ],
  )

  def suite(steps):
    return suites.register(
      suites.Suite(
        name='test_reuse',
        title='reuse',
        claim='none',
        seeds=(0,),
        target_accuracy=0.3,
        methods=(
          suites.Method(
            'BP',
            'experiments/configs/default.py',
            (('data_dir', data_dir), ('train_steps', steps), ('eval_every', 10)),
          ),
        ),
      )
    )

  run_dir = tmp_path / 'runs' / 'bp' / 'seed0'
  suite(20)
  suites.run_suite('test_reuse', str(tmp_path), smoke=True)
  assert trained == [20]
  suites.run_suite('test_reuse', str(tmp_path), smoke=True, reuse=True)
  assert trained == [20]  # Same config: reused.
  suite(30)
  suites.run_suite('test_reuse', str(tmp_path), smoke=True, reuse=True)
  assert trained == [20, 30]  # Another config: run again, replacing the earlier files.
  assert json.load(open(run_dir / 'summary.json'))['config']['train_steps'] == 30
  assert sorted(os.listdir(run_dir)) == ['curves.png', 'metrics.jsonl', 'summary.json']
  assert suites.can_reuse(
    str(run_dir), suites.method_config(suites.SUITES['test_reuse'].methods[0], 0, 0.3, smoke=True)
  )
  assert not suites.can_reuse(
    str(run_dir), suites.method_config(suites.SUITES['test_reuse'].methods[0], 1, 0.3, smoke=True)
  )  # Another seed.


def test_a_suite_profile_reaches_every_simulated_method_that_measures_its_costs():
  from experiments import suites  # pylint: disable=g-import-not-at-top

  suite = suites.SUITES['dcasgd']
  configs = [suites.method_config(m, 0, 0.9, True, '/tmp/p.json') for m in suite.methods]
  measured = [c for c in configs if c.clock == 'virtual' and c.cost.calibrate]
  assert measured and all(c.cost.profile == '/tmp/p.json' for c in measured)
  explicit = [c for c in configs if not c.cost.calibrate]
  assert all(c.cost.profile is None for c in explicit)
