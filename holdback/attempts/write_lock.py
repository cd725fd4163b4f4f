"""SQLite's write lock for the attempt transactions: every transaction starts with BEGIN IMMEDIATE, and the lock
is asked for by polling with a short backoff rather than through SQLite's busy handler."""

from __future__ import annotations

import sqlite3
import time

from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError

from holdback.db import make_engine

# SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100 ms between tries for the
# write lock, so a worker process whose first try failed idles for tens of ms after the other process's
# group commit (a few ms) has released it: with two processes, each lane slept a quarter of its time. The
# worker asks for the lock itself instead, every WRITE_LOCK_POLL_MIN doubling to WRITE_LOCK_POLL_MAX.
WRITE_LOCK_POLL_MIN = 0.0002
WRITE_LOCK_POLL_MAX = 0.002
WRITE_LOCK_TIMEOUT = 30.0  # as holdback.db's busy timeout: then "database is locked", as before


def make_worker_engine(url: str, pool_size: int) -> Engine:
    """holdback's engine; on SQLite every transaction starts with BEGIN IMMEDIATE.

    Both of an attempt's transactions read, then write. SQLite's default deferred BEGIN would fail such a
    transaction at once with "database is locked" when another process wrote in between (WAL snapshot);
    taking the write lock up front makes it wait for the lock instead (`begin_immediate`).
    """
    engine = make_engine(url, pool_size=pool_size)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _autocommit_driver(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # let SQLAlchemy's BEGIN below be the only one
            # No sleeping busy handler: a locked BEGIN fails at once and begin_immediate polls. Inside the
            # transaction WAL needs no other lock; a rare busy there fails the group, whose calls the lane
            # retries one by one.
            dbapi_conn.execute("PRAGMA busy_timeout=0")

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn):  # noqa: ANN001
            try:
                begin_immediate(conn.connection.driver_connection, WRITE_LOCK_TIMEOUT)
            except sqlite3.Error as exc:  # as SQLAlchemy raises it from a statement: the lane retries these
                raise OperationalError("BEGIN IMMEDIATE", None, exc) from exc

    return engine


def begin_immediate(dbapi_conn: sqlite3.Connection, timeout: float) -> None:
    """BEGIN IMMEDIATE on a connection without a busy handler, polling with a short backoff while another
    process holds the write lock, so the lock is taken within a couple of ms of its release."""
    deadline = time.monotonic() + timeout
    pause = WRITE_LOCK_POLL_MIN
    while True:
        try:
            dbapi_conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, WRITE_LOCK_POLL_MAX)
