"""Many processes migrating one empty PostgreSQL database at once all succeed (the advisory lock)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, inspect, text

REPLICAS = 3


def _upgrade_processes(url: str, tmp_path: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "DATABASE_URL": url, "HOLDBACK_DATA_DIR": str(tmp_path)}
    # All started before any is waited on: their upgrades overlap (start-up alone takes ~1 s each).
    return [
        subprocess.Popen([sys.executable, "-m", "holdback.cli", "db", "upgrade"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(REPLICAS)
    ]


def test_three_concurrent_upgrades_on_an_empty_database_all_succeed(empty_postgres: str, tmp_path: Path) -> None:
    procs = _upgrade_processes(empty_postgres, tmp_path)
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    engine = create_engine(empty_postgres)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert len(versions) == 1, versions
    assert {"files", "batches", "request_rows", "attempts"} <= tables
