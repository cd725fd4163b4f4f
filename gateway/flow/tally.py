"""What flow control counts: each event counted once, into its Prometheus metric and the totals /admin/state shows.

Dispatches (by band and path, with the queue wait, llm-d's queue duration and a blocked arrival's wait for a
released slot), rejections by drop reason, the tokens KV admission refused, evictions by outcome, KV releases
(the release histogram and the recent releases an outside observer times a cancel against), evicted requests'
retries that kept their place or their replica, and the dispatch rate behind the estimated wait.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Callable

from gateway.log import log_event
from gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.flow.request import DropReason, FlowRequest

logger = logging.getLogger("gateway.flow")

# Recent KV releases kept for /admin/state (an outside observer times a cancel against `at`).
RECENT_RELEASES = 32
# The dispatch rate is an exponentially weighted count per second with this time constant.
RATE_SECONDS = 5.0


class FlowTally:
    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float], pool: str = "default"):
        self.metrics = metrics
        self.pool = pool  # the model pool: every metric's `pool` label
        self.dispatched = 0
        self.rejections: Counter[str] = Counter()
        self.rejected_tokens: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.tokenizer_fallbacks = 0
        # Evicted requests' retries that kept their place in line, and that went back to their replica.
        self.places_kept = 0
        self.affinity_kept = 0
        # Requests dispatched ahead of their flow's head because their prefix was cached (cached_first.py).
        self.cached_first = 0
        self.recent_releases: deque[dict] = deque(maxlen=RECENT_RELEASES)
        # When a request slot was last handed back (a finish, or an eviction decision that hands it on): what a
        # blocked arrival waited for (the blocked_release histogram).
        self.slot_released_at: float | None = None
        # Dispatches per second (exponentially weighted), for the estimated wait by priority.
        self._rate = 0.0
        self._rate_at = clock()

    def dispatch(self, req: FlowRequest, priority: int, replica: str, path: str, now: float) -> None:
        elapsed = max(now - self._rate_at, 1e-3)
        self._rate = self._rate * math.exp(-elapsed / RATE_SECONDS) + 1.0 / RATE_SECONDS
        self._rate_at = now
        self.dispatched += 1
        band = str(priority)
        m = self.metrics
        m.child(m.dispatches, self.pool, band, path).inc()
        m.child(m.flow_queue_duration, self.pool, req.fairness_id, band, "dispatched").observe(now - req.arrived)
        if req.blocked_on_arrival:
            released = self.slot_released_at
            if released is None or released < req.arrived:
                released = now  # no slot came back since it arrived: a ceiling or the pool changed
            m.child(m.blocked_release, self.pool, band).observe(released - req.arrived)
        if req.waiter is not None:
            m.child(m.queue_wait, self.pool, band).observe(now - req.arrived)
        if logger.isEnabledFor(logging.DEBUG):
            log_event(logger, "dispatch", level=logging.DEBUG, request_id=req.request_id, band=priority,
                      replica=replica, path=path, queue_ms=round((now - req.arrived) * 1000, 2))

    def estimated_wait(self, ahead: int, now: float) -> float:
        """Seconds until `ahead` queued requests are dispatched at the recent dispatch rate."""
        rate = self._rate * math.exp(-(now - self._rate_at) / RATE_SECONDS)
        return round(ahead / rate, 3) if ahead and rate > 1e-6 else 0.0

    def rejection(self, req: FlowRequest, reason: DropReason, priority: int, now: float) -> None:
        self.rejections[reason.value] += 1
        m = self.metrics
        m.child(m.rejections, self.pool, reason.value, str(priority)).inc()
        m.child(m.flow_queue_duration, self.pool, req.fairness_id, str(priority), reason.value).observe(
            max(0.0, now - req.arrived))

    def kv_rejection(self, reason: DropReason, tokens: int) -> None:
        """Prompt + every sequence's output limit that KV admission refused."""
        self.rejected_tokens[reason.value] += tokens
        self.metrics.child(self.metrics.kv_rejected_tokens, self.pool, reason.value).inc(tokens)

    def eviction(self, outcome: str) -> None:
        """issued, confirmed, timed_out, mid_stream."""
        self.evictions[outcome] += 1
        self.metrics.child(self.metrics.evictions, self.pool, outcome).inc()

    def eviction_confirmed(self, latency: float) -> None:
        """An evicted request's upstream closed `latency` seconds after the decision."""
        self.eviction("confirmed")
        self.metrics.child(self.metrics.eviction_confirmation, self.pool).observe(latency)

    def release(self, req: FlowRequest, cause: str, start: float, now: float, closed: float | None = None) -> None:
        """A KV reservation was released `now` for `cause` seen at `start`; `closed`: an evicted request's
        upstream closed then."""
        self.metrics.child(self.metrics.kv_release, self.pool, cause).observe(max(0.0, now - start))
        release = {"request_id": req.request_id, "fairness_id": req.fairness_id, "cause": cause,
                   "at": time.time(), "seconds_after_cause": round(max(0.0, now - start), 6)}
        if closed is not None:
            release["upstream_closed_after_cause"] = round(max(0.0, closed - start), 6)
        self.recent_releases.append(release)
