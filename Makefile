# Two set-up commands: `make demo` and `make test`. Both create or refresh the virtual
# environment first (llama-cpp-python compiles from source once; pip caches the wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv certs demo demo-resume test lint bench bench-aiperf aiperf-venv clean system-deps \
	compliance-open-responses lm-eval-venv bench-lm-eval

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

# AIPerf (NVIDIA's LLM benchmark, PyPI) in a venv of its own outside the repository, so that its
# dependencies (transformers, pandas, numpy 2...) never touch .venv; `gguf` reads the model's
# vocabulary for the tokenizer AIPerf needs (made offline: loadtest/bench/aiperf_tokenizer.py).
# Never run by `make test` or CI. bench-aiperf also builds llama-server once (~12 min on 2
# cores; at once when cached). Flags: make bench-aiperf AIPERF_ARGS="--concurrency 1,8".
AIPERF_HOME ?= $(HOME)/.cache/quicsrv/aiperf
AIPERF_ARGS ?=

aiperf-venv:
	test -x $(AIPERF_HOME)/venv/bin/python || $(PYTHON) -m venv $(AIPERF_HOME)/venv
	$(AIPERF_HOME)/venv/bin/python -m pip install --quiet 'aiperf==0.13.0' 'gguf==0.19.0'

bench-aiperf: venv aiperf-venv
	$(BIN)/python -m loadtest.bench.llama_server_build
	QUICSRV_AIPERF_HOME=$(AIPERF_HOME) $(BIN)/python -m loadtest.bench.aiperf_run $(AIPERF_ARGS)

# lm-evaluation-harness (EleutherAI, PyPI lm-eval) in a venv of its own outside the repository,
# like AIPerf's: its API client only (no torch: transformers reads the tokenizer), and `gguf` for
# the tokenizer made offline from the GGUF (loadtest/bench/aiperf_tokenizer.py). bench-lm-eval
# runs its local-completions model on loadtest/eval's tasks against quicsrv and against
# llama-cpp-python's Llama (loadtest/bench/lm_eval_run.py); never run by `make test` or CI.
# Flags: make bench-lm-eval LM_EVAL_ARGS="--limit 20".
LM_EVAL_HOME ?= $(HOME)/.cache/quicsrv/lm-eval
LM_EVAL_ARGS ?=

lm-eval-venv:
	test -x $(LM_EVAL_HOME)/venv/bin/python || $(PYTHON) -m venv $(LM_EVAL_HOME)/venv
	$(LM_EVAL_HOME)/venv/bin/python -m pip install --quiet 'lm-eval[api]==0.4.13' 'gguf==0.19.0' \
		'transformers>=4.40,<6'

bench-lm-eval: venv lm-eval-venv
	QUICSRV_LM_EVAL_HOME=$(LM_EVAL_HOME) $(BIN)/python -m loadtest.bench.lm_eval_run $(LM_EVAL_ARGS)

# The Open Responses compliance suite (its repository's CLI at a pinned commit, run by bun from
# npm, both kept under ~/.cache/quicsrv/open-responses) against a real `quicsrv serve` with the
# default model: loadtest/bench/open_responses.py. Never run by `make test` or CI (it downloads).
# A machine that cannot reach GitHub: OPEN_RESPONSES_ARGS="--suite /path/to/a/checkout".
OPEN_RESPONSES_ARGS ?=

compliance-open-responses: venv
	$(BIN)/python -m loadtest.bench.open_responses $(OPEN_RESPONSES_ARGS)

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
