"""Victim-ordering policies for in-flight eviction, chosen by name (`eviction.policy`) from a registry.

A policy sees read-only `VictimCandidate` views of running requests and returns them in eviction order; it
cannot touch queues or requests. `none` is the no-op evictor (it orders nothing, so nothing is evicted);
`newest-first` is lowest priority first, then the fewest earlier evictions, then the most recently dispatched (least
work lost); `least-refill` (the default) puts the least the replica must compute again before the newest.
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
    # What evicting it makes its replica compute again (0: not known, admission off). Resumable: the tokens past
    # its last whole KV block, which vLLM's prefix cache cannot keep (the resume's prompt is its prompt and output
    # so far; every whole block of it is a cache hit). Not resumable: its prompt and output, all of it.
    refill_tokens: int = 0
    # When its output last reached a new KV block (its reservation's last revision): where the relay is another
    # process and reports only there, the most recent has the fewest tokens past a whole block.
    block_reached_at: float = 0.0


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


class LeastRefill:
    """Lowest priority first, then the fewest earlier evictions, then the least to compute again, then the most
    recently dispatched. A resumed request keeps every whole KV block in vLLM's prefix cache, so what an eviction
    costs the engine is the prefill of the tokens past its last whole block (0 to 127 of vLLM's 128-token CPU
    blocks, 0 to 63 of 0.34's GPU blocks) on top of the request's own start; among eight running requests one is
    usually a few tokens past a block. A request that cannot resume is evicted only after every one that can."""

    name = "least-refill"

    def order(self, candidates: Sequence[VictimCandidate], now: float) -> list[VictimCandidate]:
        return sorted(candidates, key=lambda c: (c.priority, c.evictions, c.refill_tokens, -c.block_reached_at,
                                                 -c.started_at, -c.seq))


def _lazy(module: str, attr: str) -> Callable[[], VictimPolicy]:
    """A factory that imports its module on first use, so policy modules may import this one."""
    return lambda: getattr(importlib.import_module(module), attr)()


POLICIES: dict[str, Callable[[], VictimPolicy]] = implemented("eviction", {
    "none": NoEviction,
    "newest-first": NewestFirst,
    "least-refill": LeastRefill,
    "cost-ranked": _lazy("gateway.policies.victim_cost", "CostRankedPolicy"),
})


def victim_policy(name: str) -> VictimPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
