"""Fixtures for the deployment tests: a fresh, empty PostgreSQL database (no migrations applied)."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from tests.conftest import POSTGRES_URL


@pytest.fixture
def empty_postgres() -> Iterator[str]:
    """A PostgreSQL database with nothing in it; dropped afterwards. Skips when PostgreSQL is not reachable."""
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"hbt_empty_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        pytest.skip(f"needs PostgreSQL at {POSTGRES_URL} (set HOLDBACK_TEST_POSTGRES_URL): {exc.orig}")
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
