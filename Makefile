# TeamDesk task cluster. `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

# Python may write its bytecode caches here (git ignores __pycache__): an environment that
# says PYTHONDONTWRITEBYTECODE made every process of a test run compile the project and
# pytest rewrite every test module again - 6.4 s of collection per pytest-xdist process
# instead of 2.9 s, and each CLI subprocess of the tests compiling what it imports.
unexport PYTHONDONTWRITEBYTECODE

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)

# constraints.txt pins every dependency (pip-compile from pyproject.toml): the same
# versions here, in CI and in the image (deploy/Dockerfile). `make constraints` renews it.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install the project with its dev tools (pinned: constraints.txt)

constraints: | $(PY) ## regenerate constraints.txt from pyproject.toml (pip-compile, newest allowed versions)
	$(PY) -m pip install --quiet pip-tools
	$(VENV)/bin/pip-compile --quiet --upgrade --all-extras --strip-extras --no-emit-index-url \
		--no-emit-find-links --output-file constraints.txt pyproject.toml

services: $(STAMP) ## check that PostgreSQL and Redis answer
	$(PY) scripts/check_services.py

# pytest-xdist processes for the parallel runs: the tests mostly wait on servers and
# subprocesses, so more than the 2 cores pay (docs/decisions.md, "A test suite a person
# can wait for"). The unit, integration and process tiers run in one session (the process
# tests' waits are the integration tests' time; work stealing moves queued tests to a
# process that ran out), then the few tests that measure a time run alone.
TEST_JOBS ?= 5
CHECK_JOBS ?= 4
PYTEST_PARALLEL = $(PY) -m pytest --dist worksteal

test: install services ## install, check services, run the whole test suite (all tiers in parallel, then the timed tests alone)
	TEAMDESK_CHECK_RABBITMQ=1 $(PY) scripts/check_services.py
	bash scripts/ensure_chromium.sh
	bash scripts/ensure_debian.sh faketime faketime
	bash scripts/ensure_debian.sh prometheus prometheus
	bash scripts/ensure_debian.sh pgbouncer pgbouncer
	$(PYTEST_PARALLEL) -n $(TEST_JOBS) -m "not alone" tests/unit tests/integration tests/process
	$(PY) -m pytest -m alone

check: lint services ## the edit-test loop: lint, then the unit and integration tests in parallel (no process tests)
	$(PYTEST_PARALLEL) -n $(CHECK_JOBS) tests/unit tests/integration

lint: install ## ruff, mypy, the import contracts (lint-imports), the alert rules (promtool)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports
	bash scripts/ensure_debian.sh promtool prometheus
	promtool check rules deploy/prometheus/alerts.yaml
	promtool test rules deploy/prometheus/tests/*.test.yaml

format: install ## apply ruff's formatting and safe fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

migrate: install ## apply database migrations to DATABASE_URL
	$(VENV)/bin/teamdesk-tasks migrate

run: install services ## create+migrate the database, seed the demo, run workers, beat, Flower, API
	$(VENV)/bin/teamdesk-tasks run-local

demo-seed: install services ## create+migrate the database, seed the demo team once, print tokens
	$(VENV)/bin/teamdesk-tasks migrate --create-database
	$(VENV)/bin/teamdesk-tasks demo-seed
.PHONY: demo-seed

bench: install services ## side-by-side performance ratios (~15 min): bench/RESULTS.md, bench/results/
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m bench.run

soak: install ## chaos run (~10 min), own PostgreSQL + Redis under Sentinel, 16 fault kinds (SEED=1 TASKS=3000 FAULTS=160; SOAK_ARGS="--short --keep ...")
	bash scripts/ensure_debian.sh faketime faketime
	$(PY) -m soak.run $(if $(SEED),--seed $(SEED)) $(if $(TASKS),--tasks $(TASKS)) $(if $(FAULTS),--faults $(FAULTS)) $(SOAK_ARGS)

.PHONY: help install constraints services test check lint format migrate run soak bench
