"""Queue deadlines: when each queued request stops waiting (its band's TTL, its own TTL or deadline header, its wait
for KV room), in one heap the dispatch cycle pops at every tick.

Entries are lazy: a request that left the queue, or whose deadline moved earlier (a second entry), stays in the
heap until its time comes and is skipped then. A deadline only ever moves earlier.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterator

from gateway.flow.band import PriorityBand
from gateway.flow.request import FlowRequest, Status


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, FlowRequest]] = []

    def push(self, req: FlowRequest) -> None:
        """A request just queued, with a finite `expires_at`."""
        heapq.heappush(self._heap, (req.expires_at, req.seq, req))

    def due(self, now: float) -> Iterator[FlowRequest]:
        """The queued requests whose deadline has come, one at a time (the caller takes each out of its band)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _seq, req = heapq.heappop(heap)
            if req.status is Status.QUEUED and at == req.expires_at:
                yield req

    def apply_ttl(self, band: PriorityBand) -> None:
        """A reloaded (or rolled-back) band TTL holds for requests already queued too, counted from their arrival:
        after a bad config is rolled back, what queued under it past the restored deadlines is answered 429 at
        once instead of flooding the replicas ahead of new traffic. A TTL never lengthens a request's wait."""
        if band.ttl <= 0:
            return
        for req in band.waiting():
            expires = req.arrived + band.ttl
            if expires < req.expires_at:
                req.expires_at = expires
                heapq.heappush(self._heap, (expires, req.seq, req))

    def start_kv_wait(self, req: FlowRequest, deadline: float) -> None:
        """The first time `req` waits for KV room: it waits until `deadline` at most (admission.queueDeadlineMs)."""
        if req.kv_wait_deadline < math.inf:
            return
        req.kv_wait_deadline = deadline
        if deadline < req.expires_at:
            req.expires_at = deadline
            if req.status is Status.QUEUED:
                heapq.heappush(self._heap, (req.expires_at, req.seq, req))
