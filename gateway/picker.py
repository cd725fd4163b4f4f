"""Endpoint picking after dispatch: filter replicas that are down or over their limit, then score the rest.

Score = inFlightWeight × (in-flight ÷ maxConcurrency) + kvUsageWeight × scraped KV usage; lowest wins.
Ties rotate so equal replicas share the load.
"""

from __future__ import annotations

from typing import Callable, Sequence

from gateway.replicas import Replica
from gateway.saturation import SaturationDetector


class EndpointPicker:
    def __init__(self, *, max_concurrency: int, in_flight_weight: float = 1.0, kv_usage_weight: float = 1.0):
        self.max_concurrency = max_concurrency
        self.in_flight_weight = in_flight_weight
        self.kv_usage_weight = kv_usage_weight
        self._turn = 0

    def score(self, replica: Replica) -> float:
        return (self.in_flight_weight * replica.in_flight / self.max_concurrency
                + self.kv_usage_weight * (replica.kv_usage or 0.0))

    def pick(self, replicas: Sequence[Replica], detector: SaturationDetector, now: float,
             fits: Callable[[Replica], bool] | None = None) -> Replica | None:
        n = len(replicas)
        if n == 0:
            return None
        self._turn = (self._turn + 1) % n
        best, best_score = None, 0.0
        for i in range(n):
            r = replicas[(self._turn + i) % n]
            if not r.healthy or not detector.has_room(r, now):
                continue
            if fits is not None and not fits(r):
                continue
            s = self.score(r)
            if best is None or s < best_score:
                best, best_score = r, s
        return best
