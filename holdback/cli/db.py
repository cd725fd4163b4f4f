"""`holdback db upgrade`: apply the schema migrations to DATABASE_URL (default: SQLite under the data dir)."""

from __future__ import annotations

import argparse

from holdback.db import make_engine
from holdback.schema import upgrade
from holdback.settings import Settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holdback db", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("upgrade", help="apply every migration up to REVISION (default head)",
                        description="Apply the schema migrations to the database every holdback process of this "
                                    "deployment uses (DATABASE_URL, or SQLite under HOLDBACK_DATA_DIR). Safe to run "
                                    "while API servers start: a PostgreSQL advisory lock runs them one at a time.")
    up.add_argument("revision", nargs="?", default="head",
                    help="the migration to stop at: an id from migrations/versions/, or head, the newest "
                         "(default %(default)s)")
    args = parser.parse_args(argv)
    settings = Settings()
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine, args.revision)
    print(f"database at {engine.url.render_as_string(hide_password=True)} is at {args.revision}")
    return 0
