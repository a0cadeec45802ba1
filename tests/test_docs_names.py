"""Every dotted `jaxsgd.` name the README, RESULTS.md and docs/ mention exists.

A doc names code in backticks (`jaxsgd.scheduler.lanes.cluster.connect_soon`, or in a
fenced block: `python -m jaxsgd.launch`). Each such name is resolved as Python would:
the longest prefix that imports as a module, then attributes for the rest. A name that
does not resolve is a doc that no longer says what the code is.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / 'README.md', ROOT / 'RESULTS.md', *sorted((ROOT / 'docs').glob('*.md'))]

_FENCE = re.compile(r'^(```|~~~).*?^\1', re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r'`([^`\n]+)`')
_NAME = re.compile(r'(?<![\w./-])jaxsgd(?:\.[A-Za-z_]\w*)+')


def names_in(text: str) -> set[str]:
  """The dotted `jaxsgd.` names inside backticks: inline spans and fenced blocks."""
  fenced = [m.group(0) for m in _FENCE.finditer(text)]
  spans = _SPAN.findall(_FENCE.sub('', text))
  return {name for chunk in fenced + spans for name in _NAME.findall(chunk)}


def resolves(name: str) -> bool:
  """Whether `name` is a module, or a module's attribute (nested attributes too)."""
  parts = name.split('.')
  for cut in range(len(parts), 0, -1):
    try:
      value = importlib.import_module('.'.join(parts[:cut]))
    except ModuleNotFoundError as e:
      if e.name is not None and not '.'.join(parts[:cut]).startswith(e.name):
        raise  # The module exists but one of its own imports is missing.
      continue
    for attribute in parts[cut:]:
      if not hasattr(value, attribute):
        return False
      value = getattr(value, attribute)
    return True
  return False


def test_names_are_found_in_the_docs():
  found = {doc.name: names_in(doc.read_text()) for doc in DOCS}
  assert sum(map(len, found.values())) > 10, found  # the scan itself works


@pytest.mark.parametrize('doc', DOCS, ids=lambda doc: doc.name)
def test_every_dotted_name_a_doc_mentions_exists(doc):
  broken = sorted(name for name in names_in(doc.read_text()) if not resolves(name))
  assert not broken, f'{doc.relative_to(ROOT)} names what does not exist: {broken}'


def test_a_bogus_name_does_not_resolve():
  assert resolves('jaxsgd.scheduler.lanes.cluster.connect_soon')
  assert not resolves('jaxsgd.scheduler.lanes.cluster.no_such_function')
  assert not resolves('jaxsgd.no_such_module.anything')
  assert names_in('a `jaxsgd.a.b(x)` and\n```\npython -m jaxsgd.c\n```\n') == {
    'jaxsgd.a.b',
    'jaxsgd.c',
  }
