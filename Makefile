# Two set-up commands: `make demo` and `make test`. Both create or refresh the virtual
# environment first (llama-cpp-python compiles from source once; pip caches the wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv certs demo demo-resume test test-container image lint bench bench-aiperf aiperf-venv clean \
	system-deps compliance-open-responses lm-eval-venv bench-lm-eval

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
# test), chromium (the chat page's tests), promtool (Debian's prometheus: the alert rules' tests),
# systemd-analyze (the unit's test), podman, podman-compose and mmdebstrap with what rootful
# podman needs here (runc, uidmap, slirp4netns, fuse-overlayfs: the container tests), from
# Debian's packages. kubectl is not a Debian package: the Kubernetes tests skip without it.
# Needs root; skipped when all are already there. A failed install only warns here (those tests
# then skip); .ci/run checks and fails instead.
SYSTEM_TOOLS := redis-server ip chromium promtool systemd-analyze podman podman-compose mmdebstrap runc
SYSTEM_PACKAGES := redis-server iproute2 chromium prometheus systemd podman podman-compose \
	mmdebstrap runc uidmap slirp4netns fuse-overlayfs

system-deps:
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); } \
	      || echo "system-deps: could not install$$missing: their tests will skip" >&2; \
	  else echo "system-deps: not root; install$$missing yourself ($(SYSTEM_PACKAGES))" >&2; fi; \
	fi

# The suite takes about 11 min on two cores; a run past TEST_LIMIT is stuck: stop it, so that a
# hang costs minutes, not CI's whole 90 (faulthandler_timeout has printed where it hangs).
TEST_LIMIT ?= 40m
test: certs system-deps
	timeout --kill-after=30s $(TEST_LIMIT) $(BIN)/python -m pytest

# The container image and the compose file, built and run with podman (tests/deploy/
# test_container.py): about 6 min cold (a Debian base from mmdebstrap, then the image), 2.5 min
# warm on two cores; so a step of its own, after `make test` (README: "In a container").
test-container: certs system-deps
	$(BIN)/python -m pytest --container -m container tests/deploy

# The image, as a user builds it (the public Python image as its base), reusing pip's cached
# llama-cpp-python wheel when `make venv` left one (else the build stage compiles it).
IMAGE ?= quicsrv:latest
CONTAINER ?= podman
# More `build` flags: a base image (--build-arg BASE_IMAGE=...), a pip index (--build-arg
# PIP_INDEX_URL=...), a proxy's CA bundle (podman: -v BUNDLE:/run/pip-ca.pem:ro --build-arg
# PIP_CERT=/run/pip-ca.pem).
IMAGE_BUILD_ARGS ?=

image:
	@wheels=$$(mktemp -d) && trap 'rm -rf "$$wheels"' EXIT && \
	found=$$(find $${PIP_CACHE_DIR:-$$HOME/.cache/pip}/wheels -name 'llama_cpp_python-*.whl' 2>/dev/null | head -n 1); \
	if [ -n "$$found" ]; then cp "$$found" "$$wheels/"; echo "image: reusing $$found"; fi; \
	$(CONTAINER) build $(if $(filter podman,$(CONTAINER)),--format docker) --build-context wheels="$$wheels" $(IMAGE_BUILD_ARGS) \
	  -f deploy/container/Containerfile -t $(IMAGE) .

lint: venv
	$(BIN)/ruff check proto quicsrv client tests loadtest
	$(BIN)/ruff format --check proto quicsrv client tests loadtest
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
