# Set-up and the two main commands. Every target creates .venv when missing and installs memfine
# with the pinned torch from constraints.txt (a CPU wheel; an unpinned torch pulls a CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test install lint typecheck clean results

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,hf,examples,torchtitan,trl]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m memfine train $(ARGS)

# docs/results.md's training table is copied from benchmarks/results/train_small.json, which this
# target writes: the `make train` run (preset small) into runs/results-small, then the summary.
results: $(STAMP)
	$(PY) -m memfine train --out runs/results-small --overwrite --no-progress $(ARGS)
	$(PY) scripts/training_results.py runs/results-small benchmarks/results/train_small.json

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# ruff, then mypy (docs/style.md §8)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(MAKE) --no-print-directory typecheck

# mypy on src/memfine, configured in pyproject.toml [tool.mypy]
typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
