# The README's two commands: `make demo` and `make test`. Each creates the
# virtualenv (.venv, Python 3.11) and installs what it needs by itself.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rayslice demo

test: $(STAMP)
	$(BIN)/pytest

# Pure tests only (no Ray cluster): seconds.
test-fast: $(STAMP)
	$(BIN)/pytest -m "not ray"

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache
