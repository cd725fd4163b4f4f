"""The worker's SQLite write lock: taken by polling with a short backoff (no sleeping busy handler), with the
old timeout and error when another process never lets go, and safe for two engines writing one file at once."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from holdback.attempts import write_lock
from holdback.attempts.lanes import DatabaseLane
from holdback.attempts.write_lock import begin_immediate, make_worker_engine
from holdback.db import make_sessionmaker


@pytest.fixture
def db_file(tmp_path):
    path = tmp_path / "lock.db"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
    setup.execute("INSERT INTO counter VALUES (1, 0)")
    setup.close()
    return path


def _connect(path) -> sqlite3.Connection:
    """A connection without a busy handler, as the worker engine's."""
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)


def test_a_held_lock_fails_with_database_is_locked_after_the_timeout(db_file):
    holder, waiter = _connect(db_file), _connect(db_file)
    holder.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        begin_immediate(waiter, timeout=0.2)
    assert time.monotonic() - started >= 0.2  # it kept asking until its deadline, not only once
    holder.execute("COMMIT")
    begin_immediate(waiter, timeout=0.2)  # free now: taken at the first try
    assert waiter.in_transaction


def test_the_lock_is_taken_once_the_other_writer_commits(db_file):
    holder, waiter = _connect(db_file), _connect(db_file)
    holder.execute("BEGIN IMMEDIATE")
    done = threading.Event()

    def take() -> None:
        begin_immediate(waiter, timeout=30)
        waiter.execute("UPDATE counter SET n = n + 1")
        waiter.execute("COMMIT")
        done.set()

    thread = threading.Thread(target=take)
    thread.start()
    holder.execute("UPDATE counter SET n = n + 10")
    assert not done.is_set()  # the waiter cannot have written while the holder has the lock
    holder.execute("COMMIT")
    assert done.wait(20), "the waiter never took the released lock"
    thread.join(5)
    assert holder.execute("SELECT n FROM counter").fetchone() == (11,)


def test_an_error_other_than_busy_is_raised_at_once(db_file):
    conn = _connect(db_file)
    conn.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="within a transaction"):
        begin_immediate(conn, timeout=30)
    assert time.monotonic() - started < 10


def test_the_worker_engine_has_no_busy_handler_and_reports_a_lock_timeout_as_sqlalchemy_does(db_file, monkeypatch):
    engine = make_worker_engine(f"sqlite:///{db_file}", pool_size=1)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 0
        holder = _connect(db_file)
        holder.execute("BEGIN IMMEDIATE")
        monkeypatch.setattr(write_lock, "WRITE_LOCK_TIMEOUT", 0.1)
        with pytest.raises(OperationalError, match="database is locked"), engine.begin() as conn:
            conn.execute(text("UPDATE counter SET n = n + 1"))
        holder.execute("COMMIT")
        with engine.begin() as conn:
            conn.execute(text("UPDATE counter SET n = n + 1"))
        assert holder.execute("SELECT n FROM counter").fetchone() == (1,)
    finally:
        engine.dispose()


def test_two_worker_engines_writing_one_file_lose_no_update(db_file):
    """As two worker processes do: each engine's lane groups calls into transactions that contend for the one
    write lock; every call commits exactly once."""
    engines = [make_worker_engine(f"sqlite:///{db_file}", pool_size=1) for _ in range(2)]
    lanes = [DatabaseLane(make_sessionmaker(e), f"lane-{i}") for i, e in enumerate(engines)]

    def bump(session) -> int:  # noqa: ANN001
        return session.execute(text("UPDATE counter SET n = n + 1 RETURNING n")).scalar_one()

    try:
        futures = [lane.submit(bump) for _ in range(300) for lane in lanes]
        seen = sorted(f.result(timeout=60) for f in futures)
    finally:
        for lane in lanes:
            lane.close()
        for e in engines:
            e.dispose()
    assert seen == list(range(1, 601))  # every increment applied once, none lost or repeated
