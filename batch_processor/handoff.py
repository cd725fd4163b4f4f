"""The hand-off: where the processor puts the rows it moved to `queued`, and what it asks of whoever holds them.

Two implementations, chosen by `--dispatch`: `QueueHandoff` (`async`: one RQ job per row for the async workers)
and `SyncHandoff` (`sync`, in `batch_processor.sync_handoff`: this process sends the rows through the gateway
itself). The processor calls only this protocol.
"""

from __future__ import annotations

import time
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from batch_processor.jobqueue import RequestQueue
from batch_processor.metrics import ProcessorMetrics
from holdback.attempts import RetryPolicy

CAPACITY_REFRESH = 5.0  # seconds between reads of the workers' registrations


class Handoff(Protocol):
    # True: the holder wakes a row whose retry is due by itself (RQ's scheduled registry, moved by the workers);
    # False: the processor takes due retries back and pushes them again.
    schedules_retries: bool

    def push(self, rows: list[tuple[str, str]], at_front: bool = False) -> int:
        """Hand over (request id, batch id) pairs, in order (`at_front`: ahead of everything waiting)."""

    def live_ids(self) -> set[str]:
        """Request ids some holder has: what reconciliation must leave alone."""

    def stop(self, batch_id: str, request_ids: list[str]) -> int:
        """Drop these rows' waiting work and abort the batch's requests in flight; returns how many workers
        heard the cancel."""

    def capacity(self) -> int:
        """Requests the holder can run at once (0 while nobody can)."""

    def close(self, drain_timeout: float = 10.0) -> list[str]:
        """Stop; returns the ids that never started (still `queued`) so the caller can hand them back."""


class QueueHandoff:
    """RQ jobs for the async workers (`async_processor`), and the batch cancel channel."""

    schedules_retries = True

    def __init__(self, queue: RequestQueue):
        self.queue = queue
        self._capacity: tuple[float, int] = (float("-inf"), 0)  # (read at, workers' total concurrency)

    def push(self, rows: list[tuple[str, str]], at_front: bool = False) -> int:
        return self.queue.push(rows, at_front=at_front)

    def live_ids(self) -> set[str]:
        return self.queue.live_ids()

    def stop(self, batch_id: str, request_ids: list[str]) -> int:
        self.queue.remove(request_ids)
        return self.queue.publish_cancel(batch_id)

    def capacity(self) -> int:
        """The live workers' concurrency, read every CAPACITY_REFRESH seconds; 0 while no worker is registered."""
        read_at, capacity = self._capacity
        if time.monotonic() - read_at >= CAPACITY_REFRESH:
            capacity = self.queue.worker_capacity()
            self._capacity = (time.monotonic(), capacity)
        return capacity

    def close(self, drain_timeout: float = 10.0) -> list[str]:
        return []  # the jobs stay in Redis for the workers


def open_handoff(mode: str, queue: RequestQueue, factory: sessionmaker[Session], *, gateway_url: str,
                 gateway_key: str | None, worker_name: str, max_concurrency: int, policy: RetryPolicy,
                 request_timeout: float, metrics: ProcessorMetrics) -> Handoff:
    """The hand-off of `--dispatch <mode>`. The sync mode keeps the RQ side beside its own: jobs a lease holder
    in async mode pushed for the same batches are still stopped and still count as live."""
    rq = QueueHandoff(queue)
    if mode == "async":
        return rq
    from batch_processor.sync_handoff import SyncHandoff  # sends through aiohttp: loaded only in sync mode

    return SyncHandoff(factory, gateway_url=gateway_url, gateway_key=gateway_key, worker_name=worker_name,
                       max_concurrency=max_concurrency, policy=policy, request_timeout=request_timeout,
                       metrics=metrics, queue=rq)
