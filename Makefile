# Development entry points. Everything runs in a local virtual environment (.venv) that `make` creates.
# On a GPU machine keep your CUDA torch: `make test TORCH_SPEC=torch` (or any pip spec).
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed

.PHONY: demo ruff lint test test-floor fuzz docs bench gpu-check peer clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $(STAMP)

demo: $(STAMP)  ## 6-7 s on 2 CPU cores (after the set-up): a real overflow and the scaler's recovery, underflow at a low scale, the report's advice
	$(PY) examples/precision_story.py
	@echo "plots in runs/story/report; tensorboard is $(VENV)/bin/tensorboard"

ruff: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint: ruff  ## ruff (lint and format) and mypy --strict on the package
	$(VENV)/bin/mypy

test: lint  ## lint (ruff, mypy --strict), the test suite and the strict documentation build, warnings shown (what CI runs)
	MPT_REQUIRE_EXAMPLES=1 $(PY) -m pytest -q
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

FLOOR_VENV ?= .venv-floor
test-floor:  ## the suite on the oldest torch, lightning, torchmetrics and tensorboard that pyproject.toml declares
	python3 -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	python3 scripts/floor_constraints.py > $(FLOOR_VENV)/floor.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/floor.txt -e ".[dev]"
	$(FLOOR_VENV)/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|lightning|torchmetrics|tensorboard) "
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider

fuzz: $(STAMP)  ## the differential fuzz test's long profile: 2000 fresh random training setups, 500 more on torch < 2.13's path (about 10 min)
	FUZZ_EXAMPLES=2000 FUZZ_RANDOM=1 $(PY) -m pytest -q tests/test_fuzz.py -k replay --hypothesis-show-statistics

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

bench: $(STAMP)  ## speed ratios (5 interleaved rounds), bandwidth floor, memory and profile against Lightning's precisions (benchmarks/README.md)
	$(PY) benchmarks/run_all.py

# The GPU check needs no install: .venv's python when there is one, else python3 with the checkout on PYTHONPATH (the
# GPU machine: no network, torch and Lightning installed). torchao travels as wheels in .whl/ (docs/benchmarks.md).
GPU_PY   = $(if $(wildcard $(PY)),$(PY),python3)
GPU_OUT ?= build/gpu-check
GPU_ARGS ?=
gpu-check:  ## on a CUDA machine, under 8 minutes: the CUDA tests, host time per step, fp8, GPT-2 small per precision (step time, bytes per parameter, peak memory) -> build/gpu-check/gpu-check.md (GPU_ARGS=--dry-run: the logic on a CPU)
	@PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) scripts/gpu_check.py --out $(GPU_OUT) \
		$(if $(wildcard .whl/*.whl),--wheels .whl) $(GPU_ARGS); code=$$?; \
	if [ $$code -eq 3 ]; then echo "gpu-check: nothing to check here (make gpu-check GPU_ARGS=--dry-run runs its logic on the CPU)"; exit 0; fi; \
	exit $$code

LIGHTNING_TESTS ?= build/lightning-tests
LIGHTNING_COMMIT := be98784a1a03581b7051a355ae1084fd352d7cea  # tag 2.6.5, the one scripts/peer/SELECTED.txt was curated at

$(LIGHTNING_TESTS)/pyproject.toml:  ## Lightning's tests at the pinned commit, from a git copy: LIGHTNING_GIT=path/to/.git
	@test -n "$(LIGHTNING_GIT)" || { echo "make peer: set LIGHTNING_GIT to a git copy of Lightning-AI/pytorch-lightning (or LIGHTNING_TESTS to an extract); see docs/compatibility.md"; exit 2; }
	mkdir -p $(LIGHTNING_TESTS)
	git --git-dir=$(LIGHTNING_GIT) archive $(LIGHTNING_COMMIT) tests/tests_pytorch src/lightning/pytorch/demos pyproject.toml | tar -x -C $(LIGHTNING_TESTS)

peer: $(STAMP) $(LIGHTNING_TESTS)/pyproject.toml  ## Lightning's own tests with MPTPrecision substituted (docs/compatibility.md)
	$(PY) -m pip install -q pytest-rerunfailures pytest-timeout scikit-learn
	PY=$(abspath $(PY)) scripts/peer/run_peer.sh $(LIGHTNING_TESTS)

clean:
	rm -rf $(VENV) build runs lightning_logs
