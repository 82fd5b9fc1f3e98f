# The two set-up commands (README): `make demo` and `make test`. Both create .venv and install
# everything they need; nothing has to be installed by hand.
PY_SYS ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow bench bench-deps install kernels clean

$(STAMP): pyproject.toml
	$(PY_SYS) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build on local disk (any other spec downloads GBs)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m specdec.runtime.kernels  # build the C++ matmul extension once (falls back to torch if it cannot)
	touch $(STAMP)

install: $(STAMP)

kernels: $(STAMP)
	$(PY) -m specdec.runtime.kernels

DEMO_PROMPT := "Write a Python function that checks whether a string is a palindrome."

# The same prompt twice, both at the GGUF's own quantisation: plain decoding, then the fastest
# configuration on this prompt (the 0.5B draft alone, requantised to Q4_0, k = 4: Zen 4, 45-49
# tok/s against plain's 31; the default composite 37-43 with k = auto, 35-40 at k = 4, where
# every weak n-gram match drafts), so the speed-up is on screen.
demo: $(STAMP)
	$(PY) -m specdec.cli models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	@echo "== plain decoding =="
	$(PY) -m specdec.cli generate --model qwen2.5-coder-1.5b --temperature 0 --max-tokens 160 \
	    --threads 2 $(DEMO_PROMPT)
	@echo "== speculative decoding: draft model qwen2.5-coder-0.5b (q4_0) alone, k = 4 =="
	$(PY) -m specdec.cli generate --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
	    --proposer draft --draft-dtype q4_0 --num-draft-tokens 4 --temperature 0 --max-tokens 160 --threads 2 \
	    --stats $(DEMO_PROMPT)

test: $(STAMP)
	$(PY) -m specdec.cli models fetch smollm2-135m
	$(PY) -m pytest -q -x

test-slow: $(STAMP)
	$(PY) -m specdec.cli models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(PY) -m pytest -q -m slow

# Optional, for benchmarks/llamacpp.py only (never a runtime dependency): llama-cpp-python built
# from source for this CPU, about 12 minutes.
bench-deps: $(STAMP)
	CMAKE_ARGS=-DGGML_NATIVE=ON $(PY) -m pip install --disable-pip-version-check --no-deps llama-cpp-python==0.3.36
	$(PY) -m pip install -q --disable-pip-version-check diskcache

clean:
	rm -rf $(VENV) build *.egg-info
