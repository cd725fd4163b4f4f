"""One attempt of one request row: open it in the database, send it through the gateway, record the answer.

The one attempt runner of holdback: the asyncio worker runs many of these at once, `async_processor.job.run_request`
runs one for a plain RQ worker, and the processor's sync mode (`batch_processor.sync_dispatch`) runs its
requests with it too — the same sends, the same mapping of a failed send (`transport_reply`), the same
recording of what an answer means for the row (`holdback.dispatch.record_outcome`). Database work is two transactions (`holdback.dispatch.begin`, then
`record_outcome`, each wrapped by `async_processor.resume` to read and write what a resumed request needs),
each run on a database lane thread because SQLAlchemy's engine is synchronous. Resumable requests are sent
streamed (`async_processor.stream`), the rest as they are.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from holdback.attempts import resume
from holdback.attempts.stream import send_streamed, transport_reply
from holdback import tracing
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.attempts.transactions import Dispatch, Recorded, Reply, RetryPolicy, Skip
from holdback.results import deferred_batch_counts

T = TypeVar("T")
# Each batch's trace context, read once per batch by this process (only while tracing is on).
BATCH_CONTEXTS = tracing.BatchContexts()


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


class DatabaseLane:
    """One thread that runs database work in groups: every call queued while the thread was busy shares the
    next transaction (group commit), so N attempts cost one BEGIN/COMMIT instead of N.

    The group's batch counter updates are applied once per batch at its end (`deferred_batch_counts`), so
    the hot batch row is locked only for the commit. If a group's transaction fails, each call of it runs
    again alone in its own transaction (retried while
    the database is busy or away), so one bad call never fails the others.
    """

    def __init__(self, sessions: sessionmaker[Session], name: str, max_group: int = 64):
        self.sessions = sessions
        self.max_group = max_group
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((fn, args, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            while len(group) < self.max_group:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # finish this group, then stop
                    break
                group.append(more)
            group = [g for g in group if g[2].set_running_or_notify_cancel()]
            if group:
                self._run_group(group)

    def _run_group(self, group: list) -> None:
        try:
            with transaction(self.sessions) as session, deferred_batch_counts(session):
                results = [fn(session, *args) for fn, args, _ in group]
        except Exception:  # noqa: BLE001 - every call is retried alone below, with its own error
            for fn, args, future in group:
                self._run_alone(fn, args, future)
            return
        for (_, _, future), result in zip(group, results):
            future.set_result(result)

    def _run_alone(self, fn: Callable, args: tuple, future: Future) -> None:
        try:
            for attempt in Retrying(stop=stop_after_attempt(5), wait=wait_exponential(multiplier=0.05, max=2.0),
                                    retry=retry_if_exception_type(OperationalError), reraise=True):
                with attempt, transaction(self.sessions) as session, deferred_batch_counts(session):
                    result = fn(session, *args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(exc)
        else:
            future.set_result(result)


@dataclass
class Runtime:
    """What every attempt of one process shares."""

    sessions: sessionmaker[Session]
    lanes: list[DatabaseLane]
    gateway_url: str
    gateway_key: str | None
    policy: RetryPolicy
    worker_name: str
    request_timeout: float
    resume: bool = True  # evicted streams continue from their partial output (False: they restart)
    owns_engine: bool = True  # close() disposes the engine (False: it belongs to the caller)
    _next_lane: int = 0

    @classmethod
    def build(cls, database_url: str, *, db_lanes: int = 2, **options: Any) -> "Runtime":
        """A runtime with its own engine (the worker's: BEGIN IMMEDIATE on SQLite)."""
        engine = make_worker_engine(database_url, db_lanes)
        return cls.over(make_sessionmaker(engine), db_lanes=db_lanes, **options)

    @classmethod
    def over(cls, sessions: sessionmaker[Session], *, gateway_url: str, gateway_key: str | None,
             policy: RetryPolicy, worker_name: str, request_timeout: float, db_lanes: int = 2, resume: bool = True,
             owns_engine: bool = True, lane_name: str = "db") -> "Runtime":
        """A runtime whose database lanes use these sessions."""
        # SQLite has one writer at a time: more lanes would only queue on its lock.
        n = 1 if sessions.kw["bind"].dialect.name == "sqlite" else max(1, db_lanes)
        lanes = [DatabaseLane(sessions, f"{lane_name}-{i}") for i in range(n)]
        return cls(sessions, lanes, gateway_url.rstrip("/"), gateway_key, policy, worker_name, request_timeout,
                   resume, owns_engine)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self.owns_engine:
            self.sessions.kw["bind"].dispose()

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(session, *args) in a transaction on a database lane (possibly shared with other calls)."""
        lane = self.lanes[self._next_lane % len(self.lanes)]
        self._next_lane += 1
        return await asyncio.wrap_future(lane.submit(fn, *args))


class InFlight:
    """One job in flight in this process: what a batch cancel needs to abort it."""

    __slots__ = ("row_id", "batch_id", "send_task", "abort_reason", "started")

    def __init__(self, row_id: str):
        self.row_id = row_id
        self.batch_id: str | None = None  # known once the attempt is open
        self.send_task: asyncio.Task | None = None
        self.abort_reason: str | None = None
        self.started = time.time()

    def abort(self, reason: str) -> bool:
        """Close this request's gateway connection; the gateway then aborts it at the replica."""
        self.abort_reason = reason
        if self.send_task is not None and not self.send_task.done():
            self.send_task.cancel()
            return True
        return False


@dataclass(frozen=True)
class AttemptResult:
    skip: Skip | None = None
    dispatch: Dispatch | None = None
    recorded: Recorded | None = None
    seconds: float = 0.0  # time spent on the gateway request


async def send(http: aiohttp.ClientSession, url: str, dispatch: Dispatch, gateway_key: str | None,
               timeout: float) -> Reply:
    """POST the row's body to the gateway; every failure to get a complete answer is a transport error."""
    try:
        async with http.post(url, data=dispatch.body.encode(), headers=tracing.inject(dispatch.headers(gateway_key)),
                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            return Reply(resp.status, resp.headers, body)
    except aiohttp.ClientPayloadError as exc:
        return Reply.transport_error(f"truncated answer: {exc}")
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        return transport_reply(exc, timeout)


async def run_attempt(rt: Runtime, http: aiohttp.ClientSession, job: InFlight,
                      cancelled_batch: Callable[[str], bool] = lambda _batch_id: False) -> AttemptResult:
    """Begin, send, record. A batch cancel (job.abort) ends it as `cancelled`; a shutdown re-raises."""
    opened = await rt.db(resume.open_attempt, job.row_id, rt.worker_name)
    if isinstance(opened, Skip):
        return AttemptResult(skip=opened)
    dispatch, progress = opened
    plan = resume.plan_attempt(dispatch, progress, rt.resume)
    job.batch_id = dispatch.batch_id
    started = time.monotonic()
    tokens = None
    if cancelled_batch(dispatch.batch_id):
        # The cancel was published while this attempt was opening: do not send it at all.
        reply = Reply.cancelled("batch cancelled or expired before the request was sent")
    else:
        url = rt.gateway_url + dispatch.url
        sending = (
            send_streamed(http, url, plan.body, resume.headers(dispatch, plan, rt.gateway_key, rt.resume),
                          rt.request_timeout) if plan.streamed
            else send(http, url, dispatch, rt.gateway_key, rt.request_timeout))
        if tracing.enabled():
            sending = tracing.traced_attempt(sending, dispatch, BATCH_CONTEXTS,
                                             lambda batch_id: rt.db(BATCH_CONTEXTS.load, batch_id))
        job.send_task = asyncio.ensure_future(sending)
        try:
            sent = await job.send_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if job.abort_reason is None or (current is not None and current.cancelling()):
                raise
            sent = Reply.cancelled(job.abort_reason)
        if isinstance(sent, Reply):
            reply = sent
        else:
            reply, tokens = resume.streamed_reply(plan, sent), resume.attempt_tokens(plan, sent)
    seconds = time.monotonic() - started
    recorded = await rt.db(resume.record_attempt, dispatch, reply, rt.policy, tokens)
    return AttemptResult(dispatch=dispatch, recorded=recorded, seconds=seconds)
