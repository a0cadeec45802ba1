"""The package's layers only look down: no module imports from a higher layer.

The order is written once, here (docs/architecture.md explains it). Every import is
checked, including those inside functions, so a cycle cannot hide behind a lazy import.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. Packages in one layer may not import each other.
LAYERS = (
  (
    'jaxsgd.errors',
    'jaxsgd.transforms',
    'jaxsgd.models',
    'jaxsgd.data',
    'jaxsgd.optimizers',
  ),  # foundations
  ('jaxsgd.scheduler',),  # the engine
  ('jaxsgd.pipeline', 'jaxsgd.spmd'),  # policies
  ('jaxsgd.asynchronous',),  # policies built on stage functions
  ('jaxsgd.algorithms',),  # config -> settings, one shape
  ('jaxsgd.training',),  # run, metrics, plots, files
  ('jaxsgd.launch', 'jaxsgd', 'experiments', 'benchmarks'),  # binaries, the package root
)
# The engine never reads a config nor writes a workdir's files.
ENGINE_FORBIDDEN = ('ml_collections', 'absl')


def _package(module: str) -> str:
  """The layer entry of `module`: the longest prefix named in LAYERS."""
  names = [name for layer in LAYERS for name in layer]
  matches = [n for n in names if module == n or module.startswith(n + '.')]
  if not matches:
    raise AssertionError(f'{module}: not in any layer of tests/test_layers.py')
  return max(matches, key=len)


def _layer(package: str) -> int:
  return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _modules():
  for top in ('jaxsgd', 'experiments', 'benchmarks'):
    for path in sorted((ROOT / top).rglob('*.py')):
      parts = path.relative_to(ROOT).with_suffix('').parts
      yield '.'.join(parts[:-1] if parts[-1] == '__init__' else parts), path


def _imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module
      yield from (f'{node.module}.{alias.name}' for alias in node.names)


def _violations():
  found = []
  for module, path in _modules():
    source = _package(module)
    for imported in _imports(path):
      if imported.split('.')[0] not in ('jaxsgd', 'experiments', 'benchmarks'):
        if source == 'jaxsgd.scheduler' and imported.split('.')[0] in ENGINE_FORBIDDEN:
          found.append(f'{module} imports {imported} (the engine reads no config)')
        continue
      try:
        target = _package(imported)
      except AssertionError:
        continue  # `from jaxsgd.x import name`: the module itself was checked above.
      if target == source or target == 'jaxsgd':
        continue
      sibling = _layer(target) == _layer(source) and _layer(source) < len(LAYERS) - 1
      if _layer(target) > _layer(source) or sibling:
        found.append(
          f'{module} (layer {_layer(source)}) imports {imported} (layer {_layer(target)})'
        )
  return sorted(set(found))


def test_no_module_imports_a_higher_or_sibling_layer():
  assert _violations() == []


def test_the_check_catches_an_upward_import():
  bad = ROOT / 'jaxsgd' / 'scheduler' / '_layer_probe.py'
  bad.write_text('from jaxsgd.training import run\nimport ml_collections\n')
  try:
    found = _violations()
  finally:
    bad.unlink()
  assert any(
    v.startswith('jaxsgd.scheduler._layer_probe (layer 1) imports jaxsgd.training') for v in found
  )
  assert any('_layer_probe imports ml_collections' in v for v in found)


@pytest.mark.parametrize(
  'module', ['jaxsgd.scheduler.virtual', 'jaxsgd.pipeline.session', 'jaxsgd.training.loop']
)
def test_every_module_has_a_layer(module):
  assert _package(module) != 'jaxsgd'
