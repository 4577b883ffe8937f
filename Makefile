# The two commands of the README: `make run` (set up, then the default job) and `make test-full` (set up, then the
# whole suite: CI's); `make test` runs the fast tier while developing; `make gpu-check` on a
# CUDA machine (the same setup, then scripts/gpu_check.py).
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := pyproject.toml $(shell find qtrain conf results/paper -name '*.py' -o -name '*.yaml' -o -name '*.csv' 2>/dev/null)

.PHONY: run test test-full lint bench gpu-check default-job-figures

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

# The README's table of the default job: it and its float32 twin, with the machine that ran them, into
# results/default_job.txt (a test holds the README's copy to it).
default-job-figures: $(VENV)/.installed
	rm -rf $${TMPDIR:-/tmp}/qtrain-default-job
	{ echo "# make default-job-figures: qtrain -m method=sbm,float32 on $$(nproc) cores of $$(uname -m)," \
	    "torch $$($(PY) -c 'import torch; print(torch.__version__)'), $$(date -u +%Y-%m-%d)"; \
	  $(VENV)/bin/qtrain -m method=sbm,float32 progress=false hydra.sweep.dir=$${TMPDIR:-/tmp}/qtrain-default-job \
	    | sed -n '/^ *method /,$$p'; } > results/default_job.txt

# the tests spread over one worker per core (pytest-xdist), one torch thread each, at most 4 workers (each keeps
# the memory of the largest run it made, up to about 2 GB)
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses 4 -m "not slow"

test-full: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses 4

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check qtrain tests scripts

bench: $(VENV)/.installed
	$(PY) scripts/bench_speed.py

gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py
