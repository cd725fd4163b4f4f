"""Apply the Alembic migrations in `migrations/` to a database URL.

On PostgreSQL every upgrade first takes one advisory lock, so N API replicas and migration Jobs
booting together run the migrations one after another instead of racing on `CREATE TABLE`. A database
already at head is left as it is without loading Alembic (about 0.15 CPU-seconds at every API start).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
# One fixed 64-bit key per database (advisory locks are scoped to the database): "holdback" in ASCII.
MIGRATION_LOCK_KEY = int.from_bytes(b"holdback", "big") & 0x7FFF_FFFF_FFFF_FFFF


def alembic_config(url: str) -> Config:
    from alembic.config import Config

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
    with engine.begin() as connection:
        take_migration_lock(connection)
        if revision == "head" and at_head(connection):
            return
        from alembic import command

        cfg = alembic_config(engine.url.render_as_string(hide_password=False))
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def at_head(connection: Connection) -> bool:
    """Does the database stand at every head of `migrations/` already (nothing to apply)?"""
    heads = head_revisions()
    if heads is None or not inspect(connection).has_table("alembic_version"):
        return False
    return {row[0] for row in connection.execute(text("SELECT version_num FROM alembic_version"))} == heads


@functools.cache
def head_revisions() -> frozenset[str] | None:
    """The revisions no migration builds on, read from the files' `revision` and `down_revision` lines as
    Alembic's script directory finds them; None (ask Alembic) where a file is not that plain: branch labels,
    dependencies, a revision that is not a literal."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS / "versions").glob("*.py"):
        found = {}
        try:
            body = ast.parse(path.read_text()).body
        except SyntaxError:
            return None  # Alembic says what is wrong with it
        for node in body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                name, value = node.target.id, node.value
            else:
                continue
            if name in ("revision", "down_revision", "branch_labels", "depends_on"):
                try:
                    found[name] = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError):
                    return None
        if "revision" not in found:
            continue  # not a migration (the package's __init__)
        if not isinstance(found["revision"], str) or found.get("branch_labels") or found.get("depends_on"):
            return None
        down = found.get("down_revision")
        revisions.add(found["revision"])
        parents.update((down,) if isinstance(down, str) else down or ())
    return frozenset(revisions - parents) or None


def take_migration_lock(connection: Connection) -> None:
    """Block until this transaction holds the migration lock (released at commit or rollback)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
