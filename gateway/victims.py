"""The victim-policy interface: a read-only view of one in-flight request and the ordering Protocol.

Minimal copy of the shared interface agreed with the KV-admission work, which owns this module (its
registry and the `none` / `newest-first` policies live there); `gateway.victim_cost` implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class VictimCandidate:
    request_id: str
    fairness_id: str
    priority: int
    objective: str
    replica: str | None
    started_at: float  # monotonic: dispatched to the replica
    enqueued_at: float  # monotonic: arrived at the gateway
    deadline: float | None  # monotonic, None when the request has none
    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int  # produced so far
    streaming_started: bool  # the first body byte went to the caller
    resumable: bool  # the caller can resume it from its partial output (x-holdback-resumable: 1)
    cached_prefix_tokens: int  # prompt tokens found in the prefix cache, 0 if unknown
    tenant_over_soft_quota: float  # excess over the tenant's soft quota as a ratio, 0 if none
    reserved_blocks: int


class VictimPolicy(Protocol):
    name: str

    def order(self, candidates: Sequence[VictimCandidate], now: float) -> list[VictimCandidate]:
        """The candidates that may be evicted, first victim first."""
        ...
