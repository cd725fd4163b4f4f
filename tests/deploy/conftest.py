"""Fixtures for the deployment tests: an empty PostgreSQL database and a real S3-compatible server."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from bench.lib.s3_server import S3Server
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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One real S3-compatible server (moto's server mode, a subprocess) for the session's tests."""
    server = S3Server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_settings(s3_server: S3Server) -> dict[str, object]:
    """Settings overrides that put this test's files in a fresh bucket on the S3 server."""
    env = s3_server.env(s3_server.bucket())
    return {name.removeprefix("HOLDBACK_").lower(): value for name, value in env.items()}
