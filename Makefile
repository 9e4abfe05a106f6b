# Two entry points (README): `make run` (the demo) and `make test` (the whole suite; CI runs it).
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: run test bench-overhead clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

run: $(BIN)/.installed
	$(BIN)/deepinfer-gateway demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
