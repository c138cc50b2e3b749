# lmpipe: `make demo` and `make test` work on a fresh machine (set-up included).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
export RAY_AUTH_MODE := token

.PHONY: setup demo test test-fast test-gpu test-reliability audit lint fmt typecheck check bench clean

setup: $(STAMP)

# torch first, pinned exactly: on its own a range would pull the newest CUDA build (several GB).
# `pip install -e` also compiles the C extension (setup.py), so its source is a prerequisite.
$(STAMP): pyproject.toml setup.py tasks/ingest/_textscan.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

# Guards of the install: no CUDA wheels dragged in, no broken requirements.
check-install: $(STAMP)
	@if $(BIN)/pip list 2>/dev/null | grep -i '^nvidia-'; then \
	  echo "error: nvidia-* packages installed: something pulled a CUDA torch"; exit 1; fi
	$(BIN)/pip check

demo: $(STAMP)
	$(BIN)/lmpipe demo-corpus --out workspace/demo_data
	PREFECT_HOME=$(CURDIR)/workspace/.prefect $(BIN)/lmpipe run configs/demo.yaml

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

test-gpu: $(STAMP)
	$(BIN)/pytest -m gpu

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
