"""`holdback files gc`: run the file collector once (the processors also run it every minute)."""

from __future__ import annotations

import argparse
import json

from holdback.db import make_engine, make_sessionmaker
from holdback.retention import FileCollector
from holdback.settings import Settings
from holdback.storage import open_file_store


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holdback files", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    gc = sub.add_parser("gc", help="delete expired files' bytes, then rows deleted longer than the grace period ago",
                        description="Deletes the bytes of files past their expires_at (never the input of a running "
                        "batch), then removes file rows deleted more than --grace-seconds ago. Prints a JSON summary.")
    gc.add_argument("--batch-size", type=int, default=500, help="files per database step (default 500)")
    gc.add_argument("--max-batches", type=int, default=1000, help="most steps of each kind in this run (default 1000)")
    gc.add_argument("--grace-seconds", type=int, default=None,
                    help="keep deleted rows this long (default HOLDBACK_FILE_RETENTION_GRACE_SECONDS, 7 days)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_batches < 1 or (args.grace_seconds is not None and args.grace_seconds < 0):
        parser.error("--batch-size and --max-batches must be at least 1 and --grace-seconds at least 0")
    settings = Settings()
    engine = make_engine(settings.sqlalchemy_url)
    try:
        collector = FileCollector(
            make_sessionmaker(engine), open_file_store(settings),
            grace_seconds=settings.file_retention_grace_seconds if args.grace_seconds is None else args.grace_seconds,
            batch_size=args.batch_size, max_batches=args.max_batches,
        )
        result = collector.run()
    finally:
        engine.dispose()
    print(json.dumps({"expired": result.expired, "bytes_deleted": result.bytes_deleted, "purged": result.purged,
                      "kept_in_use": result.kept_in_use}))
    return 0
