# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= runs/demo
CONFIG ?= experiments/configs/default.py
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# Re-install only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train --config=$(CONFIG) --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

bench: $(STAMP)
	$(PY) -m benchmarks.step_time

clean:
	rm -rf $(VENV) runs .pytest_cache
