"""holdback.schema: a database already at head is left alone without loading Alembic; one behind is upgraded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from holdback.db import make_engine
from holdback.schema import alembic_config, head_revisions

REPO = Path(__file__).resolve().parents[2]
# In a fresh interpreter, as `holdback api` runs it at start: upgrade, then whether Alembic was loaded.
UPGRADE = ("import json, sys\nfrom holdback.db import make_engine\nfrom holdback.schema import upgrade\n"
           "upgrade(make_engine(sys.argv[1]))\nprint(json.dumps('alembic' in sys.modules))")


def test_the_heads_read_from_the_migration_files_are_alembics() -> None:
    assert head_revisions() == frozenset(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def _upgrade_loads_alembic(url: str) -> bool:
    done = subprocess.run([sys.executable, "-c", UPGRADE, url], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _versions(engine) -> set[str]:  # noqa: ANN001
    with engine.connect() as conn:
        return {row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))}


def test_upgrade_loads_alembic_only_when_there_is_something_to_apply(backend) -> None:  # noqa: ANN001
    engine = make_engine(backend.database_url)
    try:
        assert _versions(engine) == set(head_revisions())
        assert _upgrade_loads_alembic(backend.database_url) is False, "at head: nothing to apply, Alembic not needed"

        with engine.begin() as conn:
            cfg = alembic_config(backend.database_url)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "-1")
        assert _versions(engine) != set(head_revisions())
        assert _upgrade_loads_alembic(backend.database_url) is True
        assert _versions(engine) == set(head_revisions()), "one revision behind: upgraded to head"
    finally:
        engine.dispose()
