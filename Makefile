# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= runs/demo
CONFIG ?= experiments/configs/default.py
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format bench device-wheels clean

setup: $(STAMP)

# Re-install only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train --config=$(CONFIG) --workdir=$(WORKDIR)

# The tests in TEST_WORKERS processes (pytest-xdist, a file's tests in one of them, the files
# handed out in tests/conftest.py's order: those with slow tests first), then
# those marked `alone` (they bound how long a fault takes to end a run) with nothing
# beside them; the second phase runs even if the first failed, and the status is the
# first failure's. Both phases share one XLA compilation cache (tests/conftest.py uses
# JAX_COMPILATION_CACHE_DIR when it is set). Plain `pytest` runs them all in one process.
TEST_WORKERS ?= 2
test: lint
	@cache=$$(mktemp -d -t jaxsgd-tests-xla-cache-XXXXXX); trap 'rm -rf "$$cache"' EXIT; \
	export JAX_COMPILATION_CACHE_DIR="$$cache"; status=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m 'not alone' --durations=15 || status=$$?; \
	$(PY) -m pytest -q -m alone --durations=5 || { [ $$status -ne 0 ] || status=$$?; }; \
	exit $$status

# The whole tree passes the formatter and the linter (configured in pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) -m benchmarks.step_time

# What a lent GPU machine's image lacks for `python -m benchmarks.device_round`, in .whl/
# (carried there with the tree): Ray's wheel without its Java jars, and Ray's needs.
device-wheels: $(STAMP)
	$(PY) -m benchmarks.device_round --wheels .whl

clean:
	rm -rf $(VENV) runs .pytest_cache
