# The README's two commands: `make up` runs holdback, `make test` runs the tests.
# Both create .venv when it is missing and (re)install the project when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The second test pass runs against real services; override to point elsewhere.
TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0
# Tests that touch the database or Redis, run once per backend.
DB_TESTS ?= tests/api tests/pipeline tests/platform tests/deploy/test_object_store.py tests/deploy/test_retention.py \
	tests/deploy/test_schema.py tests/deploy/test_migration_race.py tests/deploy/test_multihost_drill.py

.PHONY: up test test-embedded test-services bench install clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/holdback up

test: test-embedded test-services

# Pass 1: the embedded defaults (SQLite, embedded Redis), every test.
test-embedded: $(STAMP)
	HOLDBACK_TEST_BACKEND=embedded $(BIN)/python -m pytest

# Pass 2: PostgreSQL and the machine's Redis server, the tests that use them.
test-services: $(STAMP)
	HOLDBACK_TEST_BACKEND=services HOLDBACK_TEST_POSTGRES_URL=$(TEST_POSTGRES_URL) \
	HOLDBACK_TEST_REDIS_URL=$(TEST_REDIS_URL) $(BIN)/python -m pytest $(wildcard $(DB_TESTS))

bench: $(STAMP)
	$(BIN)/holdback bench study --quick

clean:
	rm -rf $(VENV) build *.egg-info
