"""KV admission: one of three outcomes for a request (run now, queue with a deadline, reject with the reason).

Read-only over the ledger and the replicas, and counted in KV tokens (whole blocks of each replica's own block
size). A replica's pool is what it reports (`vllm:cache_config_info` kv_cache_size_tokens, else num_gpu_blocks ×
block_size), else the calibration profile's, else the configured one; its occupancy is the larger of its
scraped KV usage × pool and what the ledger has reserved there. A request may go to a replica only if the
occupancy after adding its reservation (less the prompt prefix it shares with a request running there: vLLM holds
that once) stays under the step of the pressure ladder that applies to it:
  every request            ≤ hardWatermark (0.92)
  priority ≤ 0, long       ≤ admissionWatermark (0.82)   (long: prompt + n × max new ≥ longRequestTokens)
  batch class              ≤ batchPauseWatermark (0.88), and batch reservations ≤ (1 − interactiveReserve)
  tenant over its soft share: only while the replica stays under admissionWatermark
Above hardWatermark the flow controller evicts recoverable batch work, and a request above batch that waits
for KV room evicts batch work where the least must be freed for it (`shortfall`). The context limit rejects only what vLLM
rejects (a prompt that fills the context, an explicit output limit above it); an output limit that runs past
the context is reserved as vLLM clamps it, to the context's end. Quotas (hard tenant share, reserved tokens,
active sequences, context length, token-seconds) reject with the quota's name, limit and usage.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gateway.flow.views import LedgerView, ReplicaView, ReservationView
from gateway.settings import Admission, Quota
from holdback.contract import DropReason

if TYPE_CHECKING:
    from gateway.calibration import Profile


class KvOutcome(enum.Enum):
    RUN = "run"
    QUEUE = "queue"
    REJECT = "reject"


LEVELS = ("normal", "admission", "pause-batch", "evict")


@dataclass(frozen=True)
class Demand:
    """What a request asks of the KV pool."""

    prompt_tokens: int
    # Per sequence: the client's output limit, else the default vLLM applies (gateway/tokenization.py).
    max_new_tokens: int
    priority: int
    traffic_class: str
    fairness_id: str
    # n (best_of when larger): every sequence generates its own output into its own blocks.
    sequences: int = 1
    # The body field max_new_tokens came from (vLLM's name for it in a 400); None: a default, never rejected.
    limit_param: str | None = None
    # The prompt was counted by the model's tokenizer; an estimate (from characters) never refuses a request
    # for its length: the replica's own 400 does, if it is too long.
    prompt_exact: bool = True
    # The prompt's prefix blocks and the tokens they cover (gateway/flow/ledger.py): what a running request on a
    # replica shares of it is not added there again.
    prefix: tuple[int, ...] = ()
    prefix_tokens: int = 0

    @property
    def room(self) -> int:
        """The context a generation needs past its prompt: one output token (an embedding: none)."""
        return 1 if self.max_new_tokens > 0 else 0

    @property
    def context_tokens(self) -> int:
        """One sequence's context: what the model's context limit bounds."""
        return self.prompt_tokens + self.max_new_tokens

    @property
    def output_tokens(self) -> int:
        """Every sequence's output together."""
        return self.sequences * self.max_new_tokens

    @property
    def held_tokens(self) -> int:
        """The most the request can hold in KV: the prompt and every sequence's output."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Decision:
    outcome: KvOutcome
    reason: DropReason | None = None
    message: str = ""
    # RUN: the replicas the request fits on.
    replicas: tuple[ReplicaView, ...] = ()

    def fits(self, replica: ReplicaView) -> bool:
        """Whether the request fits on `replica` (the picker's filter)."""
        return replica in self.replicas


def reported_pool_tokens(replica: ReplicaView, block_size: int) -> int | None:
    """The KV pool the replica reports, in tokens (None: it reports none): kv_cache_size_tokens, else
    num_gpu_blocks × its block size, both of the whole replica (every data-parallel engine)."""
    if replica.kv_cache_size_tokens:
        return replica.kv_cache_size_tokens
    return replica.num_gpu_blocks * block_size if replica.num_gpu_blocks else None


# What ended on a replica shows in a scrape begun this long after (vLLM frees a request's blocks at its next step
# once the abort reaches its engine): until such a scrape, admission takes those blocks off the scraped usage.
FREED_SHOWS_AFTER = 0.25


class KvAdmission:
    def __init__(self, cfg: Admission, ledger: LedgerView, profile: Profile | None = None):
        self.cfg = cfg
        self.ledger = ledger
        # A replica's own vllm:cache_config_info wins; then the calibration profile; then the config.
        self.profile_block_size = profile.block_size if profile else None
        self.default_pool_tokens = (profile.num_gpu_blocks * profile.block_size if profile
                                    else cfg.default_pool_tokens())
        self.batch_cap = 1.0 - cfg.interactiveReserve
        self.queue_deadline = cfg.queueDeadlineMs / 1000.0
        # Per replica: (when, KV tokens) of its reservations that ended and may not show in its last scrape yet.
        self._freed: dict[str, list[tuple[float, int]]] = {}

    # -- capacity ---------------------------------------------------------------------------------------------
    def block_size(self, replica: ReplicaView) -> int:
        return replica.kv_block_size or self.profile_block_size or self.cfg.blockTokens

    def pool_tokens(self, replica: ReplicaView) -> int:
        return reported_pool_tokens(replica, self.block_size(replica)) or self.default_pool_tokens

    def occupancy(self, replica: ReplicaView) -> float:
        """KV tokens taken on the replica: the larger of what it reports (less what ended there since) and what we
        reserved there."""
        scraped = (replica.kv_usage or 0.0) * self.pool_tokens(replica) - self.freed_since_scrape(replica)
        return max(scraped, float(self.ledger.kv_tokens_on(replica.url)))

    def released(self, replica: ReplicaView, used_tokens: int, now: float) -> None:
        """A reservation on `replica` ended at `now` holding `used_tokens` in its KV (an eviction, an end). vLLM frees
        them at its next step, but its reported usage shows that only from a scrape begun after: until then they are
        taken off it, so a request waiting for them (realtime, after the kv-wait trigger evicted for it) runs at the
        next cycle instead of a scrape later, and the KV triggers see what their victims gave back."""
        self._freed.setdefault(replica.url, []).append((now, used_tokens))

    def freed_since_scrape(self, replica: ReplicaView) -> int:
        """KV tokens that ended on `replica` too late to show in its last scrape (FREED_SHOWS_AFTER)."""
        entries = self._freed.get(replica.url)
        if not entries:
            return 0
        entries[:] = [(at, n) for at, n in entries if at + FREED_SHOWS_AFTER > replica.metrics_from]
        return sum(n for _, n in entries)

    def level(self, replica: ReplicaView) -> str:
        share = self.occupancy(replica) / self.pool_tokens(replica)
        cfg = self.cfg
        if share >= cfg.hardWatermark:
            return "evict"
        if share >= cfg.batchPauseWatermark:
            return "pause-batch"
        if share >= cfg.admissionWatermark:
            return "admission"
        return "normal"

    def context_limit(self, replicas: Sequence[ReplicaView]) -> int | None:
        if self.cfg.maxContextTokens:
            return self.cfg.maxContextTokens
        known = [r.max_model_len for r in replicas if r.max_model_len]
        return min(known) if known else None

    def within_context(self, d: Demand, replicas: Sequence[ReplicaView]) -> Demand:
        """The demand as vLLM runs it: an output limit past the context's end is clamped to it, and so is an
        estimated prompt (vLLM runs a prompt within the context or refuses it)."""
        limit = self.context_limit(replicas)
        if limit is None or d.context_tokens <= limit:
            return d
        if not d.prompt_exact and d.prompt_tokens >= limit:
            d = dataclasses.replace(d, prompt_tokens=limit - d.room)
        return dataclasses.replace(d, max_new_tokens=max(0, limit - d.prompt_tokens))

    def kv_tokens(self, d: Demand, replica: ReplicaView) -> int:
        """The reservation `d` takes on `replica` (d within the context), in KV tokens."""
        return self.ledger.kv_tokens_for(d.prompt_tokens, d.output_tokens, self.block_size(replica))

    def added(self, d: Demand, kv_tokens: int, replica: ReplicaView, traffic_class: str | None = None) -> int:
        """What `d`'s reservation of `kv_tokens` adds to the replica's reserved total (or its traffic class's there):
        less the prompt prefix it shares with a request running there, which vLLM holds once (where its prefix
        cache is on)."""
        if not replica.prefix_caching:
            return kv_tokens
        return kv_tokens - self.ledger.shared_on(replica.url, self.block_size(replica), d.prefix, d.prefix_tokens,
                                                 traffic_class)

    def frees(self, res: ReservationView | None) -> float:
        """The blocks ending a reservation (evicting its request) gives back on its replica: its own, less the prompt
        prefix another request running there holds too."""
        if res is None:
            return 0.0
        return self.ledger.unshared(res, res.kv_tokens) / res.block_size

    def _cap(self, d: Demand, soft_over: bool) -> float:
        cfg = self.cfg
        cap = cfg.hardWatermark
        if d.priority <= 0 and d.held_tokens >= cfg.longRequestTokens:
            cap = min(cap, cfg.admissionWatermark)
        if d.traffic_class == "batch":
            cap = min(cap, cfg.batchPauseWatermark)
        if soft_over:
            cap = min(cap, cfg.admissionWatermark)
        return cap

    def shortfall(self, d: Demand, replica: ReplicaView, soft_over: bool = False) -> float:
        """KV tokens to free on `replica` before `d` (within the context) fits there under its step of the
        ladder; 0 when it fits."""
        need = self.added(d, self.kv_tokens(d, replica), replica)
        return max(0.0, self.occupancy(replica) + need - self._cap(d, soft_over) * self.pool_tokens(replica))

    def fits(self, d: Demand, kv_tokens: int, replica: ReplicaView, soft_over: bool = False) -> bool:
        pool = self.pool_tokens(replica)
        if self.occupancy(replica) + self.added(d, kv_tokens, replica) > self._cap(d, soft_over) * pool:
            return False
        if d.traffic_class == "batch":
            return (self.ledger.batch_kv_tokens[replica.url] + self.added(d, kv_tokens, replica, "batch")
                    <= self.batch_cap * pool)
        return True

    # -- quotas -----------------------------------------------------------------------------------------------
    def _quotas(self, d: Demand) -> list[tuple[str, Quota]]:
        tenant = self.cfg.tenants.get(d.fairness_id, self.cfg.tenantQuota)
        out = [(f"tenant {d.fairness_id!r}", tenant)]
        cls = self.cfg.classes.get(d.traffic_class)  # type: ignore[call-overload]
        if cls is not None:
            out.append((f"class {d.traffic_class!r}", cls))
        return out

    def _context_rejection(self, d: Demand, replicas: Sequence[ReplicaView]) -> Decision | None:
        """What vLLM would answer 400 (retrying cannot help), then the quotas' maxContextTokens (on `d` within
        the context)."""
        limit = self.context_limit(replicas)
        room = d.room
        if limit is not None and d.prompt_exact and d.prompt_tokens + room > limit:
            return Decision(KvOutcome.REJECT, DropReason.CONTEXT_LENGTH,
                            f"This model's maximum context length is {limit} tokens. However, your prompt "
                            f"contains {d.prompt_tokens} input tokens, which "
                            f"{'leaves no room for any output token' if room else 'exceeds this limit'}. Please "
                            f"reduce the length of the input prompt to at most {limit - room} tokens.")
        if limit is not None and d.limit_param is not None and d.max_new_tokens > limit:
            return Decision(KvOutcome.REJECT, DropReason.CONTEXT_LENGTH,
                            f"{d.limit_param}={d.max_new_tokens} cannot be greater than the model's context "
                            f"length of {limit} tokens. Please request fewer output tokens.")
        d = self.within_context(d, replicas)
        for who, quota in self._quotas(d):
            if quota.maxContextTokens and d.context_tokens > quota.maxContextTokens:
                return Decision(KvOutcome.REJECT, DropReason.CONTEXT_LENGTH,
                                f"quota maxContextTokens of {who}: limit {quota.maxContextTokens} tokens, this "
                                f"request needs {d.context_tokens} (prompt {d.prompt_tokens} + max new "
                                f"{d.max_new_tokens}); shorten the prompt or lower max_tokens.")
        return None

    def _quota_rejection(self, d: Demand, kv_tokens: int, total_pool: int, now: float) -> Decision | None:
        ledger = self.ledger
        tenant = ledger.tenant(d.fairness_id)
        share_after = (tenant.kv_tokens + kv_tokens) / total_pool
        # A fairness id holding nothing runs one request past its share: else a request bigger than the share
        # (a long context on a small pool) would be refused "retry later" forever, with nothing of its own to end.
        # A share of the whole pool is no quota: what does not fit then waits for room like anyone's request.
        if self.cfg.tenantMaxShare < 1.0 and share_after > self.cfg.tenantMaxShare and tenant.kv_tokens > 0:
            return _quota("tenantMaxShare", f"fairness id {d.fairness_id!r}", f"{self.cfg.tenantMaxShare:.2f} "
                          f"of the KV pool ({total_pool} tokens)", f"{tenant.kv_tokens} KV tokens reserved + "
                          f"{kv_tokens} asked = {share_after:.3f} of the pool")
        for who, quota in self._quotas(d):
            totals = ledger.tenant(d.fairness_id) if who.startswith("tenant") else ledger.traffic_class(
                d.traffic_class)
            if quota.maxReservedTokens and totals.reserved_tokens + d.held_tokens > quota.maxReservedTokens:
                return _quota("maxReservedTokens", who, f"{quota.maxReservedTokens} tokens",
                              f"{totals.reserved_tokens} reserved + {d.held_tokens} asked")
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
        share = self.ledger.tenant(fairness_id).kv_tokens / max(total_pool, 1)
        return max(0.0, share / self.cfg.tenantSoftShare - 1.0)

    # -- the decision -----------------------------------------------------------------------------------------
    def decide(self, d: Demand, healthy: Sequence[ReplicaView], now: float) -> Decision:
        if not healthy:
            return Decision(KvOutcome.RUN)  # the no-endpoint path answers; nothing to measure
        rejected = self._context_rejection(d, healthy)
        if rejected is not None:
            return rejected
        d = self.within_context(d, healthy)
        need = {r.url: self.kv_tokens(d, r) for r in healthy}
        cap = self._cap(d, False)
        if d.traffic_class == "batch":
            cap = min(cap, self.batch_cap)
        # Where it leaves the most of the cap free: if it does not fit there on an empty pool, it fits nowhere.
        best = max(healthy, key=lambda r: cap * self.pool_tokens(r) - need[r.url])
        if need[best.url] > cap * self.pool_tokens(best):
            size, pool = self.block_size(best), self.pool_tokens(best)
            seqs = f" x {d.sequences} sequences" if d.sequences > 1 else ""
            return Decision(KvOutcome.REJECT, DropReason.KV_NEVER_FITS,
                            f"this request needs {need[best.url] // size} KV blocks of {size} tokens (prompt "
                            f"{d.prompt_tokens} + max new {d.max_new_tokens} tokens{seqs}) but at most "
                            f"{math.floor(cap * pool / size)} of a replica's {pool // size} blocks may hold it; "
                            f"lower max_tokens or shorten the prompt.")
        total_pool = sum(self.pool_tokens(r) for r in healthy)
        rejected = self._quota_rejection(d, max(need.values()), total_pool, now)
        if rejected is not None:
            return rejected
        soft = self.soft_over(d.fairness_id, total_pool) > 0
        fitting = tuple(r for r in healthy if self.fits(d, need[r.url], r, soft))
        if fitting:
            return Decision(KvOutcome.RUN, replicas=fitting)
        return Decision(KvOutcome.QUEUE)

    def state(self) -> dict:
        cfg = self.cfg
        return {"admissionWatermark": cfg.admissionWatermark, "batchPauseWatermark": cfg.batchPauseWatermark,
                "hardWatermark": cfg.hardWatermark, "interactiveReserve": cfg.interactiveReserve,
                "tenantMaxShare": cfg.tenantMaxShare, "tenantSoftShare": cfg.tenantSoftShare,
                "blockTokens": cfg.blockTokens, "safetyFactor": cfg.safetyFactor,
                "queueDeadlineMs": cfg.queueDeadlineMs, "default_pool_tokens": self.default_pool_tokens}


def _quota(name: str, who: str, limit: str, usage: str) -> Decision:
    return Decision(KvOutcome.REJECT, DropReason.QUOTA,
                    f"quota {name} of {who} reached: limit {limit}, usage {usage}; retry after some of its "
                    f"requests finish.")
