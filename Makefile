# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Keep JIT-built DeepSpeed ops (cpu_adam for offload tests) cached between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: venv demo test test-slow test-extended test-all lint clean sim-nightly

venv: $(STAMP)

# CPU torch is pinned through constraints-cpu.txt only here, so GPU users keep their own torch build.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints-cpu.txt torch==2.13.0
	$(PIP) install -q -c constraints-cpu.txt -e '.[train,tensorboard,dev,hf,parquet]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ulyssesd demo

# `make test` is everything but the end-to-end cases marked slow (≈ 10 min on 2 cores); CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=10 tests

# The slow end-to-end cases: multi-rank DeepSpeed jobs under the daemon, the Slurm cluster, chaos runs.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not extended" --durations=10 tests

# Before a release, not in CI (its 90-minute budget): the hostile probe rounds 6 and 7 (~20 min each) and the
# outside-in elastic checks (own 3-node Slurm clusters, ~10 min).
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended --durations=10 tests

# The nightly simulation (docs/SIMULATION.md): SIM_RUNS seeded simulated weeks in one process per CPU; the summary
# and each violation's replayable trace go to SIM_OUT (summary.json, violation-seed-N.json). Exit 1 on a violation.
SIM_RUNS ?= 100000
SIM_SEED ?= $(shell date +%j)00000
SIM_OUT  ?= sim-nightly
SIM_JOBS ?= $(shell nproc)
sim-nightly: $(STAMP)
	$(VENV)/bin/ulyssesd simulate --seed $(SIM_SEED) --runs $(SIM_RUNS) --days 7 --jobs $(SIM_JOBS) --out $(SIM_OUT)

test-all: $(STAMP)
	$(PY) -m pytest -q tests

# mypy needs the installed layout (ulyssesd.daemon, ...) on disk, but setuptools maps package-dir, so lint
# builds a symlink tree .cache/mypy-src/ulyssesd -> the source folders (idempotent: ln -sfn).
MYPY_SRC := .cache/mypy-src
lint: $(STAMP)
	$(VENV)/bin/ruff check daemon remediation training migrations client ulyssesd_pkg tests bench examples
	mkdir -p $(MYPY_SRC)/ulyssesd
	for d in daemon remediation training migrations client; do ln -sfn ../../../$$d $(MYPY_SRC)/ulyssesd/$$d; done
	for f in ulyssesd_pkg/*.py; do ln -sfn ../../../$$f $(MYPY_SRC)/ulyssesd/$${f#ulyssesd_pkg/}; done
	MYPYPATH=$(MYPY_SRC) $(VENV)/bin/mypy -p ulyssesd

clean:
	rm -rf $(VENV) .cache .pytest_cache
