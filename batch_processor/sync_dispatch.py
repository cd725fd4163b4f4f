"""Sync dispatch: the processor sends requests to the gateway itself (`--dispatch sync`).

Requests run on an asyncio loop in a background thread, at most `limit` at a time, where `limit`
adapts by AIMD between 1 and `--sync-concurrency`: +1 on every success, halved on a 429 or 5xx
(once per round trip: only an answer to a request sent after the last decrease halves it again).
Request building, outcome classes, backoff and recording are `holdback.dispatch`'s, exactly as the
async workers use them; a row that must retry goes to `retry_wait` and the processor hands it back
when its time has come, so no slot is held while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy.orm import Session, sessionmaker

from holdback.logs import log_event
from batch_processor.metrics import ProcessorMetrics
from holdback import dispatch, tracing
from holdback.db import transaction
from holdback.models import AttemptOutcome

log = logging.getLogger("batch_processor.sync")


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


class SyncDispatcher:
    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        gateway_url: str,
        gateway_key: str | None,
        worker_name: str,
        max_concurrency: int,
        policy: dispatch.RetryPolicy = dispatch.RetryPolicy(),
        request_timeout: float = 600.0,
        metrics: ProcessorMetrics | None = None,
        db_threads: int = 8,
    ):
        self.factory = factory
        self.gateway_url = gateway_url.rstrip("/")
        self.gateway_key = gateway_key
        self.worker_name = worker_name
        self.policy = policy
        self.request_timeout = request_timeout
        self.metrics = metrics
        self.aimd = Aimd(max_concurrency)
        self.trace_contexts = tracing.BatchContexts()
        self._db = ThreadPoolExecutor(max_workers=db_threads, thread_name_prefix="sync-db")
        self._lock = threading.Lock()
        self._held: set[str] = set()  # row ids waiting here or running: what reconciliation must leave alone
        self._loop = asyncio.new_event_loop()
        self._waiting: deque[tuple[str, str]] = deque()
        self._running: dict[asyncio.Task, tuple[str, str]] = {}
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-dispatch", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._make_client())
        self._main = asyncio.run_coroutine_threadsafe(self._dispatch_loop(), self._loop)

    async def _make_client(self) -> httpx.AsyncClient:
        self._wake = asyncio.Event()
        limits = httpx.Limits(max_connections=self.aimd.maximum, max_keepalive_connections=self.aimd.maximum)
        return httpx.AsyncClient(timeout=self.request_timeout, limits=limits)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- called from the processor thread -------------------------------------------------------

    def push(self, jobs: list[tuple[str, str]]) -> int:
        with self._lock:
            self._held.update(row_id for row_id, _ in jobs)
        self._loop.call_soon_threadsafe(self._accept, list(jobs))
        return len(jobs)

    def live_ids(self) -> set[str]:
        with self._lock:
            return set(self._held)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._held)

    def abort_batch(self, batch_id: str) -> None:
        """Drop the batch's waiting rows and abort its running requests (their connections close)."""
        self._loop.call_soon_threadsafe(self._abort, batch_id)

    def close(self, drain_timeout: float = 10.0) -> list[str]:
        """Stop: let running requests finish for up to `drain_timeout`, abort the rest; returns the ids
        that never started (still `queued` in the database) so the caller can hand them back."""
        unstarted = self._call(self._stop_accepting())
        try:
            self._main.result(timeout=drain_timeout)
        except TimeoutError:
            self._call(self._abort_all())
            self._main.result(timeout=30)
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._db.shutdown(wait=True)
        return unstarted

    # --- on the loop thread -----------------------------------------------------------------------

    def _accept(self, jobs: list[tuple[str, str]]) -> None:
        self._waiting.extend(jobs)
        self._wake.set()

    def _abort(self, batch_id: str) -> None:
        kept = deque(job for job in self._waiting if job[1] != batch_id)
        dropped = [row_id for row_id, b in self._waiting if b == batch_id]
        self._waiting = kept
        with self._lock:
            self._held.difference_update(dropped)
        for task, (_row_id, b) in list(self._running.items()):
            if b == batch_id:
                task.cancel()

    async def _abort_all(self) -> None:
        for task in list(self._running):
            task.cancel()

    async def _stop_accepting(self) -> list[str]:
        self._closing = True
        unstarted = [row_id for row_id, _ in self._waiting]
        self._waiting.clear()
        with self._lock:
            self._held.difference_update(unstarted)
        self._wake.set()
        return unstarted

    async def _dispatch_loop(self) -> None:
        while True:
            while self._waiting and len(self._running) < self.aimd.limit and not self._closing:
                row_id, batch_id = self._waiting.popleft()
                task = asyncio.create_task(self._run_one(row_id, batch_id))
                self._running[task] = (row_id, batch_id)
                task.add_done_callback(self._finished)
            if self._closing and not self._running:
                return
            self._wake.clear()
            await self._wake.wait()

    def _finished(self, task: asyncio.Task) -> None:
        row_id, _ = self._running.pop(task)
        with self._lock:
            self._held.discard(row_id)
        self._wake.set()

    async def _run_one(self, row_id: str, batch_id: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            begun = await loop.run_in_executor(self._db, self._begin, row_id)
        except Exception:
            log.exception("sync_begin_failed", extra={"fields": {"batch_id": batch_id, "request_id": row_id}})
            return
        if not isinstance(begun, dispatch.Dispatch):
            return  # final already, or its batch is closing: nothing to send
        sent_at = time.monotonic()
        try:
            reply = await self._send(begun)
        except asyncio.CancelledError:
            reply = dispatch.Reply.cancelled()
        try:
            recorded = await loop.run_in_executor(self._db, self._record, begun, reply)
        except Exception:
            # The row stays `running`; reconciliation requeues it once it looks abandoned.
            log.exception("sync_record_failed", extra={"fields": {"batch_id": batch_id, "request_id": row_id}})
            return
        kind = recorded.outcome.kind
        if kind is AttemptOutcome.success:
            self.aimd.on_success()
        elif recorded.outcome.shed or kind is AttemptOutcome.server_error:
            if self.aimd.on_overload(sent_at):
                log_event(log, "sync_concurrency_halved", batch_id=batch_id, request_id=row_id,
                          limit=self.aimd.limit, status=recorded.outcome.status)
        if self.metrics is not None:
            self.metrics.sync_requests.labels(kind.value).inc()
            self.metrics.sync_concurrency_limit.set(self.aimd.limit)

    async def _send(self, begun: dispatch.Dispatch) -> dispatch.Reply:
        if tracing.enabled():  # an `attempt` span under the batch's trace, as the worker's
            return await tracing.traced_attempt(self._post(begun), begun, self.trace_contexts, self._trace_context)
        return await self._post(begun)

    async def _trace_context(self, batch_id: str) -> str | None:
        def load() -> str | None:
            with self.factory() as session:
                return self.trace_contexts.load(session, batch_id)

        return await asyncio.get_running_loop().run_in_executor(self._db, load)

    async def _post(self, begun: dispatch.Dispatch) -> dispatch.Reply:
        try:
            response = await self._client.post(self.gateway_url + begun.url, content=begun.body.encode(),
                                               headers=tracing.inject(begun.headers(self.gateway_key)))
        except httpx.HTTPError as exc:
            # A connect failure never reached the gateway: a failing path, not budgeted.
            return dispatch.Reply.transport_error(f"{type(exc).__name__}: {exc}",
                                                  unreachable=isinstance(exc, httpx.ConnectError))
        return dispatch.Reply(status=response.status_code, headers=dict(response.headers), body=response.content)

    def _begin(self, row_id: str) -> dispatch.Dispatch | dispatch.Skip:
        with transaction(self.factory) as session:
            return dispatch.begin(session, row_id, self.worker_name)

    def _record(self, begun: dispatch.Dispatch, reply: dispatch.Reply) -> dispatch.Recorded:
        with transaction(self.factory) as session:
            return dispatch.record_outcome(session, begun, reply, self.policy)
