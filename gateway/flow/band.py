"""Priority bands and their per-flow queues.

A band holds every queued request of one priority, one queue per fairness id (a flow). The band's fairness
policy picks a flow, the ordering policy orders each flow's queue; both read the band, its queues and their
requests through the views of gateway/flow/views.py, which `PriorityBand` and `FlowQueue` satisfy as they are.
Removal is lazy: a withdrawn or expired request stays in its heap until it reaches the top, but the counts
change at once.
"""

from __future__ import annotations

import heapq

from gateway.flow.request import FlowRequest, Status
from gateway.policies.fairness import FairnessPolicy, fairness_policy
from gateway.policies.ordering import OrderingPolicy, ordering_policy


class FlowQueue:
    """The queued requests of one fairness id within one band, ordered by the band's ordering policy."""

    __slots__ = ("fairness_id", "_heap", "count")

    def __init__(self, fairness_id: str):
        self.fairness_id = fairness_id
        self._heap: list[tuple[tuple, FlowRequest]] = []
        self.count = 0

    def push(self, key: tuple, req: FlowRequest) -> None:
        heapq.heappush(self._heap, (key, req))
        self.count += 1

    def head(self) -> tuple[tuple, FlowRequest] | None:
        heap = self._heap
        while heap and heap[0][1].status is not Status.QUEUED:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def first(self, k: int) -> list[FlowRequest]:
        """Up to `k` queued requests in order, head first, without taking any (a best-first walk of the heap;
        requests already gone are stepped over, at most `k` of them)."""
        heap, out = self._heap, []
        frontier = [(heap[0][0], 0)] if heap else []
        steps = 0
        while frontier and len(out) < k and steps < 2 * k:
            _key, i = heapq.heappop(frontier)
            steps += 1
            if heap[i][1].status is Status.QUEUED:
                out.append(heap[i][1])
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return out

    def pop_head(self) -> FlowRequest:
        head = self.head()
        if head is None:
            raise LookupError(f"flow {self.fairness_id!r} is empty")
        heapq.heappop(self._heap)
        self.count -= 1
        return head[1]


class PriorityBand:
    """All queued requests of one priority, with the band's limits and policies."""

    def __init__(self, priority: int, *, max_requests: int, ttl: float, fairness: str = "global-strict",
                 ordering: str = "fcfs", ceiling_override: float | None = None):
        self.priority = priority
        self.max_requests = max_requests
        self.ttl = ttl
        self.ceiling_override = ceiling_override
        self.fairness: FairnessPolicy = fairness_policy(fairness)
        self.ordering: OrderingPolicy = ordering_policy(ordering)
        self.flows: dict[str, FlowQueue] = {}
        self.queued = 0
        self.in_flight = 0
        self.dispatched = 0  # requests this band has sent to a replica since the gateway started

    def configure(self, *, max_requests: int, ttl: float, fairness: str, ordering: str,
                  ceiling_override: float | None) -> None:
        """Apply reloaded settings; queued requests keep their place unless the ordering policy changed."""
        self.max_requests = max_requests
        self.ttl = ttl
        self.ceiling_override = ceiling_override
        if fairness != self.fairness.name:
            self.fairness = fairness_policy(fairness)
        if ordering != self.ordering.name:
            self.ordering = ordering_policy(ordering)
            waiting = self.waiting()
            self.flows.clear()
            self.queued = 0
            for req in waiting:
                self.push(req)

    def waiting(self) -> list[FlowRequest]:
        """Every request still queued in this band, in no particular order."""
        return [req for flow in self.flows.values() for _k, req in flow._heap if req.status is Status.QUEUED]

    def push(self, req: FlowRequest) -> None:
        flow = self.flows.get(req.fairness_id)
        if flow is None:
            flow = self.flows[req.fairness_id] = FlowQueue(req.fairness_id)
        flow.push(self.ordering.key(req), req)
        self.queued += 1

    def peek(self) -> FlowRequest | None:
        """The request the band would dispatch next, chosen by fairness then ordering."""
        if not self.queued:
            return None
        picked = self.fairness.pick(self)  # reads the band through its view; names the flow
        if picked is None:
            return None
        head = self.flows[picked.fairness_id].head()
        return head[1] if head else None

    def pop(self, req: FlowRequest) -> None:
        """Take `req`, which must be what peek() returned, out of its queue."""
        flow = self.flows[req.fairness_id]
        taken = flow.pop_head()
        if taken is not req:
            raise RuntimeError("band.pop() must take the request peek() returned")
        self.queued -= 1
        self.fairness.dispatched(req.fairness_id)
        if flow.count == 0:
            del self.flows[req.fairness_id]

    def take(self, req: FlowRequest) -> None:
        """Take a queued request other than the head of its flow to dispatch it (cached-first dispatch,
        gateway/flow/cached_first.py): counted as its flow's turn; its heap entry goes once it is no longer
        QUEUED."""
        self.forget(req)
        self.fairness.dispatched(req.fairness_id)

    def forget(self, req: FlowRequest) -> None:
        """Account for a queued request that left without dispatch (its status is no longer QUEUED)."""
        flow = self.flows.get(req.fairness_id)
        if flow is None:
            return
        flow.count -= 1
        self.queued -= 1
        if flow.count == 0:
            del self.flows[req.fairness_id]

    def queue_sizes(self) -> dict[str, int]:
        return {fid: flow.count for fid, flow in self.flows.items()}
