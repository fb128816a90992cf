# hfmeg: `make demo` runs the built-in default job, `make test` runs the test suite.
# Both create .venv on first use: torch first (so the CPU build on CPU machines is
# what satisfies the project's torch requirement), then hfmeg in editable mode.

VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.hfmeg-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@echo "first run: creating $(VENV) and installing $(TORCH_SPEC), then hfmeg and its dependencies;"
	@echo "this downloads several hundred MB and can take 5 minutes (later runs skip it)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py
	@echo "hfmeg and its commands (accelerate, torchrun) live in $(VENV): run '. $(VENV)/bin/activate' first,"
	@echo "or call them as $(VENV)/bin/accelerate, $(VENV)/bin/torchrun, $(VENV)/bin/python"

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) out
