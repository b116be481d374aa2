# Two front-door commands: `make run` (main job) and `make test` (test suite).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
EXTRAS  := $(VENV)/.extras
DOCS    := $(VENV)/.docs

.PHONY: run test test-gpu lint docs bench clean

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

# the documentation tools (MkDocs, Material, mkdocstrings): `make docs`, and tests/test_docs.py
$(DOCS): $(STAMP) requirements-docs.txt
	$(BIN)/python -m pip install --quiet -r requirements-docs.txt
	touch $(DOCS)

run: $(STAMP)
	$(BIN)/paraloom train

test: $(EXTRAS) $(DOCS)
	$(BIN)/python -m pytest -q

# the tests marked cuda, on a GPU machine, with the interpreter at hand: no virtual environment, no install
PYTHON ?= python3
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m cuda -p no:cacheprovider $(PYTEST_ARGS)

# the site in docs/ into site/, every warning (a broken link, anchor or reference) an error
docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) runs site .pytest_cache
