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

# Installs with uv, which pip installs into the venv first: it installs the same packages in
# less time (downloads and byte-compiles in parallel). Where uv cannot be installed, pip installs.
# uv reads no pip configuration, so it is handed the wheel folders (find-links) and constraints
# pip is configured with: where pip takes a CPU build of torch from a local folder, so does uv.
# It byte-compiles as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else would, and
# every process would compile what it imports (`import jax`: 1.6 s instead of 0.8).
define install
	test -x $(VENV)/bin/uv || $(PY) -m pip install --quiet uv || echo "installing with pip"
	if test -x $(VENV)/bin/uv; then \
	  $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) \
	    $$($(PY) -m pip config get global.find-links 2>/dev/null | xargs -rn1 echo --find-links) \
	    $$($(PY) -m pip config get global.constraint 2>/dev/null | xargs -rn1 echo --constraint) \
	    $(1); \
	else $(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet $(1); fi
endef

$(LIBRARY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install,-e .)
	touch $@

$(TOOLS): $(LIBRARY)
	$(call install,-e ".[test]")
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
