"""The at-risk floor: a share of the pool's request capacity that batch work at risk of missing its window
(`x-holdback-at-risk: 1` from the workers' key) may hold under saturation.

Under sustained realtime saturation strict priority gives batch nothing: it waits behind every queued realtime
request, and what runs is evicted for the next one. Right for a minute, wrong for a day: a batch whose window
closes while realtime holds every slot expires. So while requests of at-risk batches wait, each dispatch cycle
first gives them room, ahead of every band, until they hold `flowControl.atRiskFloor` of the pool's capacity
(rounded up to a whole request; 0 turns the floor off): a slot that frees goes to them before queued realtime
takes it, and a request dispatched into the floor is no eviction victim. Among themselves they go earliest
deadline first (the batch's `x-holdback-deadline`), so the batch whose window closes first finishes first.
With no batch at risk the floor holds nothing and costs realtime nothing; with one, realtime runs in the rest.
An at-risk request dispatched while there is room for it anyway is an ordinary batch request (evictable): the
floor is only what it takes from higher bands.
"""

from __future__ import annotations

import heapq
import math

from gateway.flow.request import FlowRequest, Status


class AtRiskFloor:
    def __init__(self, share: float = 0.0):
        self.share = share
        self.waiting: list[tuple[float, int, int, FlowRequest]] = []  # (deadline, place, seq, request)
        self.in_flight = 0

    def queued(self, req: FlowRequest) -> None:
        """`req` waits in its band's queue; if it is at risk it also waits here (it leaves lazily)."""
        if req.at_risk and self.share > 0:
            heapq.heappush(self.waiting, (req.deadline, req.place, req.seq, req))

    def slots(self, capacity: float) -> int:
        """The requests the floor may hold in a pool of `capacity`."""
        return math.ceil(self.share * capacity - 1e-9) if self.share > 0 else 0

    def next(self, capacity: float) -> FlowRequest | None:
        """The at-risk request to place next (earliest deadline), while the floor has room; None otherwise."""
        waiting = self.waiting
        while waiting and waiting[0][3].status is not Status.QUEUED:
            heapq.heappop(waiting)  # dispatched by its band, withdrawn, expired or rejected meanwhile
        if not waiting or self.in_flight >= self.slots(capacity):
            return None
        return waiting[0][3]

    def dispatched(self, req: FlowRequest) -> None:
        """`req` (the one `next` returned) went into the floor: it is no eviction victim until it ends."""
        heapq.heappop(self.waiting)
        self.in_flight += 1

    def ended(self, req: FlowRequest) -> None:
        if req.lease is not None and req.lease.in_floor:
            req.lease.in_floor = False
            self.in_flight -= 1
