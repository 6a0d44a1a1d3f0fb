# The README's two commands: `make demo` and `make test`. Each creates the
# virtualenv (.venv, Python 3.11) and installs what it needs by itself.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Extra arguments for `rayslice demo`, e.g. `make demo DEMO_ARGS=--verbose`.
DEMO_ARGS ?=

.PHONY: demo test test-fast lint wheel-smoke bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rayslice demo $(DEMO_ARGS)

# The whole suite, with the doctests of every module (pyproject's pytest config).
test: $(STAMP)
	$(BIN)/pytest

# Tests that do not need the session cluster, and the doctests: about two minutes.
test-fast: $(STAMP)
	$(BIN)/pytest -m "not ray"

# Lint, format check and type check, as CI runs them.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src/rayslice

# Build sdist + wheel, install the wheel in a fresh virtualenv outside the
# checkout, run the installed CLI (starts a simulated cluster: Ray).
wheel-smoke: $(STAMP)
	PYTHON=$(BIN)/python BASE_PYTHON=$(PYTHON) .ci/wheel-smoke.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist src/*.egg-info
