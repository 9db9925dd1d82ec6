# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv and trains the built-in default (2 CPU workers)
#   make test   installs into .venv and runs the whole test suite
# make lint: ruff (lint and format check), mypy and shellcheck; CI runs it before the tests
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m raytrain_ddp.run --num-workers 2

# Two lanes (tests/support.py's lane_of): the Slurm testbed's jobs beside the tests on the local Ray
test: $(VENV)/.installed
	$(PY) -m pytest -n 2

SHELL_SCRIPTS := $(wildcard cluster/*.sh cluster/testbed/*.sh examples/*.sh)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck --external-sources --severity=warning $(SHELL_SCRIPTS)

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache
