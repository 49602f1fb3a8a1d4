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

demo: $(STAMP)  ## about 5 s on 2 quiet CPU cores (after the set-up): a real overflow and the scaler's recovery, underflow at a low scale, the report's advice
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

fuzz: $(STAMP)  ## the differential fuzz test's long profile: 2000 fresh random training setups (about 8 min)
	FUZZ_EXAMPLES=2000 FUZZ_RANDOM=1 $(PY) -m pytest -q tests/test_fuzz.py -k replay --hypothesis-show-statistics

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

bench: $(STAMP)  ## speed ratios (5 interleaved rounds), bandwidth floor, memory and profile against Lightning's precisions (benchmarks/README.md)
	$(PY) benchmarks/run_all.py

gpu-check: $(STAMP)  ## on a CUDA machine: the CUDA tests (fp8 included), GPT-2 small per precision -> build/gpu-check.md, bf16-mixed vs MPTPrecision("bf16") vs fp8 -> build/gpu-fp8.md, the memory modes' step time and the plugin's host time -> build/gpu-memory.md
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || { echo "gpu-check: no CUDA GPU on this machine; nothing to check."; exit 0; }; \
	mkdir -p build; $(PY) -m pytest -q -m cuda tests/test_cuda.py tests/test_cuda_fp8.py; tests=$$?; \
	$(PY) benchmarks/run_all.py --accelerator gpu --max-minutes 5 --out build/gpu-check.md; bench=$$?; \
	$(PY) benchmarks/gpu_fp8.py --out build/gpu-fp8.md; fp8=$$?; \
	{ $(PY) benchmarks/step_time.py --accelerator gpu --workloads transformer --no-floor --quiet --rounds 5 \
		--precisions bf16-mixed mpt-bf16 mpt-bf16-chunked mpt-bf16-remainders \
	  && $(PY) benchmarks/engine_overhead.py --device cuda --rounds 5 --parts; } > build/gpu-memory.md; memory=$$?; \
	echo "gpu-check: CUDA tests exit $$tests, benchmark exit $$bench, fp8 benchmark exit $$fp8, memory modes exit $$memory; tables in build/gpu-check.md, build/gpu-fp8.md, build/gpu-memory.md"; \
	test $$tests -eq 0 && test $$bench -eq 0 && test $$fp8 -eq 0 && test $$memory -eq 0

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
