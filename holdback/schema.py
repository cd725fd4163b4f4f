"""Apply the Alembic migrations in `migrations/` to a database URL.

On PostgreSQL every upgrade first takes one advisory lock, so N API replicas and migration Jobs
booting together run the migrations one after another instead of racing on `CREATE TABLE`.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, text

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
# One fixed 64-bit key per database (advisory locks are scoped to the database): "holdback" in ASCII.
MIGRATION_LOCK_KEY = int.from_bytes(b"holdback", "big") & 0x7FFF_FFFF_FFFF_FFFF


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision`; safe to run from many processes at once.

    PostgreSQL: a transaction-scoped advisory lock serialises the upgraders; the second one waits,
    then finds the schema already at head (READ COMMITTED sees the first one's commit) and does
    nothing. SQLite: the database file's write lock serialises them.
    """
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        take_migration_lock(connection)
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def take_migration_lock(connection: Connection) -> None:
    """Block until this transaction holds the migration lock (released at commit or rollback)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
