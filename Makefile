# Two-command quickstart: `make demo`, `make test`. Each bootstraps .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_WORKERS ?= 2

.PHONY: test demo venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[torch,dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

demo: $(STAMP)
	$(VENV)/bin/jqlora demo

bench:
	python3 -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache
