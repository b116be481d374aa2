# Two front-door commands: `make run` (main job) and `make test` (test suite).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
EXTRAS  := $(VENV)/.extras

.PHONY: run test test-gpu lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements-dev.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# the optional integrations (Lightning, Accelerate): the tests need them, the core install does not
$(EXTRAS): $(STAMP) requirements-extras.txt
	$(BIN)/python -m pip install --quiet -r requirements-extras.txt
	touch $(EXTRAS)

run: $(STAMP)
	$(BIN)/paraloom train

test: $(EXTRAS)
	$(BIN)/python -m pytest -q

# the tests marked cuda, on a GPU machine, with the interpreter at hand: no virtual environment, no install
PYTHON ?= python3
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m cuda -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) runs .pytest_cache
