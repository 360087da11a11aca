# Two set-up commands: `make demo` and `make test`. Both create or refresh the virtual
# environment first (llama-cpp-python compiles from source once; pip caches the wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv certs demo demo-resume test lint bench clean system-deps

# The strict editable install links every file under its installed name (proto/ is quicsrv_proto,
# client/ is quicsrv_client): mypy and plain imports see them without setuptools' import hook. A
# file added or removed changes its folder, which relinks.
PACKAGE_DIRS := $(shell find quicsrv proto client -type d -not -name __pycache__)

$(STAMP): pyproject.toml $(PACKAGE_DIRS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server,dev]' --config-settings editable_mode=strict
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

# redis-server (the shared store's tests start their own) and iproute2 (`ip netns`: the two-node
# test), from Debian's packages. Needs root; skipped when both are already there. A failed install
# only warns here (those tests then skip); .ci/run checks and fails instead.
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v ip >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server iproute2 chromium; } \
	      || echo "system-deps: could not install redis-server/iproute2/chromium: their tests will skip" >&2; \
	  else echo "system-deps: not root; install redis-server, iproute2 and chromium yourself" >&2; fi; \
	fi

test: certs system-deps
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check proto quicsrv client tests loadtest
	$(BIN)/ruff format --check proto quicsrv client tests loadtest
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
