# One-line entry points. Each creates .venv on first use (Python >= 3.11 as $(PYTHON)).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup train test lint bench docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

## Train the default experiment (or: make train ARGS="--config=... --workdir=...").
train: setup
	$(PY) -m experiments.train $(ARGS)

## Lint, then run the whole test suite on 8 simulated CPU devices.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n 2 --dist loadfile

## Build the documentation site into site/; a broken link or API reference fails (--strict).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) -m experiments.bench.ddp_overhead
	$(PY) -m experiments.bench.step_overhead
	$(PY) -m experiments.bench.input_pipeline

clean:
	rm -rf $(VENV) bench_results .pytest_cache site
