"""One attempt of one request row: open it in the database, send it through the gateway, record the answer.

The one attempt runner of holdback: the asyncio worker runs many of these at once, `async_processor.job.run_request`
runs one for a plain RQ worker, and the processor's sync mode (`batch_processor.sync_handoff`) runs its
requests with it too — the same sends (`holdback.attempts.send`), the same mapping of a failed send
(`transport_reply`), the same recording of what an answer means for the row. Database work is two
transactions (`transactions.open_attempt`, which also reads what a resumed request continues, then
`transactions.record_attempt`), each run on a database lane (`holdback.attempts.lanes`) because SQLAlchemy's
engine is synchronous. Resumable requests are sent streamed (`holdback.attempts.resume` plans them,
`holdback.attempts.stream` folds their events), the rest as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from sqlalchemy.orm import Session, sessionmaker

from holdback import tracing
from holdback.attempts.lanes import DatabaseLane
from holdback.attempts.outcomes import Reply
from holdback.attempts.resume import STREAM_INTERVAL, attempt_tokens, plan_attempt, send_headers, streamed_reply
from holdback.attempts.retry import RetryPolicy
from holdback.attempts.send import send_plain, send_streamed
from holdback.attempts.transactions import (
    NEAR_END, Disposition, OpenAttempt, Recorded, Skip, open_attempt, record_attempt,
)
from holdback.attempts.write_lock import make_worker_engine
from holdback.db import make_sessionmaker
from holdback.results import unfinished_up_to

T = TypeVar("T")
# Each batch's trace context, read once per batch by this process (only while tracing is on).
BATCH_CONTEXTS = tracing.BatchContexts()


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
    # Tokens per event of a resumable stream (vLLM's `stream_interval`; 1: every token, and the field not sent).
    stream_interval: int = STREAM_INTERVAL
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
             stream_interval: int = STREAM_INTERVAL, owns_engine: bool = True, lane_name: str = "db") -> "Runtime":
        """A runtime whose database lanes use these sessions."""
        # SQLite has one writer at a time: more lanes would only queue on its lock.
        n = 1 if sessions.kw["bind"].dialect.name == "sqlite" else max(1, db_lanes)
        lanes = [DatabaseLane(sessions, f"{lane_name}-{i}") for i in range(n)]
        return cls(sessions, lanes, gateway_url.rstrip("/"), gateway_key, policy, worker_name, request_timeout,
                   resume, stream_interval, owns_engine)

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
    """One job in flight in this process: what a batch cancel needs to abort it, and whether its answer began."""

    __slots__ = ("request_id", "batch_id", "send_task", "abort_reason", "resend", "answered", "started")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.batch_id: str | None = None  # known once the attempt is open
        self.send_task: asyncio.Task | None = None
        self.abort_reason: str | None = None
        self.resend = False  # aborted to be sent again at once (see `send_again`)
        self.answered = False  # the gateway answered: it no longer waits in the gateway's queue
        self.started = time.time()

    def abort(self, reason: str) -> bool:
        """Close this request's gateway connection; the gateway then aborts it at the replica."""
        self.abort_reason = reason
        if self.send_task is not None and not self.send_task.done():
            self.send_task.cancel()
            return True
        return False

    def send_again(self, reason: str) -> bool:
        """Take back an attempt still waiting in the gateway's queue, to send it again at once with what changed
        (its batch turned at risk): False when its answer began (it runs: nothing to gain, its work to lose)."""
        if self.answered or self.send_task is None or self.send_task.done():
            return False
        self.resend = True
        return self.abort(reason)


@dataclass(frozen=True)
class AttemptResult:
    skip: Skip | None = None
    attempt: OpenAttempt | None = None
    recorded: Recorded | None = None
    seconds: float = 0.0  # time spent on the gateway request


async def run_attempt(rt: Runtime, http: aiohttp.ClientSession, job: InFlight,
                      cancelled_batch: Callable[[str], bool] = lambda _batch_id: False,
                      at_risk: Callable[[str], bool] = lambda _batch_id: False) -> AttemptResult:
    """Open, send, record. A batch cancel (job.abort) ends it as `cancelled`; a shutdown re-raises. An attempt of
    a batch `at_risk` says so to the gateway (holdback.risk)."""
    attempt = await rt.db(open_attempt, job.request_id, rt.worker_name)
    if isinstance(attempt, Skip):
        return AttemptResult(skip=attempt)
    if at_risk(attempt.batch_id):
        attempt = dataclasses.replace(attempt, at_risk=True)
    plan = plan_attempt(attempt, attempt.carryover, rt.resume, rt.stream_interval)
    job.batch_id = attempt.batch_id
    started = time.monotonic()
    tokens = None
    if cancelled_batch(attempt.batch_id):
        # The cancel was published while this attempt was opening: do not send it at all.
        reply = Reply.cancelled("batch cancelled or expired before the request was sent")
    else:
        url = rt.gateway_url + (plan.path or attempt.url)

        def answered() -> None:
            job.answered = True

        sending = (
            send_streamed(http, url, plan.body, send_headers(attempt, plan, rt.gateway_key, rt.resume),
                          rt.request_timeout, answered) if plan.streamed
            else send_plain(http, url, attempt, rt.gateway_key, rt.request_timeout, answered))
        if tracing.enabled():
            sending = tracing.traced_attempt(sending, attempt, BATCH_CONTEXTS,
                                             lambda batch_id: rt.db(BATCH_CONTEXTS.load, batch_id))
        job.send_task = asyncio.ensure_future(sending)
        try:
            sent = await job.send_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if job.abort_reason is None or (current is not None and current.cancelling()):
                raise
            sent = Reply.withdrawn(job.abort_reason) if job.resend else Reply.cancelled(job.abort_reason)
        if isinstance(sent, Reply):
            reply = sent
        else:
            reply, tokens = streamed_reply(plan, sent), attempt_tokens(plan, sent)
    seconds = time.monotonic() - started
    recorded = await rt.db(record_attempt, attempt, reply, rt.policy, tokens)
    if recorded.disposition is Disposition.final and 0 < recorded.batch_left < NEAR_END:
        # Near the batch's end: count again now that this result is committed (`NEAR_END`).
        left = await rt.db(unfinished_up_to, attempt.batch_id, NEAR_END)
        recorded = dataclasses.replace(recorded, batch_left=left)
    return AttemptResult(attempt=attempt, recorded=recorded, seconds=seconds)
