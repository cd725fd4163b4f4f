# The README's two commands: `make up` runs holdback, `make test` runs the tests.
# Both create .venv when it is missing and (re)install the project when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The second test pass runs against real services; override to point elsewhere.
TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0
# Test processes per pass (pytest-xdist). Most tests wait on the processes they start: with one worker per core the
# two cores sat idle 36% of the embedded pass (process accounting, docs/ci.md), so two per core; an idle worker
# takes tests queued at a busy one (worksteal), so a pass does not end with one worker through a queue of drills.
CORES := $(shell nproc 2>/dev/null || echo 2)
TEST_WORKERS ?= $(shell echo $$(( $(CORES) * 2 )))
# The PostgreSQL pass computes more than it waits (the database server's share): four workers on two cores made its
# tests twice as long and the pass no shorter (341 s, in the range of two workers' 287-401 s), so one per core
# unless TEST_WORKERS is given.
SERVICES_WORKERS := $(if $(filter command line environment,$(origin TEST_WORKERS)),$(TEST_WORKERS),$(CORES))

.PHONY: up test test-fast test-embedded test-services test-vllm bench install clean

# Python keeps the compiled project and test modules in __pycache__/ (ignored by git) even where the environment
# asks it not to (PYTHONDONTWRITEBYTECODE): without them every process a test starts compiles its modules again,
# and every pytest process rewrites every test module's asserts (collecting took 10 s, against 6 s from the cache).
unexport PYTHONDONTWRITEBYTECODE

# pip's output goes to .venv/pip.log and is shown only when the install fails.
$(STAMP): pyproject.toml
	@echo "installing holdback and its dependencies into $(VENV) (the first time takes a minute or two)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@$(BIN)/python -m pip install --quiet -e '.[dev]' >> $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@touch $(STAMP)

install: $(STAMP)

# Flags for `holdback up`, e.g. make up ARGS="--api-port 9000 --sim-replicas 4".
ARGS ?=

up: $(STAMP)
	$(BIN)/holdback up $(ARGS)

# Both passes always run (a failure in the first does not hide the second); the exit status is the worse.
test: $(STAMP)
	@$(MAKE) --no-print-directory test-embedded; first=$$?; \
	$(MAKE) --no-print-directory test-services; second=$$?; \
	echo "make test: embedded pass $$([ $$first = 0 ] && echo passed || echo FAILED), services pass $$([ $$second = 0 ] && echo passed || echo FAILED)"; \
	[ $$first = 0 ] && [ $$second = 0 ]

# The tests that start no process (marked `unit` at collection): seconds, no services needed.
test-fast: $(STAMP)
	HOLDBACK_TEST_BACKEND=embedded $(BIN)/python -m pytest -m unit -q -n $(CORES)

# Pass 1: the embedded defaults (SQLite, embedded Redis), every test.
test-embedded: $(STAMP)
	HOLDBACK_TEST_BACKEND=embedded $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# Pass 2: PostgreSQL and the machine's Redis server, only the tests whose outcome depends on them (those that use
# the `backend` fixture, or are marked `services`; tests/conftest.py deselects the rest, which pass 1 ran). The
# browser tests run once, in pass 1: the dashboard's queries and actions are covered on PostgreSQL by
# tests/batch_api/test_admin_dashboard.py.
test-services: $(STAMP)
	HOLDBACK_TEST_BACKEND=services HOLDBACK_TEST_POSTGRES_URL=$(TEST_POSTGRES_URL) \
	HOLDBACK_TEST_REDIS_URL=$(TEST_REDIS_URL) $(BIN)/python -m pytest -n $(SERVICES_WORKERS) --dist worksteal -m "not browser" \
	--ignore=tests/real_vllm

# The real-engine tier: real vLLM (its CPU build, a tiny random-weight model built here) in front of and behind
# holdback. The first run builds that environment under ~/.cache/holdback/real-vllm/ (about 2 minutes, 3.6 GB);
# later runs reuse it. One test process: the vLLM servers are shared fixtures and the engine takes both cores.
test-vllm: $(STAMP)
	@engine=$$($(BIN)/python -m tests.real_vllm.engine_env ensure) || exit 1; \
	export $$(echo "$$engine" | grep '^HOLDBACK_VLLM_'); \
	HOLDBACK_TEST_BACKEND=embedded $(BIN)/python -m pytest -p no:xdist tests/real_vllm -ra

bench: $(STAMP)
	$(BIN)/holdback bench study --quick

clean:
	rm -rf $(VENV) build *.egg-info
