# Two entry points (see README): `make demo` and `make test`. Both create .venv if missing.
# TORCH picks the PyTorch build. torch==2.13.0 resolves to the CPU wheel on the project's
# build machines; on a GPU box pass e.g. TORCH="torch==2.13.0 --index-url <your CUDA index>".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'

demo: install
	$(BIN)/splitspec demo

test: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest -q

.PHONY: install demo test
