"""Endpoint picking after dispatch: filter replicas that are down, over their limit or without KV room, then let
the configured scorer (`picker.policy`) rank each replica's `ReplicaLoad`; lowest score wins, ties rotate.

`least-loaded`: inFlightWeight × in-flight ÷ capacity + kvUsageWeight × KV occupancy.
`kv-headroom`: KV occupancy first (the most free blocks wins), in-flight ÷ capacity to break ties.
KV occupancy is the larger of the scraped usage and the ledger's reservations there (scraped usage alone
when admission is off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

from gateway.flow.views import ReplicaView
from gateway.policies.saturation import SaturationDetector
from gateway.settings.names import implemented

# The picker returns one of the replicas it was given, as the caller's own type.
R = TypeVar("R", bound=ReplicaView)


class Pinned(str):
    """A `prefer` that binds: the request runs on this replica or waits (a stored response's next turn, which only
    the replica that stores the response can answer)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """What a scorer may know about one replica: its load."""

    url: str
    in_flight: int
    max_concurrency: int
    kv_occupancy: float


class ReplicaScorer(Protocol):
    name: str

    def score(self, view: ReplicaLoad) -> float: ...


@dataclass(frozen=True)
class LeastLoaded:
    in_flight_weight: float = 1.0
    kv_usage_weight: float = 1.0
    name: str = "least-loaded"

    def score(self, view: ReplicaLoad) -> float:
        return (self.in_flight_weight * view.in_flight / view.max_concurrency
                + self.kv_usage_weight * view.kv_occupancy)


@dataclass(frozen=True)
class KvHeadroom:
    name: str = "kv-headroom"

    def score(self, view: ReplicaLoad) -> float:
        return view.kv_occupancy + 1e-3 * view.in_flight / view.max_concurrency


SCORERS: dict[str, Callable[[float, float], ReplicaScorer]] = implemented("picker", {
    "least-loaded": lambda in_flight_weight, kv_usage_weight: LeastLoaded(in_flight_weight, kv_usage_weight),
    "kv-headroom": lambda in_flight_weight, kv_usage_weight: KvHeadroom(),
    "prefix-affinity": lambda in_flight_weight, kv_usage_weight: _prefix_affinity(in_flight_weight, kv_usage_weight),
})


def _prefix_affinity(in_flight_weight: float, kv_usage_weight: float) -> ReplicaScorer:
    from gateway.policies.prefix_affinity import PrefixAffinity  # it builds on LeastLoaded, defined here

    return PrefixAffinity(in_flight_weight, kv_usage_weight)


class EndpointPicker:
    def __init__(self, *, max_concurrency: int, in_flight_weight: float = 1.0, kv_usage_weight: float = 1.0,
                 policy: str = "least-loaded", occupancy: Callable[[ReplicaView], float] | None = None):
        self.max_concurrency = max_concurrency
        self.scorer = SCORERS[policy](in_flight_weight, kv_usage_weight)
        self.occupancy = occupancy or (lambda r: r.kv_usage or 0.0)
        self._turn = 0

    def load(self, replica: ReplicaView) -> ReplicaLoad:
        return ReplicaLoad(replica.url, replica.in_flight, replica.capacity or self.max_concurrency,
                           self.occupancy(replica))

    def pick(self, replicas: Sequence[R], detector: SaturationDetector, now: float,
             fits: Callable[[R], bool] | None = None, prefer: str | None = None,
             prefix: Sequence[int] = ()) -> R | None:
        """The best replica with room; `prefer` (a replica url) wins whenever it has room and fits: the retry of
        an evicted request goes back to where its prefix is cached, as a prefix-aware scorer would send it.
        A `Pinned` one is the only choice, taken past its slot limit (the replica queues it, as vLLM does) so that
        a turn never waits behind its band for one replica's room: None only while it is down or out of KV.
        `prefix`: the prompt's block hashes (gateway/bodies.py `prefix_blocks`), for a scorer that places by them
        (gateway/policies/prefix_affinity.py); the others ignore it."""
        n = len(replicas)
        if n == 0:
            return None
        if isinstance(prefer, Pinned):
            return next((r for r in replicas if r.url == prefer and r.healthy and (fits is None or fits(r))), None)
        if prefer is not None:
            for r in replicas:
                if r.url == prefer and r.healthy and detector.has_room(r, now) and (fits is None or fits(r)):
                    return r
        self._turn = (self._turn + 1) % n
        choose = getattr(self.scorer, "choose", None)
        if prefix and choose is not None:
            candidates = [r for r in (replicas[(self._turn + i) % n] for i in range(n))
                          if r.healthy and detector.has_room(r, now) and (fits is None or fits(r))]
            return choose(candidates, self.load, prefix) if candidates else None
        best, best_score = None, 0.0
        for i in range(n):
            r = replicas[(self._turn + i) % n]
            if not r.healthy or not detector.has_room(r, now):
                continue
            if fits is not None and not fits(r):
                continue
            s = self.scorer.score(self.load(r))
            if best is None or s < best_score:
                best, best_score = r, s
        return best
