"""`holdback db upgrade`: apply the schema migrations to DATABASE_URL (default: SQLite under the data dir)."""

from __future__ import annotations

import argparse

from holdback.db import make_engine
from holdback.schema import upgrade
from holdback.settings import Settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holdback db", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("upgrade", help="apply every migration up to REVISION (default head)")
    up.add_argument("revision", nargs="?", default="head")
    args = parser.parse_args(argv)
    settings = Settings()
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine, args.revision)
    print(f"database at {engine.url.render_as_string(hide_password=True)} is at {args.revision}")
    return 0
