# fedbench: `make install`, `make run`, `make test`, `make bench`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: install run test test-all lint format bench reproduce tables clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $@

# The main job: FedAvg on Fashion-MNIST (5 clients, Dirichlet split); extra Hydra overrides via ARGS="...".
run: install
	$(PY) run.py $(ARGS)

# CI subset: everything but the long real-data checks (marked slow), one pytest-xdist worker per core
# (TEST_JOBS=0 runs in one process). pytest's "no tests" (5) is not a failure.
TEST_JOBS ?= auto
test: install lint
	$(PY) -m pytest -m "not slow" -q -n $(TEST_JOBS) $(ARGS) || [ $$? -eq 5 ]

# Lint (rule set in pyproject.toml); `make format FILES="fedbench/x.py"` formats the files you touch.
lint: install
	$(VENV)/bin/ruff check fedbench scripts tests run.py

FILES ?= fedbench scripts tests run.py
format: install
	$(VENV)/bin/ruff format $(FILES)

test-all: install
	$(PY) -m pytest -q -n $(TEST_JOBS) $(ARGS) || [ $$? -eq 5 ]

# Speed on this machine, ratios only (never pass/fail): training GFLOP/s against a measured peak (contiguous vs
# channels-last vs torch.compile step, compile time printed); serial vs serial channels-last vs batched
# training vs a plain DataLoader loop; curvature / one epoch; FedLPA's GD server (float32, float64); a sweep with one
# job vs N jobs at once; Hydra composition with and without fedbench's parsed-file cache; a table's second read with and
# without the resolved-run cache. ARGS go to bench_engine.py.
bench: install
	$(PY) scripts/bench_throughput.py --compile
	$(PY) scripts/bench_engine.py $(ARGS)
	$(PY) scripts/bench_curvature.py --threads 1 --repeats 3
	$(PY) scripts/bench_fedlpa_gd.py --steps 1000 --repeats 2
	$(PY) scripts/bench_fola_hessian.py
	$(PY) scripts/bench_sweep.py
	$(PY) scripts/bench_compose.py
	$(PY) scripts/bench_tables.py
	$(PY) scripts/bench_share_epochs.py

# One command per paper table: make reproduce EXP=fedlpa/table6 PROFILE=quick ARGS="dataset=fmnist"
EXP     ?=
PROFILE ?= quick
reproduce: install
	@test -n "$(EXP)" || (echo "usage: make reproduce EXP=<paper>/<table> [PROFILE=quick|paper] [ARGS=...]"; exit 2)
	$(PY) scripts/reproduce.py experiment=$(EXP) profile=$(PROFILE) $(ARGS)

# Re-collect a table from existing run records (no training).
# Without EXP: every committed table (results/collections.yaml) and the scoreboard, from results/records/.
tables: install
	@if [ -z "$(EXP)" ]; then $(PY) scripts/reproduce.py --collect-only --all; \
	else $(PY) scripts/reproduce.py --collect-only experiment=$(EXP) profile=$(PROFILE) $(ARGS); fi

clean:
	rm -rf $(VENV) .pytest_cache
