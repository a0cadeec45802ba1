"""The comparisons the five papers make, at CPU size, as suites of configs."""

import dataclasses
import importlib.util
import os

from experiments import report
from jaxsgd.training import train_and_evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Method:
  """One line of a comparison: a config file (relative to the repo) plus overrides."""

  label: str
  config: str
  overrides: tuple[tuple[str, object], ...] = ()


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  title: str
  claim: str             # what the paper reports, to set beside the measurement
  methods: tuple[Method, ...]
  seeds: tuple[int, ...] = (0, 1, 2)
  target_accuracy: float = 0.9


SUITES: dict[str, Suite] = {}


def register(suite: Suite) -> Suite:
  SUITES[suite.name] = suite
  return suite


def load_config(path: str, variant: str = ''):
  """`get_config(variant)` of the config file at `path` (relative to the repo)."""
  spec = importlib.util.spec_from_file_location('suite_config', os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def method_config(method: Method, seed: int, target: float, smoke: bool):
  config = load_config(method.config, 'smoke' if smoke else '')
  for field, value in method.overrides:
    parent, _, leaf = field.rpartition('.')
    node = config
    for part in filter(None, parent.split('.')):
      node = node[part]
    node[leaf] = value
  config.seed = seed
  config.target_accuracy = target
  return config


def run_suite(name: str, workdir: str, *, seeds=None, smoke=False, reuse=False) -> str:
  """Runs every method of suite `name` for every seed; returns the report's path."""
  suite = SUITES[name]
  seeds = seeds or (suite.seeds[:1] if smoke else suite.seeds)
  runs = {}
  for method in suite.methods:
    runs[method.label] = []
    for seed in seeds:
      run_dir = os.path.join(workdir, 'runs', _slug(method.label), f'seed{seed}')
      if not (reuse and os.path.exists(os.path.join(run_dir, 'summary.json'))):
        config = method_config(method, seed, suite.target_accuracy, smoke)
        train_and_evaluate(config, run_dir)
      runs[method.label].append(report.load_run(run_dir))
  return report.write_report(suite, runs, workdir)


def _slug(label: str) -> str:
  return ''.join(c if c.isalnum() else '_' for c in label).strip('_').lower()


