# Entry points (see README): `make demo` and `make test`. Both create .venv if missing.
# `make test` = lint + types + the whole test suite (fast and slow lanes), the core's tests under branch
# coverage with floors. `make test-fast` skips the slow lane (subprocess CLI and demo runs).
# TORCH picks the PyTorch build. torch==2.13.0 resolves to the CPU wheel on the project's
# build machines; on a GPU box pass e.g. TORCH="torch==2.13.0 --index-url <your CUDA index>".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
# Coverage floors (percent of lines and branches), set at what the suite measures; raise, never lower.
PROTOCOL_FLOOR := 100
CODEC_FLOOR := 100

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'

demo: install
	$(BIN)/splitspec demo

test: install cluster lint types coverage

# Ray Serve (the optional 'cluster' extra) for the test of `cloud serve --ray-replicas`
# (tests/cloud/test_ray_serve.py, which skips without it); `make demo` does not need it.
cluster: install
	$(BIN)/pip install -q -e '.[cluster]'

# ruff lint rules (pyproject: [tool.ruff.lint], PT included) and the formatter, as checks; the benchmarks and
# scripts too (they run rarely, and a renamed function would otherwise break them unseen).
lint: install
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

# Rewrite the code to the formatter's layout and apply ruff's safe fixes.
format: install
	$(BIN)/ruff format src tests benchmarks scripts
	$(BIN)/ruff check --fix src tests benchmarks scripts

# mypy --strict on src/ (pyproject: [tool.mypy]), on the tests, on the benchmarks (which call the library's
# internals: mypy found fuzz.py's trunk target calling a method renamed long before) and on scripts/.
types: install
	$(BIN)/mypy
	$(BIN)/mypy tests
	$(BIN)/mypy benchmarks
	$(BIN)/mypy scripts

# The whole suite (both lanes) on TEST_WORKERS pytest-xdist workers, a test file per worker at a time (module
# fixtures stay shared), in the order tests/conftest.py sets (the files that run the command in subprocesses first);
# tests pin torch to one thread each, so two workers use a 2-core machine fully. Two runs: every test but the
# core's own without coverage (branch tracing slowed the whole suite by a third, and CI took 16 minutes), then
# the core's tests (tests/protocol, tests/federated) under branch coverage of the core, and its floors.
# `make coverage-all` runs the whole suite under coverage instead, for the report of every module.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
CORE_TESTS := tests/protocol tests/federated
CORE_COVERAGE := --cov=splitspec.protocol --cov=splitspec.federated.codec --cov-report=term
coverage: install
	$(PYTEST) --durations=20 $(addprefix --ignore=,$(CORE_TESTS))
	$(PYTEST) $(CORE_COVERAGE) $(CORE_TESTS)
	$(MAKE) --no-print-directory floors

coverage-all: install
	$(PYTEST) --durations=20 --cov --cov-report=term
	$(MAKE) --no-print-directory floors

floors:
	$(BIN)/coverage report --include='src/splitspec/protocol/*' --fail-under=$(PROTOCOL_FLOOR)
	$(BIN)/coverage report --include='src/splitspec/federated/codec.py' --fail-under=$(CODEC_FLOOR)

# The fast lane only: everything not marked slow.
test-fast: install
	$(PYTEST) -m 'not slow'

clean:
	rm -rf .coverage .coverage.* htmlcov .mypy_cache .ruff_cache .pytest_cache build dist src/*.egg-info
	find src tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +

.PHONY: install cluster demo test lint format types coverage coverage-all floors test-fast clean
