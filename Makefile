# lmpipe: `make demo` and `make test` work on a fresh machine (set-up included).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The one torch pin (pyproject.toml repeats it as a requirement). TORCH_INDEX picks a PyTorch
# wheel index: empty = the default index (PyPI: on Linux the CUDA build with its nvidia-* wheels),
# `cpu` = https://download.pytorch.org/whl/cpu (no CUDA wheels), `cu130` etc. likewise.
TORCH_VERSION := 2.13.0
TORCH_INDEX   ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX),--index-url https://download.pytorch.org/whl/$(TORCH_INDEX))
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
export RAY_AUTH_MODE := token

.PHONY: setup demo test test-fast test-gpu gpu-test-data test-gpu-offline test-reliability audit lint fmt typecheck check bench clean

setup: $(STAMP)

# torch first, pinned exactly: on its own a range would pull the newest CUDA build (several GB).
# `pip install -e` also compiles the C extension (setup.py), so its source is a prerequisite.
$(STAMP): pyproject.toml setup.py tasks/ingest/_textscan.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX_ARGS) torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

# Guards of the install: torch imports and is the pinned release in any build (+cpu, +cu130, ...;
# CUDA builds and their nvidia-* wheels are fine), and no requirement is broken.
check-install: $(STAMP)
	@$(BIN)/python -c "import sys, torch; v = str(torch.__version__); \
	  sys.exit(None if v.split('+')[0] == '$(TORCH_VERSION)' else \
	  f'error: torch {v} is installed, expected $(TORCH_VERSION) (any +local build); rerun set-up')"
	$(BIN)/pip check

demo: $(STAMP)
	$(BIN)/lmpipe demo-corpus --out workspace/demo_data
	$(BIN)/lmpipe run configs/demo.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

test: check-install lint typecheck
	$(BIN)/pytest

test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow and not integration" -q

# On a GPU machine; LMPIPE_REQUIRE_GPU=1 fails the gpu tests where CUDA is missing instead of
# skipping them, so this target never succeeds without a GPU.
test-gpu: $(STAMP)
	LMPIPE_REQUIRE_GPU=1 $(BIN)/pytest -m gpu

# The same tests on a GPU machine with no package index (docs/testing.md, "GPU tests"): here,
# `make gpu-test-data` writes the examples and the wheels the image lacks into .gpudata/tests;
# carry that folder, then `make test-gpu-offline` there runs with the image's python3.
GPU_TEST_DATA := .gpudata/tests
gpu-test-data: $(STAMP)
	$(BIN)/python tests/training/pretrain/gpu_data.py --out $(GPU_TEST_DATA)

test-gpu-offline:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	  --target /tmp/lmpipe-site $(GPU_TEST_DATA)/wheels/*.whl
	PYTHONPATH=/tmp/lmpipe-site LMPIPE_REQUIRE_GPU=1 LMPIPE_GPU_TEST_DATA=$(CURDIR)/$(GPU_TEST_DATA) \
	  python3 -m pytest -m gpu tests/training/pretrain/test_gpu.py

# The reliability suite at its full trial counts (20 training-chaos trials, every kill-during-save
# point, the 12-case resume matrix, 10 data-chaos trials per stage, 500 examples per bad-input
# property); figures go to test-artifacts/reliability/full/*.json, rendered for docs/reliability.md
# by bench/reliability_report.py. `make test` runs the same tests at their quick counts.
test-reliability: $(STAMP)
	LMPIPE_RELIABILITY=full $(BIN)/pytest tests/reliability -m reliability --timeout 3600

# Known vulnerabilities of the installed stack (needs pypi.org's JSON API or osv.dev); the
# report goes to test-artifacts/pip-audit.json. The project itself (editable) is skipped.
audit: $(STAMP)
	@mkdir -p test-artifacts
	$(BIN)/pip-audit --local --skip-editable --progress-spinner off --desc on \
	  -f json -o test-artifacts/pip-audit.json
	@$(BIN)/python -c "import json; d = json.load(open('test-artifacts/pip-audit.json'))['dependencies']; \
	  s = [x for x in d if 'skip_reason' in x]; v = [x for x in d if x.get('vulns')]; \
	  print(f'{len(d)} packages: {len(v)} with known vulnerabilities, {len(s)} not audited'); \
	  raise SystemExit(1 if v or s else 0)"

check: test

bench: $(STAMP)
	$(BIN)/python bench/ingest_throughput.py --profile

clean:
	rm -rf workspace .pytest_cache .mypy_cache .ruff_cache
