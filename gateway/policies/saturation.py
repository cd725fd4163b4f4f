"""Saturation detectors: how full the pool is (1.0 is the set point), and whether one replica can take more.

`concurrency` counts the gateway's own in-flight requests: Σ in-flight ÷ Σ capacity over the healthy replicas, a
replica's capacity being its engine's maxNumSeqs + queueAllowance when set, else maxConcurrency.
It moves the moment a request is dispatched or finishes, which is what eviction pacing needs.
`utilization` reads each replica's scraped `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
Stale-metrics policy: a replica whose last good scrape is older than `metricsStalenessSeconds` is scored by
its concurrency ratio instead (it never scores 1.0 just for being stale), so a metrics outage degrades to the
concurrency detector rather than halting all dispatch. An empty pool is saturated (1.0).
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from gateway.flow.views import ReplicaView
from gateway.settings.names import implemented


class SaturationDetector(Protocol):
    name: str
    # How long after an eviction is confirmed before the next decision may use this detector's reading.
    confirmation_grace: float
    # True: the reading is the gateway's own count, so an evicted request's slot may be handed on the moment
    # it is chosen (its connection closes within milliseconds); False: wait for the replica to show it.
    release_on_decision: bool

    def saturation(self, replicas: Iterable[ReplicaView], now: float) -> float: ...

    def has_room(self, replica: ReplicaView, now: float) -> bool: ...

    def replica_score(self, replica: ReplicaView, now: float) -> float: ...

    def stale_count(self, replicas: Iterable[ReplicaView], now: float) -> int: ...


class ConcurrencyDetector:
    """Pool saturation from the gateway's own in-flight counts."""

    name = "concurrency"
    confirmation_grace = 0.01
    release_on_decision = True

    def __init__(self, max_concurrency: int = 48, headroom: float = 0.0):
        self.max_concurrency = max_concurrency
        # Headroom only raises the per-replica filter limit; pool saturation ignores it.
        self.headroom = headroom

    def saturation(self, replicas: Iterable[ReplicaView], now: float) -> float:
        total, slots = 0, 0
        for r in replicas:
            total += r.in_flight
            slots += r.capacity or self.max_concurrency
        if slots == 0:
            return 1.0
        return total / slots

    def replica_score(self, replica: ReplicaView, now: float) -> float:
        return replica.in_flight / (replica.capacity or self.max_concurrency)

    def has_room(self, replica: ReplicaView, now: float) -> bool:
        return replica.in_flight < (replica.capacity or self.max_concurrency) * (1.0 + self.headroom)

    def stale_count(self, replicas: Iterable[ReplicaView], now: float) -> int:
        return 0


class UtilizationDetector:
    """Pool saturation from scraped queue depth and KV usage; stale replicas fall back to their concurrency."""

    name = "utilization"
    release_on_decision = False

    def __init__(self, *, max_concurrency: int = 48, headroom: float = 0.0, queue_depth_threshold: float = 5.0,
                 kv_util_threshold: float = 0.8, staleness: float = 2.0, scrape_interval: float = 0.25):
        self.max_concurrency = max_concurrency
        self.headroom = headroom
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_util_threshold = kv_util_threshold
        self.staleness = staleness
        self.limit = 1.0 + headroom
        # Evicted work shows in the scraped numbers only after the next scrape.
        self.confirmation_grace = scrape_interval + 0.05

    def replica_score(self, replica: ReplicaView, now: float) -> float:
        slots = replica.capacity or self.max_concurrency
        if not replica.metrics_fresh(now, self.staleness):
            return replica.in_flight / slots
        score = max((replica.waiting or 0.0) / self.queue_depth_threshold,
                    (replica.kv_usage or 0.0) / self.kv_util_threshold)
        # Requests sent since the scrape began are not in the scraped numbers yet; count each as one
        # concurrency slot so a burst between two scrapes cannot overshoot.
        return score + (replica.dispatches - replica.dispatches_at_scrape) / slots

    def saturation(self, replicas: Iterable[ReplicaView], now: float) -> float:
        scores = [self.replica_score(r, now) for r in replicas]
        if not scores:
            return 1.0
        return sum(scores) / len(scores)

    def has_room(self, replica: ReplicaView, now: float) -> bool:
        return self.replica_score(replica, now) < self.limit

    def stale_count(self, replicas: Iterable[ReplicaView], now: float) -> int:
        return sum(1 for r in replicas if not r.metrics_fresh(now, self.staleness))


DETECTORS: dict[str, Callable[..., SaturationDetector]] = implemented("saturation detector", {
    "concurrency": lambda *, max_concurrency, headroom, **_: ConcurrencyDetector(max_concurrency, headroom),
    "utilization": lambda **settings: UtilizationDetector(**settings),
})


def saturation_detector(name: str, *, max_concurrency: int, headroom: float, queue_depth_threshold: float,
                        kv_util_threshold: float, staleness: float, scrape_interval: float) -> SaturationDetector:
    try:
        build = DETECTORS[name]
    except KeyError:
        raise ValueError(f"unknown saturation detector {name!r}; choose {' or '.join(DETECTORS)}") from None
    return build(max_concurrency=max_concurrency, headroom=headroom, queue_depth_threshold=queue_depth_threshold,
                 kv_util_threshold=kv_util_threshold, staleness=staleness, scrape_interval=scrape_interval)
