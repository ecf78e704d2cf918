# The two commands (README): `make run` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch installs quickly on CPU-only machines; on a GPU machine pass TORCH_SPEC=torch (CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test test-slow lint setup clean-runs

$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,notebooks]"
	touch $@

setup: $(VENV)/.setup-done

# Execute every notebook headless (papermill) on the default: `tiny` on a CPU, the GPU when present -> runs/
run: setup
	$(PY) -m kimik3 run-notebooks --out runs

# The whole test suite (what CI runs through .ci/run): unit, oracle, kernel-compile and notebook tests, in TEST_WORKERS
# pytest-xdist processes (a test module stays on one worker, so its module-scoped fixtures are built once).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check kimik3 kernels tests scripts notebooks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The full matrices (tiny preset, more seeds and batch sizes), not part of CI.
test-slow: setup
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadscope

lint: setup
	$(PY) -m ruff check kimik3 kernels tests scripts notebooks

clean-runs:
	rm -rf runs
