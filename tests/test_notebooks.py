"""Every notebook runs, in smoke size, and its .ipynb is in sync with its .md source.

Notebooks are kept as jupytext markdown (`notebooks/*.md`, the reviewed source) paired
with `.ipynb` (what Colab opens). `JAXSGD_SMOKE=1` makes each notebook shrink its runs.
"""

import glob
import os

import jupytext
import nbclient
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, 'notebooks', '*.md')))
SLOW = ('05_which_method_for_my_cluster.md',)  # eight smoke runs, one per method


def _sources(notebook):
  return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_ipynb_is_paired_with_the_markdown_source(path):
  paired = path[: -len('.md')] + '.ipynb'
  assert os.path.exists(paired), f'run: jupytext --sync {path}'
  assert _sources(jupytext.read(path)) == _sources(jupytext.read(paired)), (
    f'{paired} is out of date; run: jupytext --sync {path}'
  )


@pytest.mark.parametrize(
  'path',
  [
    pytest.param(p, marks=pytest.mark.slow) if os.path.basename(p) in SLOW else p for p in NOTEBOOKS
  ],
  ids=os.path.basename,
)
def test_notebook_executes_in_smoke_size(path, tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv('JAXSGD_SMOKE', '1')
  monkeypatch.setenv('TFDS_DATA_DIR', data_dir)
  monkeypatch.setenv('PYTHONPATH', REPO)
  notebook = jupytext.read(path)
  client = nbclient.NotebookClient(
    notebook, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}}
  )
  client.execute()
  errors = [
    o
    for c in notebook.cells
    if c.cell_type == 'code'
    for o in c.get('outputs', [])
    if o.get('output_type') == 'error'
  ]
  assert not errors
