# One-line entry points on a fresh clone. Each creates .venv on first use (Python >= 3.11 as
# $(PYTHON)) and installs what it needs: the library for `train`, the test and docs tools for
# the rest. An existing .venv is kept (e.g. one with JAX's CUDA build already installed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
LIBRARY := $(VENV)/.installed-library
TOOLS := $(VENV)/.installed

.PHONY: setup train test bench docs clean

$(LIBRARY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(TOOLS): $(LIBRARY)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

## The library and the tools the tests and the docs use (pytest, ruff, mkdocs, PyTorch for the
## Hugging Face tests).
setup: $(TOOLS)

## Train the default experiment (or: make train ARGS="--config=... --workdir=...").
train: $(LIBRARY)
	$(PY) -m experiments.train $(ARGS)

## Lint, then run the whole test suite on 8 simulated CPU devices (or: make test ARGS=tests/FILE.py).
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n 2 --dist loadfile $(ARGS)

## Build the documentation site into site/; a broken link or API reference fails (--strict).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) -m experiments.bench.ddp_overhead
	$(PY) -m experiments.bench.step_overhead
	$(PY) -m experiments.bench.input_pipeline

clean:
	rm -rf $(VENV) bench_results .pytest_cache site
