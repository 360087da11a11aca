# Two set-up commands: `make demo` and `make test`. Both create or refresh the virtual
# environment first (llama-cpp-python compiles from source once; pip caches the wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv certs demo demo-resume test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server,dev]'
	touch $(STAMP)

venv: $(STAMP)

certs: venv
	$(BIN)/quicsrv certs --dir certs

demo: certs
	$(BIN)/python -m quicsrv.demo

demo-resume: certs
	$(BIN)/python -m quicsrv.demo resume

bench: certs
	$(BIN)/python -m loadtest.bench

test: certs
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check proto quicsrv client tests loadtest
	$(BIN)/ruff format --check proto quicsrv client tests loadtest
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
