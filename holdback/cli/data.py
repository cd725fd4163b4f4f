"""`holdback data`: what takes room in the data dir, what bounds each part, and trimming the part nothing bounds.

`usage` lists the parts (`holdback up`'s logs, the local file store, SQLite, the embedded Redis) with their size
and what keeps each in check. `trim-logs` cuts each log in `logs/` to its last lines; it is safe while
`holdback up` runs, since every child appends to its log (a line written in the instant of the cut may be lost).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from holdback.cli.instance_lock import LOCK_FILE, holder_pid
from holdback.settings import Settings

MIB = 1024 * 1024


@dataclass(frozen=True)
class DataDirPart:
    name: str
    bytes: int
    files: int
    bounds: str  # what keeps it in check, or that nothing does


def tree_size(path: Path) -> tuple[int, int]:
    """Bytes and number of regular files below `path` (a file counts itself); (0, 0) when missing."""
    if path.is_file():
        return path.stat().st_size, 1
    total = count = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += (Path(root) / name).lstat().st_size
                count += 1
            except FileNotFoundError:  # removed while we walked (a finished upload's temp file)
                continue
    return total, count


def parts(settings: Settings) -> list[DataDirPart]:
    """The parts of the data dir, in the order they usually grow, each with what bounds it."""
    data = settings.data_dir
    found = [DataDirPart("logs/", *tree_size(data / "logs"),
                         "grows without bound: each child of `holdback up` appends to its log; "
                         "`holdback data trim-logs` cuts them")]
    if settings.files_url is None:
        grace_days = settings.file_retention_grace_seconds / 86400
        found.append(DataDirPart("files/", *tree_size(settings.files_dir),
                                 "bounded by retention: batch inputs and results expire after 30 days (or their "
                                 "expires_after); the processors delete expired bytes every minute (`holdback files "
                                 f"gc` now), their rows {grace_days:g} days later"))
    if settings.database_url is None:
        size = sum(tree_size(data / f"holdback.db{suffix}")[0] for suffix in ("", "-wal", "-shm"))
        found.append(DataDirPart("holdback.db", size, 1 if size else 0,
                                 "grows without bound: every batch, request and attempt is kept for the API and the "
                                 "dashboard; to start afresh, stop `holdback up` and delete the data dir"))
    if settings.redis_url is None:
        found.append(DataDirPart("redis/", *tree_size(data / "redis"),
                                 "bounded by the queue: a request's job leaves it when the request ends (a failed one "
                                 "after 7 days)"))
    known = {p.name.rstrip("/") for p in found} | {"holdback.db-wal", "holdback.db-shm"}
    rest = [tree_size(p) for p in (data.iterdir() if data.is_dir() else []) if p.name not in known]
    found.append(DataDirPart("other", sum(b for b, _ in rest), sum(n for _, n in rest),
                             "the local keys and the lock of `holdback up`"))
    return found


def trim(path: Path, keep: int) -> tuple[int, int]:
    """Cut the file to (at most) its last `keep` bytes, starting at a line; returns the sizes before and after.

    Rewritten in place rather than replaced: a process appending to the file (O_APPEND, as `holdback up`'s
    children do) goes on writing at its new end.
    """
    with open(path, "r+b") as f:
        before = f.seek(0, os.SEEK_END)
        if before <= keep:
            return before, before
        f.seek(before - keep)
        tail = f.read()
        newline = tail.find(b"\n")
        tail = tail[newline + 1:] if newline >= 0 else tail  # one line longer than `keep`: its end
        f.seek(0)
        f.write(tail)
        f.truncate(len(tail))
        return before, len(tail)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("usage", help="each part of the data dir (HOLDBACK_DATA_DIR, default ./data): its size and "
                                 "what bounds it")
    tl = sub.add_parser("trim-logs", help="cut each log in the data dir's logs/ to its last lines")
    tl.add_argument("--keep-mb", type=float, default=10.0,
                    help="MiB of each log to keep, its most recent lines (default %(default)s)")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    settings = Settings()
    data = settings.data_dir.resolve()
    if not data.is_dir():
        p.error(f"no data dir at {data}: run this where `holdback up` runs, or set HOLDBACK_DATA_DIR to its data dir")
    if args.action == "usage":
        pid = holder_pid(data / LOCK_FILE)
        running = f" (held by `holdback up`, pid {pid})" if pid else ""
        print(f"data dir {data}{running}")
        for part in parts(settings):
            print(f"  {part.name:<12} {_size(part.bytes):>10} in {part.files} file(s): {part.bounds}")
        if settings.database_url is not None or settings.redis_url is not None or settings.files_url is not None:
            print("  (the database, Redis or file store named by DATABASE_URL, REDIS_URL or HOLDBACK_FILES_URL is "
                  "not in the data dir)")
        return 0
    if args.keep_mb < 0:
        p.error(f"--keep-mb must be at least 0, got {args.keep_mb:g}")
    logs = sorted((data / "logs").glob("*.log"))
    if not logs:
        print(f"no logs in {data / 'logs'}")
    for path in logs:
        before, after = trim(path, int(args.keep_mb * MIB))
        print(f"{path}: {_size(before)} -> {_size(after)}")
    return 0

