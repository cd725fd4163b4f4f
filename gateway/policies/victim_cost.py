"""The `cost-ranked` victim policy: evict first what costs least to lose and frees the most.

A candidate's cost is the work its eviction throws away (prefill to redo; decode to redo when the caller
cannot resume it), raised by how urgent it is (time already waited, deadline slack), by having started to
stream, by each time it was evicted before, and lowered by its tenant's excess over the soft quota, then divided by what evicting it gains
(blocks it alone holds, for the output it still has to produce). Lower priority bands always go first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from gateway.policies.victims import VictimCandidate

# A decoded token costs a whole engine step shared by the running batch; a prefilled token is one of
# thousands in a step. Weighing a lost decode token as this many prefill tokens keeps restart (which
# decodes the output again) far more expensive than resume (which prefills it), as it is on a GPU.
DECODE_TOKEN_WEIGHT = 16.0
# Eviction gains by freeing blocks for the time the request would still run: a request with this many
# output tokens to go counts double one that is about to finish.
REMAINING_SCALE_TOKENS = 256.0
# Every this many seconds already waited make evicting the request once more as costly again.
WAIT_SCALE_SECONDS = 30.0
# A deadline this far away adds nothing; closer ones grow the cost as 1/slack (capped at the floor).
SLACK_SCALE_SECONDS = 60.0
SLACK_FLOOR_SECONDS = 1.0
# Cut-off output the caller already saw: evict only when nothing quiet is left.
STREAMING_FACTOR = 4.0
# A tenant 100% over its soft quota is this many times cheaper to evict than one within it.
QUOTA_WEIGHT = 4.0


@dataclass(frozen=True)
class VictimCost:
    """Why a candidate ranks where it does (for logs and tests)."""

    lost_work: float  # prefill-token equivalents thrown away
    urgency: float
    quota_relief: float
    gain: float  # blocks freed, scaled by remaining output
    cost: float


class CostRankedPolicy:
    """Rank by (priority, cost), cheapest first.

    Interactive requests (priority >= 0) are candidates only when the caller says the hard watermark is
    crossed (`order(..., hard_watermark_crossed=True)`); otherwise they are filtered out, so a ledger that
    calls `order(candidates, now)` as the Protocol says can only ever evict sheddable work.
    """

    name = "cost-ranked"

    def __init__(self, block_tokens: int = 16):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.block_tokens = block_tokens

    def order(self, candidates: Sequence[VictimCandidate], now: float, *,
              hard_watermark_crossed: bool = False) -> list[VictimCandidate]:
        eligible = [c for c in candidates if c.priority < 0 or hard_watermark_crossed]
        # Ties (equal cost) go newest first: the least work in flight is lost.
        return sorted(eligible, key=lambda c: (c.priority, self.cost(c, now).cost, -c.started_at, c.request_id))

    def cost(self, c: VictimCandidate, now: float) -> VictimCost:
        cached = min(max(c.cached_prefix_tokens, 0), c.prompt_tokens)
        if c.resumable:
            # Resumed as prompt + text so far: all of it is prefilled again, none decoded again.
            lost = max(0, c.prompt_tokens + c.output_tokens - cached)
        else:
            lost = max(0, c.prompt_tokens - cached) + DECODE_TOKEN_WEIGHT * c.output_tokens
        lost += 1.0  # a fresh request still costs its scheduling; keeps every cost positive

        waited = max(0.0, c.started_at - c.enqueued_at)
        urgency = 1.0 + waited / WAIT_SCALE_SECONDS
        if c.deadline is not None:
            slack = max(c.deadline - now, SLACK_FLOOR_SECONDS)
            urgency *= 1.0 + SLACK_SCALE_SECONDS / slack
        if c.streaming_started:
            urgency *= STREAMING_FACTOR
        # Each earlier eviction of this request makes one more as costly again: no request pays for all the others.
        urgency *= 1.0 + c.evictions

        quota_relief = 1.0 + QUOTA_WEIGHT * max(0.0, c.tenant_over_soft_quota)

        # A cached prefix is shared (its blocks stay while any other sequence holds them), so evicting
        # this request frees only the blocks past it: the view carries no reference count, and a hit
        # is the evidence of sharing it does carry.
        shared_blocks = cached // self.block_tokens
        freed = max(1, c.reserved_blocks - shared_blocks)
        remaining = max(0, c.max_new_tokens - c.output_tokens)
        gain = freed * (1.0 + remaining / REMAINING_SCALE_TOKENS)

        cost = lost * urgency / quota_relief / gain
        return VictimCost(lost, urgency, quota_relief, gain, cost if math.isfinite(cost) else math.inf)
