# The two commands of the README: `make run` (set up, then the default job) and `make test-full` (set up, then the
# whole suite: CI's); `make test` runs the fast tier while developing; `make gpu-check` on a
# CUDA machine (the same setup, then scripts/gpu_check.py).
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := pyproject.toml $(shell find qtrain conf results/paper -name '*.py' -o -name '*.yaml' -o -name '*.csv' 2>/dev/null)

.PHONY: run test test-full lint bench gpu-check

# torch 2.14.1 + torchvision 0.29.1 first (pip takes them from local disk where they lie there),
# then qtrain with its test extras, as a plain (non-editable) install.
$(VENV)/.deps: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install --quiet ".[test]"
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install --quiet --no-deps --force-reinstall .
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/qtrain

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

test-full: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check qtrain tests scripts

bench: $(VENV)/.installed
	$(PY) scripts/bench_speed.py

gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py
