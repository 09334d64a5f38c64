# The two commands of the README quickstart: `make serve` and `make test`.
# Each creates .venv when missing and reinstalls only when pyproject.toml changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
# test processes (pytest-xdist): CI has 2 cores; each worker compiles its own programs
TEST_WORKERS ?= 2
# Bytecode: pip installs without compiling every file it unpacks (a fresh test install
# 91 → 26 s here), and each Python this Makefile starts writes what it imports under
# .venv/pycache once (the first imports of a run ~7 s more), also where the environment sets
# PYTHONDONTWRITEBYTECODE (else every process would compile jax and torch from source).
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache

.PHONY: serve test bench lint format clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "ds4jax needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Runtime only: serving needs no torch.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e .
	touch $@

# Runtime + test extras (torch==2.13.0 CPU, transformers, the anthropic SDK, ruff).
$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e '.[test]'
	touch $(VENV)/.runtime $@

serve: $(VENV)/.runtime
	$(BIN)/ds4jax serve --host $(HOST) --port $(PORT)

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

bench: $(VENV)/.test
	$(BIN)/python -m bench

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
