"""The comparisons the five papers make, at CPU size, as suites of configs."""

import dataclasses
import importlib.util
import os

from experiments import report
from jaxsgd.errors import NonFiniteLossError
from jaxsgd.training import train_and_evaluate
from jaxsgd.training import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Method:
  """One line of a comparison: a config file (relative to the repo), its variant (as after
  the `:` of `--config=FILE:VARIANT`) and overrides."""

  label: str
  config: str
  overrides: tuple[tuple[str, object], ...] = ()
  variant: str = ''


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim of a paper, as a row of RESULTS.md's table (`experiments.results_table`).

  `kind`: 'faster' (the method reaches the target sooner in simulated time), 'matches'
  (its final accuracy is the baseline's) or 'better' (its final accuracy is higher);
  `paper`: the paper's figure, in words.
  """

  method: str
  baseline: str
  kind: str
  paper: str


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  title: str
  claim: str  # what the paper reports, to set beside the measurement
  methods: tuple[Method, ...]
  seeds: tuple[int, ...] = (0, 1, 2)
  target_accuracy: float = 0.9
  claims: tuple[Claim, ...] = ()


SUITES: dict[str, Suite] = {}
SMOKE_STEPS = 40


def register(suite: Suite) -> Suite:
  SUITES[suite.name] = suite
  return suite


def load_config(path: str, variant: str = ''):
  """`get_config(variant)` of the config file at `path` (relative to the repo)."""
  spec = importlib.util.spec_from_file_location('suite_config', os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def method_config(method: Method, seed: int, target: float, smoke: bool, profile=None):
  """The run's config; with `profile`, every simulated method whose costs are not given
  explicitly takes its task costs from that one profile file."""
  config = load_config(method.config, smoke_variant(method.variant) if smoke else method.variant)
  config.update_from_flattened_dict(dict(method.overrides))
  if profile and config.clock == 'virtual' and config.cost.calibrate:
    config.cost.profile = profile
  if smoke:  # A smoke run stays seconds long whatever the method's overrides say.
    config.train_steps = min(config.train_steps, SMOKE_STEPS)
    config.eval_every = min(config.eval_every, SMOKE_STEPS // 2)
  config.seed = seed
  config.target_accuracy = target
  return config


def smoke_variant(variant: str) -> str:
  """The seconds-long form of `variant`: `lm` becomes `lm_smoke`, anything else gains
  `smoke` (`'diloco,lm'` -> `'diloco,lm_smoke'`, `''` -> `'smoke'`)."""
  parts = [p for p in variant.split(',') if p]
  if 'lm' in parts:
    return ','.join('lm_smoke' if p == 'lm' else p for p in parts)
  return ','.join(parts + ['smoke'])


def can_reuse(run_dir: str, config) -> bool:
  """Whether `run_dir` holds a finished run of exactly `config` (its summary.json's)."""
  saved = workdir_lib.saved_config(run_dir)
  return saved is not None and workdir_lib.same_config(saved, config)


def run_suite(
  name: str, workdir: str, *, seeds=None, smoke=False, reuse=False, profile=None
) -> str:
  """Runs every method of suite `name` for every seed; returns the report's path.

  Each run goes to `workdir/runs/METHOD/seedN`, replacing what an earlier suite run
  left there; with `reuse`, a run whose `summary.json` records the very config it
  would run (every field: a smoke run is not reused for a full one) is kept instead.
  A run whose loss becomes NaN or infinite (`NonFiniteLossError`) is a result, not a
  crash: the suite goes on and the report lists it as diverged.
  """
  suite = SUITES[name]
  seeds = seeds or (suite.seeds[:1] if smoke else suite.seeds)
  runs, diverged = {}, []
  for method in suite.methods:
    runs[method.label] = []
    for seed in seeds:
      run_dir = os.path.join(workdir, 'runs', _slug(method.label), f'seed{seed}')
      config = method_config(method, seed, suite.target_accuracy, smoke, profile)
      if not (reuse and can_reuse(run_dir, config)):
        try:
          train_and_evaluate(config, run_dir, overwrite=True)
        except NonFiniteLossError as error:
          diverged.append((method.label, seed, str(error)))
          continue
      runs[method.label].append(report.load_run(run_dir))
  return report.write_report(suite, runs, workdir, profile=profile, diverged=diverged)


def _slug(label: str) -> str:
  return ''.join(c if c.isalnum() else '_' for c in label).strip('_').lower()


# --- The suites -------------------------------------------------------------------------
# CPU size: the CNN on MNIST-1D (40k), 2,000 steps of batch 128 (per worker for the
# data-parallel methods), Adam 3e-3 with cosine decay, virtual clock with costs
# calibrated on this machine. The paper-size settings are in each config's docstring.
_CPU = (('train_steps', 2000), ('eval_every', 250))

register(
  Suite(
    name='ddg',
    title='DDG: decoupled backprop with delayed gradients vs BP',
    claim='Huo et al. 2018: DDG matches BP accuracy (CIFAR-10 ResNet-56, K=2: BP 6.97 % vs '
    'DDG 6.89 % test error; ResNet-110 6.41 vs 6.59) and trains faster on K = 2-4 GPUs.',
    methods=(
      Method(
        'BP (staged, K=4)',
        'experiments/configs/default.py',
        _CPU + (('stages', 4), ('clock', 'virtual')),
      ),
      Method('DDG K=2', 'experiments/configs/ddg.py', _CPU + (('stages', 2),)),
      Method('DDG K=3', 'experiments/configs/ddg.py', _CPU + (('stages', 3),)),
      Method('DDG K=4', 'experiments/configs/ddg.py', _CPU + (('stages', 4),)),
    ),
    seeds=(0, 1, 2),
    target_accuracy=0.95,
    claims=(
      Claim(
        'DDG K=2',
        'BP (staged, K=4)',
        'matches',
        'CIFAR-10 ResNet-56, K = 2: 6.89 % test error vs BP 6.97 %',
      ),
      Claim('DDG K=2', 'BP (staged, K=4)', 'faster', 'faster than BP on K = 2-4 GPUs'),
      Claim('DDG K=4', 'BP (staged, K=4)', 'faster', 'faster than BP on K = 2-4 GPUs'),
    ),
  )
)

register(
  Suite(
    name='local',
    title='Local parallelism: BP vs greedy vs overlapping vs chunked (K = 4)',
    claim='Laskin et al. 2020: local methods trade some accuracy at low compute for much '
    'higher parallelism; overlapping beats greedy.',
    methods=(
      Method(
        'BP (staged, K=4)',
        'experiments/configs/default.py',
        _CPU + (('stages', 4), ('clock', 'virtual')),
      ),
      Method('greedy', 'experiments/configs/local.py', _CPU + (('algorithm.variant', 'greedy'),)),
      Method(
        'overlapping',
        'experiments/configs/local.py',
        _CPU + (('algorithm.variant', 'overlapping'),),
      ),
      Method(
        'chunked (2 chunks)',
        'experiments/configs/local.py',
        _CPU + (('algorithm.variant', 'chunked'), ('algorithm.chunks', 2)),
      ),
    ),
    seeds=(0, 1, 2),
    target_accuracy=0.95,
    claims=(
      Claim('overlapping', 'greedy', 'better', 'overlapping beats greedy'),
      Claim('greedy', 'BP (staged, K=4)', 'faster', 'much higher parallelism than BP'),
      Claim('chunked (2 chunks)', 'BP (staged, K=4)', 'faster', 'much higher parallelism than BP'),
    ),
  )
)


def _data_parallel(label, config, workers, name=None):
  overrides = _CPU + (
    ('workers', workers),
    ('algorithm.stacked', True),
    ('cost.calibrate', False),
    ('cost.compute.step', 0.005),
    ('cost.link_bandwidth', 1.25e8),
  )  # 1 Gbit/s
  if name:
    overrides += (('algorithm.name', name),)
  return Method(label, config, overrides)


register(
  Suite(
    name='dasgd',
    title='DaSGD: SSGD vs local SGD vs DaSGD, 4 and 8 workers',
    claim='Zhou et al. 2020: DaSGD converges like SGD (O(1/sqrt(K))), hides 100 % of the '
    'communication and scales linearly (analytic simulator, up to 256 V100s).',
    methods=tuple(
      m
      for workers in (4, 8)
      for m in (
        _data_parallel(f'SSGD M={workers}', 'experiments/configs/ssgd.py', workers),
        _data_parallel(
          f'local SGD M={workers}', 'experiments/configs/dasgd.py', workers, 'local_sgd'
        ),
        _data_parallel(f'DaSGD M={workers}', 'experiments/configs/dasgd.py', workers, 'dasgd'),
      )
    ),
    seeds=(0, 1, 2),
    target_accuracy=0.95,
    claims=(
      Claim('DaSGD M=4', 'SSGD M=4', 'matches', 'converges like SGD, O(1/sqrt(K))'),
      Claim('DaSGD M=4', 'SSGD M=4', 'faster', '100 % of the communication hidden'),
      Claim('DaSGD M=8', 'SSGD M=8', 'faster', 'linear scale-up (analytic simulator, 256 V100s)'),
    ),
  )
)

_SGD = (('optimizer.name', 'sgd'), ('optimizer.learning_rate', 0.2))
# The asynchronous methods run with the scheduler's default free links; SSGD beside
# them gets free links too, so the suites compare compute and staleness alone.
_FREE_LINKS = (('cost.link_bandwidth', 0.0), ('cost.link_latency', 0.0))


def _straggler(workers: int) -> tuple[tuple[str, object], ...]:
  """The last of `workers` lanes runs 4x slower."""
  return (('cost.speeds', (1.0,) * (workers - 1) + (0.25,)),)


def _dc_methods(workers: int, stragglers: bool) -> tuple[Method, ...]:
  tag = f'M={workers}' + (', straggler' if stragglers else '')
  slow = _straggler(workers) if stragglers else ()
  asgd = _CPU + _SGD + (('workers', workers),) + slow
  methods = (
    Method(f'ASGD {tag}', 'experiments/configs/asgd.py', asgd),
    Method(
      f'DC-ASGD-c {tag}',
      'experiments/configs/dcasgd.py',
      asgd + (('algorithm.lambda0', 0.04), ('algorithm.adaptive', False)),
    ),
    Method(
      f'DC-ASGD-a {tag}',
      'experiments/configs/dcasgd.py',
      asgd + (('algorithm.lambda0', 2.0), ('algorithm.adaptive', True)),
    ),
  )
  if not stragglers:  # SSGD: same samples (2,000 x 128) in 2,000 / M synchronous steps.
    methods = (
      Method(
        f'SSGD {tag}',
        'experiments/configs/ssgd.py',
        _SGD
        + _FREE_LINKS
        + (
          ('workers', workers),
          ('batch_size', 128),
          ('train_steps', 2000 // workers),
          ('eval_every', 250 // workers),
          ('algorithm.stacked', True),
        ),
      ),
    ) + methods
  return methods


register(
  Suite(
    name='dcasgd',
    title='DC-ASGD: sequential SGD, ASGD, SSGD, DC-ASGD-c, DC-ASGD-a',
    claim='Zheng et al. 2017, CIFAR-10 ResNet-20 test error: 4 workers - sequential SGD '
    '8.65, ASGD 9.27, SSGD 9.17, DC-ASGD-c 8.67, DC-ASGD-a 8.19 %; 8 workers - ASGD '
    '10.26, SSGD 10.10, DC-ASGD-c 9.27, DC-ASGD-a 8.57 %.',
    methods=(Method('sequential SGD', 'experiments/configs/default.py', _CPU + _SGD),)
    + _dc_methods(4, False)
    + _dc_methods(8, False)
    + _dc_methods(8, True),
    seeds=(0, 1, 2),
    target_accuracy=0.95,
    claims=(
      Claim(
        'DC-ASGD-a M=4', 'ASGD M=4', 'better', 'CIFAR-10 ResNet-20: 8.19 % test error vs 9.27 %'
      ),
      Claim(
        'DC-ASGD-a M=8', 'ASGD M=8', 'better', 'CIFAR-10 ResNet-20: 8.57 % test error vs 10.26 %'
      ),
      Claim(
        'DC-ASGD-c M=8', 'ASGD M=8', 'better', 'CIFAR-10 ResNet-20: 9.27 % test error vs 10.26 %'
      ),
      Claim('ASGD M=4', 'SSGD M=4', 'matches', 'CIFAR-10 ResNet-20: 9.27 % test error vs 9.17 %'),
    ),
  )
)


def _pd_methods(stragglers: bool) -> tuple[Method, ...]:
  """PD-ASGD and its baselines on 3 simulated devices (worker lanes)."""
  tag = ', straggler' if stragglers else ''
  slow = _straggler(3) if stragglers else ()
  methods = (
    Method(f'PD-ASGD 1:2{tag}', 'experiments/configs/pdasgd.py', _CPU + slow),
    Method(
      f'PD-ASGD 2:1{tag}',
      'experiments/configs/pdasgd.py',
      _CPU + slow + (('algorithm.n_fwd', 2), ('algorithm.n_bwd', 1)),
    ),
    Method(
      f'LPP-SGD 3x2{tag}',
      'experiments/configs/lppsgd.py',
      _CPU + (('cost.speeds', (1.0,) * 4 + (0.25,) * 2),) if stragglers else _CPU,
    ),
    Method(f'ASGD M=3{tag}', 'experiments/configs/asgd.py', _CPU + slow + (('workers', 3),)),
  )
  if not stragglers:
    methods += (
      Method(
        'SSGD M=3',
        'experiments/configs/ssgd.py',
        _FREE_LINKS
        + (
          ('workers', 3),
          ('batch_size', 128),
          ('train_steps', 667),
          ('eval_every', 83),
          ('algorithm.stacked', True),
        ),
      ),
    )
  return methods


register(
  Suite(
    name='pdasgd',
    title='PD-ASGD vs LPP-SGD vs ASGD vs SSGD, 3 devices, with and without a straggler',
    claim='Teguemne Fokam et al. 2024: close to state-of-the-art accuracy while up to 2.97x '
    'faster than LPP-SGD (Hogwild! on several devices); later versions up to 5.95x over '
    'synchronous data parallelism under injected delays and 2.14x over comparable ASGD '
    '(CIFAR-10/100 ResNet-18/34, 3 GPUs).',
    methods=_pd_methods(False) + _pd_methods(True),
    seeds=(0, 1, 2),
    target_accuracy=0.95,
    claims=(
      Claim('PD-ASGD 1:2', 'LPP-SGD 3x2', 'faster', 'up to 2.97x faster (3 GPUs)'),
      Claim('PD-ASGD 1:2', 'ASGD M=3', 'faster', '2.14x over comparable ASGD (3 GPUs)'),
      Claim(
        'PD-ASGD 1:2',
        'SSGD M=3',
        'faster',
        'up to 5.95x over synchronous data parallelism under injected delays (none here)',
      ),
    ),
  )
)


# --- The language model -----------------------------------------------------------------
# Every family on the byte-level transformer (`:lm`, docs/language_models.md): 600 steps,
# each on 32 windows of 64 bytes — per step for the one-model methods, per update for
# the asynchronous ones, summed over the 4 workers for the data-parallel ones (8 windows
# each) — so every method sees the same 19,200 windows (~1.2M predicted bytes); Adam
# 3e-3 (the :lm config's 1e-3 is for 2,000 steps). The data-parallel methods sync
# over links of 1 Gbit/s, every step (SSGD) or every H = 8 steps.
_LM_STEPS = 600
_LM = (('train_steps', _LM_STEPS), ('eval_every', 100), ('optimizer.learning_rate', 3e-3))
_LM_SYNC = _LM + (
  ('workers', 4),
  ('batch_size', 8),
  ('algorithm.stacked', True),
  ('cost.link_bandwidth', 1.25e8),
)
_LM_PERIOD = (('algorithm.period', 8),)


def _lm(label, config, *overrides, variant='lm') -> Method:
  return Method(label, f'experiments/configs/{config}.py', tuple(overrides), variant)


register(
  Suite(
    name='lm',
    title='Every family on a byte-level transformer (pydoc_bytes, 19,200 windows of 64 bytes)',
    claim='Douillard et al. 2023 (DiLoCo): 8 workers with H = 500 inner steps match fully '
    'synchronous training on C4 with 500x less communication. Douillard et al. 2025 '
    '(Streaming DiLoCo): fragments synced in turn reach the same loss with far less peak '
    'bandwidth. Liu et al. 2024: asynchronous local SGD with delayed Nesterov outer steps '
    'matches synchronous local SGD in perplexity per update. The image-model papers '
    '(DDG, local losses, DC-ASGD, PD-ASGD, DaSGD) as in their own suites.',
    methods=(
      _lm('BP (staged, K=4)', 'default', *_LM, ('stages', 4), ('clock', 'virtual')),
      _lm('DDG K=2', 'ddg', *_LM, ('stages', 2)),
      _lm('DDG K=4', 'ddg', *_LM, ('stages', 4)),
      _lm('greedy (K=4)', 'local', *_LM, ('algorithm.variant', 'greedy')),
      _lm('ASGD M=4', 'asgd', *_LM),
      _lm('DC-ASGD-a M=4', 'dcasgd', *_LM),
      _lm('PD-ASGD 1:2', 'pdasgd', *_LM),
      _lm('LPP-SGD 3x2', 'lppsgd', *_LM),
      _lm(
        'async local SGD M=4',
        'async_local_sgd',
        ('train_steps', _LM_STEPS // 8),
        ('eval_every', 100 // 8),
        ('optimizer.learning_rate', 3e-3),
        ('algorithm.inner_steps', 8),
      ),
      _lm('SSGD M=4', 'ssgd', *_LM_SYNC),
      _lm('local SGD M=4', 'dasgd', *_LM_SYNC, *_LM_PERIOD, variant='local_sgd,lm'),
      _lm('DaSGD M=4', 'dasgd', *_LM_SYNC, *_LM_PERIOD),
      _lm('DiLoCo M=4', 'dasgd', *_LM_SYNC, *_LM_PERIOD, variant='diloco,lm'),
      _lm('streaming DiLoCo M=4, P=2', 'streaming_diloco', *_LM_SYNC, *_LM_PERIOD),
    ),
    seeds=(0, 1, 2),
    target_accuracy=0.45,
    claims=(
      Claim(
        'DDG K=2', 'BP (staged, K=4)', 'matches', 'CIFAR-10 ResNet-56, K = 2: 6.89 % vs 6.97 %'
      ),
      Claim('DDG K=2', 'BP (staged, K=4)', 'faster', 'faster than BP on K = 2-4 GPUs'),
      Claim('DDG K=4', 'BP (staged, K=4)', 'faster', 'faster than BP on K = 2-4 GPUs'),
      Claim('greedy (K=4)', 'BP (staged, K=4)', 'faster', 'much higher parallelism than BP'),
      Claim('DC-ASGD-a M=4', 'ASGD M=4', 'better', 'CIFAR-10 ResNet-20: 8.19 % vs 9.27 %'),
      Claim('PD-ASGD 1:2', 'LPP-SGD 3x2', 'faster', 'up to 2.97x faster (3 GPUs)'),
      Claim('DaSGD M=4', 'SSGD M=4', 'matches', 'converges like SGD, O(1/sqrt(K))'),
      Claim('DiLoCo M=4', 'SSGD M=4', 'matches', 'C4, 8 workers, H = 500: matches synchronous'),
      Claim('DiLoCo M=4', 'SSGD M=4', 'faster', '500x less communication'),
      Claim(
        'streaming DiLoCo M=4, P=2',
        'DiLoCo M=4',
        'matches',
        'same loss, peak bandwidth / P',
      ),
      Claim(
        'async local SGD M=4',
        'local SGD M=4',
        'matches',
        'matches synchronous local SGD per update (C4)',
      ),
    ),
  )
)
