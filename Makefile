# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= runs/demo
CONFIG ?= experiments/configs/default.py
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format bench clean

setup: $(STAMP)

# Re-install only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train --config=$(CONFIG) --workdir=$(WORKDIR)

test: lint
	$(PY) -m pytest -q --durations=15

# The whole tree passes the formatter and the linter (configured in pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) -m benchmarks.step_time

clean:
	rm -rf $(VENV) runs .pytest_cache
