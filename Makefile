# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv and trains the built-in default (2 CPU workers)
#   make test   installs into .venv and runs the whole test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m raytrain_ddp.run --num-workers 2

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf runs .pytest_cache
