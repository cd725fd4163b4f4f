"""The sync mode's hand-off: the processor sends requests to the gateway itself (`--dispatch sync`).

Requests run on an asyncio loop in a background thread, at most `limit` at a time, where `limit`
adapts by AIMD between 1 and `--sync-concurrency`: +1 on every success, halved on a 429 or 5xx
(once per round trip: only an answer to a request sent after the last decrease halves it again).
Each request is one run of the attempt runner the async workers use (`holdback.attempts.run_attempt`):
the same send (streamed and resumable where the request allows it), the same mapping of a failed send,
and the same recording, on database lanes over the processor's own engine. A row
that must retry goes to `retry_wait` and the processor hands it back when its time has come, so no slot
is held while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import aiohttp
from redis.exceptions import RedisError
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.metrics import ProcessorMetrics
from holdback.attempts import InFlight, RetryPolicy, Runtime, run_attempt
from holdback.logs import log_event
from holdback.models import AttemptOutcome

if TYPE_CHECKING:  # batch_processor.handoff builds this hand-off: it imports this module
    from batch_processor.handoff import QueueHandoff

log = logging.getLogger("batch_processor.sync")
ABORTED_MEMORY = 1024  # batch ids remembered as aborted (for requests whose attempt is opening meanwhile)
ABORT_REASON = "batch cancelled or expired"


class Aimd:
    """Additive-increase, multiplicative-decrease concurrency limit."""

    def __init__(self, maximum: int, minimum: int = 1):
        if maximum < minimum:
            raise ValueError(f"sync concurrency must be at least {minimum}, got {maximum}")
        self.minimum = minimum
        self.maximum = maximum
        self.limit = maximum
        self._last_decrease = float("-inf")

    def on_success(self) -> None:
        self.limit = min(self.maximum, self.limit + 1)

    def on_overload(self, sent_at: float) -> bool:
        """Halve, unless the request went out before the last halving (one decrease per round trip)."""
        if sent_at < self._last_decrease:
            return False
        self.limit = max(self.minimum, self.limit // 2)
        self._last_decrease = time.monotonic()
        return True


class SyncHandoff:
    """The `Handoff` of the sync mode (`batch_processor.handoff`); `queue`, the RQ side beside it, is stopped and
    read for live ids too (the processor's always is; a test's may be absent)."""

    schedules_retries = False  # the processor hands due retries back: nothing else would wake them

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        gateway_url: str,
        gateway_key: str | None,
        worker_name: str,
        max_concurrency: int,
        policy: RetryPolicy = RetryPolicy(),
        request_timeout: float = 600.0,
        metrics: ProcessorMetrics | None = None,
        db_lanes: int = 2,
        queue: QueueHandoff | None = None,
    ):
        self.metrics = metrics
        self.queue = queue
        self.aimd = Aimd(max_concurrency)
        self.rt = Runtime.over(factory, gateway_url=gateway_url, gateway_key=gateway_key, policy=policy,
                               worker_name=worker_name, request_timeout=request_timeout, db_lanes=db_lanes,
                               owns_engine=False, lane_name="sync-db")
        self._lock = threading.Lock()
        self._held: set[str] = set()  # request ids waiting here or running: what reconciliation must leave alone
        self._loop = asyncio.new_event_loop()
        self._waiting: deque[tuple[str, str]] = deque()
        self._running: dict[asyncio.Task, InFlight] = {}
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-handoff", daemon=True)
        self._thread.start()
        self._http: aiohttp.ClientSession = self._call(self._make_client())
        self._main = asyncio.run_coroutine_threadsafe(self._send_loop(), self._loop)

    async def _make_client(self) -> aiohttp.ClientSession:
        self._wake = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=self.aimd.maximum, limit_per_host=0, keepalive_timeout=30)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- called from the processor thread -------------------------------------------------------

    def push(self, rows: list[tuple[str, str]], at_front: bool = False) -> int:
        """Take (request id, batch id) pairs to send, in order (`at_front` has no meaning here: they all wait in
        this process, behind nothing but each other)."""
        with self._lock:
            self._held.update(request_id for request_id, _ in rows)
        self._loop.call_soon_threadsafe(self._accept, list(rows))
        return len(rows)

    def live_ids(self) -> set[str]:
        live = self.queue.live_ids() if self.queue is not None else set()
        with self._lock:
            return live | self._held

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._held)

    def capacity(self) -> int:
        return self.aimd.maximum

    def stop(self, batch_id: str, request_ids: list[str]) -> int:
        """Stop the batch on the RQ side, then drop its rows waiting here and abort its running requests (their
        connections close)."""
        listeners = self.queue.stop(batch_id, request_ids) if self.queue is not None else 0
        self._loop.call_soon_threadsafe(self._abort, batch_id)
        return listeners

    def close(self, drain_timeout: float = 10.0) -> list[str]:
        """Stop: let running requests finish for up to `drain_timeout`, abort the rest; returns the ids
        that never started (still `queued` in the database) so the caller can hand them back."""
        unstarted = self._call(self._stop_accepting())
        try:
            self._main.result(timeout=drain_timeout)
        except TimeoutError:
            self._call(self._abort_all())
            self._main.result(timeout=30)
        self._call(self._http.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.rt.close()
        return unstarted

    # --- on the loop thread -----------------------------------------------------------------------

    def _accept(self, rows: list[tuple[str, str]]) -> None:
        self._waiting.extend(rows)
        self._wake.set()

    def _abort(self, batch_id: str) -> None:
        self._aborted[batch_id] = None
        while len(self._aborted) > ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        kept = deque(job for job in self._waiting if job[1] != batch_id)
        dropped = [request_id for request_id, b in self._waiting if b == batch_id]
        self._waiting = kept
        with self._lock:
            self._held.difference_update(dropped)
        for job in list(self._running.values()):
            if job.batch_id == batch_id:
                job.abort(ABORT_REASON)

    async def _abort_all(self) -> None:
        for job in list(self._running.values()):
            job.abort("the processor is stopping")

    async def _stop_accepting(self) -> list[str]:
        self._closing = True
        unstarted = [request_id for request_id, _ in self._waiting]
        self._waiting.clear()
        with self._lock:
            self._held.difference_update(unstarted)
        self._wake.set()
        return unstarted

    async def _send_loop(self) -> None:
        while True:
            while self._waiting and len(self._running) < self.aimd.limit and not self._closing:
                request_id, batch_id = self._waiting.popleft()
                job = InFlight(request_id)
                job.batch_id = batch_id  # known from the plan: a cancel can reach it before its attempt opens
                task = asyncio.create_task(self._run_one(job))
                self._running[task] = job
                task.add_done_callback(self._finished)
            if self._closing and not self._running:
                return
            self._wake.clear()
            await self._wake.wait()

    def _finished(self, task: asyncio.Task) -> None:
        job = self._running.pop(task)
        with self._lock:
            self._held.discard(job.request_id)
        self._wake.set()

    async def _run_one(self, job: InFlight) -> None:
        sent_at = time.monotonic()
        try:
            result = await run_attempt(self.rt, self._http, job, self._aborted.__contains__)
        except Exception:
            # The row stays where the failure left it; reconciliation requeues it once it looks abandoned.
            log_event(log, "sync_attempt_failed", level=logging.ERROR, exc_info=True, batch_id=job.batch_id,
                      request_id=job.request_id)
            return
        if result.recorded is None:
            return  # final already, or its batch is closing: nothing was sent
        outcome = result.recorded.outcome
        kind = outcome.kind
        if kind is AttemptOutcome.success:
            self.aimd.on_success()
        elif outcome.shed or kind is AttemptOutcome.server_error:
            if self.aimd.on_overload(sent_at):
                log_event(log, "sync_concurrency_halved", batch_id=job.batch_id, request_id=job.request_id,
                          limit=self.aimd.limit, status=outcome.status)
        if self.metrics is not None:
            self.metrics.sync_requests.labels(kind.value).inc()
            self.metrics.sync_concurrency_limit.set(self.aimd.limit)
        if result.recorded.batch_done and self.queue is not None:
            try:  # its last row: this processor (and any other) finalizes it now, not at its next poll
                self.queue.queue.publish_wake(job.batch_id)
            except RedisError as exc:
                log_event(log, "wake_not_published", level=logging.WARNING, batch_id=job.batch_id, error=str(exc))
