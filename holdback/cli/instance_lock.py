"""One `holdback up` per data dir: a pid file held with an exclusive `flock`.

The kernel drops the lock when its holder dies, however it dies, so a stale pid file never blocks a
restart; a live holder is named in the refusal. Children do not inherit the descriptor.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "holdback-up.pid"


class AlreadyRunning(RuntimeError):
    def __init__(self, path: Path, pid: int | None):
        self.path, self.pid = path, pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"holdback up is already running for this data dir ({holder} holds {path}); "
                         f"stop it first (kill -TERM {pid or '<pid>'}) or set HOLDBACK_DATA_DIR to another directory")


@dataclass
class InstanceLock:
    path: Path
    fd: int

    @classmethod
    def acquire(cls, data_dir: Path) -> "InstanceLock":
        path = (data_dir / LOCK_FILE).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder_pid(path)
            os.close(fd)
            raise AlreadyRunning(path, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        os.ftruncate(self.fd, 0)  # an empty file: nobody holds it (unlinking could race a starting successor)
        os.close(self.fd)


def holder_pid(path: Path) -> int | None:
    """The pid written in the lock file, when that process is alive."""
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    return pid
