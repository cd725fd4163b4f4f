"""The migrations build exactly the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from holdback.db import make_engine
from holdback.models import Base


def test_migrated_database_matches_the_models(backend) -> None:  # noqa: ANN001
    engine = make_engine(backend.database_url)
    try:
        with engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert differences == [], f"models and migrations disagree; add a migration: {differences}"
