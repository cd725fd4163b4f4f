"""KV admission: one of three outcomes for a request (run now, queue with a deadline, reject with the reason).

Read-only over the ledger and the replicas. A replica's occupancy is the larger of its scraped KV usage and
the blocks the ledger has reserved there; a request may go to a replica only if the occupancy after adding
its reservation stays under the step of the pressure ladder that applies to it:
  every request            ≤ hardWatermark (0.92)
  priority ≤ 0, long       ≤ admissionWatermark (0.82)   (long: prompt + max new ≥ longRequestTokens)
  batch class              ≤ batchPauseWatermark (0.88), and batch reservations ≤ (1 − interactiveReserve)
  tenant over its soft share: only while the replica stays under admissionWatermark
Above hardWatermark the flow controller evicts recoverable batch work. Quotas (hard tenant share, reserved
tokens, active sequences, context length, token-seconds) reject with the quota's name, limit and usage.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from gateway.config import Admission, Quota
from gateway.kv_ledger import KvLedger
from gateway.replicas import Replica
from gateway.request import DropReason


class Outcome(enum.Enum):
    RUN = "run"
    QUEUE = "queue"
    REJECT = "reject"


LEVELS = ("normal", "admission", "pause-batch", "evict")


@dataclass(frozen=True)
class Demand:
    """What a request asks of the KV pool."""

    prompt_tokens: int
    max_new_tokens: int
    priority: int
    traffic_class: str
    fairness_id: str

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: DropReason | None = None
    message: str = ""
    # RUN: the replicas the request fits on.
    replicas: tuple[Replica, ...] = ()


class KvAdmission:
    def __init__(self, cfg: Admission, ledger: KvLedger, profile_blocks: int | None = None):
        self.cfg = cfg
        self.ledger = ledger
        # A replica's own vllm:cache_config_info wins; then the calibration profile; then the config.
        self.default_pool_blocks = profile_blocks or cfg.default_pool_blocks()
        self.batch_cap = 1.0 - cfg.interactiveReserve
        self.queue_deadline = cfg.queueDeadlineMs / 1000.0

    # -- capacity ---------------------------------------------------------------------------------------------
    def pool_blocks(self, replica: Replica) -> int:
        return replica.kv_blocks_total or self.default_pool_blocks

    def occupancy(self, replica: Replica) -> float:
        """Blocks taken on the replica: the larger of what it reports and what we reserved there."""
        scraped = (replica.kv_usage or 0.0) * self.pool_blocks(replica)
        return max(scraped, float(self.ledger.reserved_on(replica.url)))

    def level(self, replica: Replica) -> str:
        share = self.occupancy(replica) / self.pool_blocks(replica)
        cfg = self.cfg
        if share >= cfg.hardWatermark:
            return "evict"
        if share >= cfg.batchPauseWatermark:
            return "pause-batch"
        if share >= cfg.admissionWatermark:
            return "admission"
        return "normal"

    def context_limit(self, replicas: Sequence[Replica]) -> int | None:
        if self.cfg.maxContextTokens:
            return self.cfg.maxContextTokens
        known = [r.max_model_len for r in replicas if r.max_model_len]
        return min(known) if known else None

    def _cap(self, d: Demand, blocks: int, soft_over: bool) -> float:
        cfg = self.cfg
        cap = cfg.hardWatermark
        if d.priority <= 0 and d.context_tokens >= cfg.longRequestTokens:
            cap = min(cap, cfg.admissionWatermark)
        if d.traffic_class == "batch":
            cap = min(cap, cfg.batchPauseWatermark)
        if soft_over:
            cap = min(cap, cfg.admissionWatermark)
        return cap

    def fits(self, d: Demand, blocks: int, replica: Replica, soft_over: bool = False) -> bool:
        pool = self.pool_blocks(replica)
        if self.occupancy(replica) + blocks > self._cap(d, blocks, soft_over) * pool:
            return False
        if d.traffic_class == "batch":
            return self.ledger.batch_by_replica[replica.url] + blocks <= self.batch_cap * pool
        return True

    # -- quotas -----------------------------------------------------------------------------------------------
    def _quotas(self, d: Demand) -> list[tuple[str, Quota]]:
        tenant = self.cfg.tenants.get(d.fairness_id, self.cfg.tenantQuota)
        out = [(f"tenant {d.fairness_id!r}", tenant)]
        cls = self.cfg.classes.get(d.traffic_class)  # type: ignore[call-overload]
        if cls is not None:
            out.append((f"class {d.traffic_class!r}", cls))
        return out

    def _context_rejection(self, d: Demand, replicas: Sequence[Replica]) -> Decision | None:
        limit = self.context_limit(replicas)
        if limit is not None and d.context_tokens > limit:
            return Decision(Outcome.REJECT, DropReason.CONTEXT_LENGTH,
                            f"prompt ({d.prompt_tokens} tokens) + max new tokens ({d.max_new_tokens}) = "
                            f"{d.context_tokens} exceeds the model's context limit of {limit} tokens; shorten "
                            f"the prompt or lower max_tokens.")
        for who, quota in self._quotas(d):
            if quota.maxContextTokens and d.context_tokens > quota.maxContextTokens:
                return Decision(Outcome.REJECT, DropReason.CONTEXT_LENGTH,
                                f"quota maxContextTokens of {who}: limit {quota.maxContextTokens} tokens, this "
                                f"request needs {d.context_tokens} (prompt {d.prompt_tokens} + max new "
                                f"{d.max_new_tokens}); shorten the prompt or lower max_tokens.")
        return None

    def _quota_rejection(self, d: Demand, blocks: int, total_pool: int, now: float) -> Decision | None:
        ledger = self.ledger
        tenant = ledger.tenant(d.fairness_id)
        share_after = (tenant.reserved_blocks + blocks) / total_pool
        if share_after > self.cfg.tenantMaxShare:
            return _quota("tenantMaxShare", f"fairness id {d.fairness_id!r}", f"{self.cfg.tenantMaxShare:.2f} "
                          f"of the KV pool ({total_pool} blocks)", f"{tenant.reserved_blocks} blocks reserved + "
                          f"{blocks} asked = {share_after:.3f} of the pool")
        for who, quota in self._quotas(d):
            totals = ledger.tenant(d.fairness_id) if who.startswith("tenant") else ledger.traffic_class(
                d.traffic_class)
            if quota.maxReservedTokens and totals.reserved_tokens + d.context_tokens > quota.maxReservedTokens:
                return _quota("maxReservedTokens", who, f"{quota.maxReservedTokens} tokens",
                              f"{totals.reserved_tokens} reserved + {d.context_tokens} asked")
            if quota.maxActiveSequences and totals.active + 1 > quota.maxActiveSequences:
                return _quota("maxActiveSequences", who, f"{quota.maxActiveSequences} sequences",
                              f"{totals.active} active")
            if quota.maxTokenSeconds:
                used = (ledger.token_seconds(fairness_id=d.fairness_id, now=now) if who.startswith("tenant")
                        else ledger.token_seconds(traffic_class=d.traffic_class, now=now))
                if used >= quota.maxTokenSeconds:
                    return _quota("maxTokenSeconds", who, f"{quota.maxTokenSeconds:g} token-seconds per "
                                  f"{self.cfg.tokenSecondsWindowSeconds:g} s", f"{used:.0f} token-seconds")
        return None

    def soft_over(self, fairness_id: str, total_pool: int) -> float:
        """How far the tenant's reserved share is over its soft quota, as a ratio of that quota (0: not over)."""
        share = self.ledger.tenant(fairness_id).reserved_blocks / max(total_pool, 1)
        return max(0.0, share / self.cfg.tenantSoftShare - 1.0)

    # -- the decision -----------------------------------------------------------------------------------------
    def decide(self, d: Demand, healthy: Sequence[Replica], now: float) -> Decision:
        if not healthy:
            return Decision(Outcome.RUN)  # the no-endpoint path answers; nothing to measure
        rejected = self._context_rejection(d, healthy)
        if rejected is not None:
            return rejected
        blocks = self.ledger.blocks_for(d.prompt_tokens, d.max_new_tokens)
        biggest = max(self.pool_blocks(r) for r in healthy)
        cap = self._cap(d, blocks, False)
        if d.traffic_class == "batch":
            cap = min(cap, self.batch_cap)
        if blocks > cap * biggest:
            return Decision(Outcome.REJECT, DropReason.KV_CAPACITY,
                            f"this request needs {blocks} KV blocks (prompt {d.prompt_tokens} + max new "
                            f"{d.max_new_tokens} tokens) but at most {math.floor(cap * biggest)} of a replica's "
                            f"{biggest} blocks may hold it; lower max_tokens or shorten the prompt.")
        total_pool = sum(self.pool_blocks(r) for r in healthy)
        rejected = self._quota_rejection(d, blocks, total_pool, now)
        if rejected is not None:
            return rejected
        soft = self.soft_over(d.fairness_id, total_pool) > 0
        fitting = tuple(r for r in healthy if self.fits(d, blocks, r, soft))
        if fitting:
            return Decision(Outcome.RUN, replicas=fitting)
        return Decision(Outcome.QUEUE)

    def state(self) -> dict:
        cfg = self.cfg
        return {"admissionWatermark": cfg.admissionWatermark, "batchPauseWatermark": cfg.batchPauseWatermark,
                "hardWatermark": cfg.hardWatermark, "interactiveReserve": cfg.interactiveReserve,
                "tenantMaxShare": cfg.tenantMaxShare, "tenantSoftShare": cfg.tenantSoftShare,
                "blockTokens": cfg.blockTokens, "safetyFactor": cfg.safetyFactor,
                "queueDeadlineMs": cfg.queueDeadlineMs, "default_pool_blocks": self.default_pool_blocks}


def _quota(name: str, who: str, limit: str, usage: str) -> Decision:
    return Decision(Outcome.REJECT, DropReason.QUOTA,
                    f"quota {name} of {who} reached: limit {limit}, usage {usage}; retry after some of its "
                    f"requests finish.")
