"""`holdback keys create --tenant NAME`: create an API key for a tenant and print it once."""

from __future__ import annotations

import argparse

from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.tenancy import create_key


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holdback keys", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key; the tenant is created if it does not exist")
    create.add_argument("--tenant", required=True, help="tenant name, e.g. acme")
    args = parser.parse_args(argv)
    if not args.tenant.strip():
        parser.error("--tenant must not be empty")
    settings = Settings()
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    with transaction(make_sessionmaker(engine)) as session:
        secret = create_key(session, args.tenant.strip())
    print(secret)
    return 0
