"""`holdback keys`: create, list and revoke tenant API keys in the database the server uses.

The database is DATABASE_URL, or SQLite under HOLDBACK_DATA_DIR (default ./data), exactly as
`holdback up` and `holdback api` resolve it; every command says which one it used. A SQLite file
that does not exist yet is created only with --create, so a key is never written where no server reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sqlalchemy import inspect, select

from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.models import ApiKey
from holdback.tenancy import create_key, hash_key, list_keys, revoke_key


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="holdback keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--create", action="store_true",
                        help="create (and migrate) the database when it does not exist yet")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key; the tenant is created if it does not exist")
    create.add_argument("--tenant", required=True, help="tenant name, e.g. acme")
    create.add_argument("--create", action="store_true", default=argparse.SUPPRESS,
                        help="create the database when it does not exist yet")
    listing = sub.add_parser("list", help="list keys (id, tenant, prefix, created, revoked); secrets are never shown")
    listing.add_argument("--tenant", help="only this tenant's keys")
    revoke = sub.add_parser("revoke", help="revoke a key by id (from `holdback keys list`); it answers 401 after")
    revoke.add_argument("key_id", help="e.g. key_0a1b2c...")
    return parser


def database_label(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _sqlite_missing(url: str) -> Path | None:
    if not url.startswith("sqlite"):
        return None
    path = Path(url.split("///", 1)[-1])
    return None if path.exists() else path


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.action == "create" and not args.tenant.strip():
        parser.error("--tenant must not be empty")
    settings = Settings()
    url = settings.sqlalchemy_url
    missing = _sqlite_missing(url)
    if missing is not None and not args.create:
        print(f"holdback keys: no database at {missing}. Run this where `holdback up` runs, or set "
              "HOLDBACK_DATA_DIR (or DATABASE_URL) to the server's; add --create to start a new database there.",
              file=sys.stderr)
        return 2
    engine = make_engine(url)
    try:
        if missing is not None or "tenants" not in inspect(engine).get_table_names():
            if not args.create:
                print(f"holdback keys: the database {database_label(url)} has no holdback schema; run "
                      "`holdback db upgrade` or add --create.", file=sys.stderr)
                return 2
            upgrade(engine)
        print(f"database: {database_label(url)}", file=sys.stderr)
        with transaction(make_sessionmaker(engine)) as session:
            return _run(args, session)
    finally:
        engine.dispose()


def _run(args: argparse.Namespace, session) -> int:  # noqa: ANN001
    if args.action == "create":
        secret = create_key(session, args.tenant.strip())
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(secret)))
        # The secret alone on stdout, so `KEY=$(holdback keys create ...)` still works; the id beside it on stderr.
        print(secret)
        print(f"key id: {key_id} (tenant {args.tenant.strip()}; shown once: the secret cannot be read back; "
              f"`holdback keys revoke {key_id}` revokes it)", file=sys.stderr)
        return 0
    if args.action == "list":
        keys = list_keys(session, args.tenant)
        print(f"{'ID':<32} {'TENANT':<20} {'PREFIX':<10} {'CREATED (UTC)':<20} REVOKED (UTC)")
        for k in keys:
            print(f"{k.id:<32} {k.tenant:<20} {k.prefix:<10} {_when(k.created_at):<20} {_when(k.revoked_at)}")
        return 0
    key = revoke_key(session, args.key_id)
    if key is None:
        print(f"holdback keys: no key with id {args.key_id!r}; see `holdback keys list`", file=sys.stderr)
        return 1
    print(f"revoked {key.id} ({key.tenant}, {key.prefix}...) at {_when(key.revoked_at)}")
    return 0


def _when(ts: int | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
