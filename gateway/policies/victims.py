"""Victim-ordering policies for in-flight eviction, chosen by name (`eviction.policy`) from a registry.

A policy sees read-only `VictimCandidate` views of running requests and returns them in eviction order; it
cannot touch queues or requests. `none` is the no-op evictor (it orders nothing, so nothing is evicted);
`newest-first` is lowest priority first, then the fewest earlier evictions, then the most recently dispatched (least
work lost).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from gateway.settings.names import implemented


@dataclass(frozen=True)
class VictimCandidate:
    """What a policy may know about one running request; times are monotonic seconds."""

    request_id: str
    fairness_id: str
    priority: int
    objective: str
    replica: str
    started_at: float
    enqueued_at: float
    deadline: float | None
    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int
    streaming_started: bool
    resumable: bool
    cached_prefix_tokens: int
    tenant_over_soft_quota: float
    reserved_blocks: int
    # Dispatch order, to break ties and to map the view back to its request.
    seq: int = 0
    # How often this request was evicted before this attempt.
    evictions: int = 0


class VictimPolicy(Protocol):
    name: str

    def order(self, candidates: Sequence[VictimCandidate], now: float) -> list[VictimCandidate]: ...


class NoEviction:
    """The no-op evictor: no request is ever a victim."""

    name = "none"

    def order(self, candidates: Sequence[VictimCandidate], now: float) -> list[VictimCandidate]:
        return []


class NewestFirst:
    """Lowest priority first, then the fewest earlier evictions, then the most recently dispatched: the least work
    is thrown away, and not always by the same request. A resumed attempt is the newest thing running; ordered by
    dispatch alone it would be the next victim again and again while requests dispatched before it never are."""

    name = "newest-first"

    def order(self, candidates: Sequence[VictimCandidate], now: float) -> list[VictimCandidate]:
        return sorted(candidates, key=lambda c: (c.priority, c.evictions, -c.started_at, -c.seq))


def _lazy(module: str, attr: str) -> Callable[[], VictimPolicy]:
    """A factory that imports its module on first use, so policy modules may import this one."""
    return lambda: getattr(importlib.import_module(module), attr)()


POLICIES: dict[str, Callable[[], VictimPolicy]] = implemented("eviction", {
    "none": NoEviction,
    "newest-first": NewestFirst,
    "cost-ranked": _lazy("gateway.policies.victim_cost", "CostRankedPolicy"),
})


def victim_policy(name: str) -> VictimPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
