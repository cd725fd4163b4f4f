"""KV-cache admission (seed 004): reserve a request's worst-case KV commitment before it reaches a replica.

Commitment = ceil((prompt tokens + max new tokens) / blockTokens) blocks. Prompt tokens are estimated from
the body's text (the gateway has no tokenizer; `charsPerToken`, default 4) or counted exactly for token-id
prompts; a missing `max_tokens` counts as `maxNewTokensDefault`. A replica's used share is the larger of its
scraped `vllm:kv_cache_usage_perc` and the blocks the gateway has reserved there. Limits on that share:
sheddable requests (priority < 0) stop at min(admissionWatermark, 1 − interactiveReserve); the rest stop at
hardWatermark. Each fairness id may reserve at most tenantMaxShare of the whole pool. Outcomes: dispatch,
queue until a replica has room (at most queueDeadlineMs), or reject (`rejected-kv-admission` when the
request could never fit, or its KV wait ran out; `rejected-tenant-quota` over the tenant's share).
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any, Mapping, Sequence

from gateway.config import Admission
from gateway.replicas import Replica


class Verdict(enum.Enum):
    DISPATCH = "dispatch"
    QUEUE = "queue"
    REJECT_KV = "reject-kv"
    REJECT_QUOTA = "reject-quota"


def _text_chars(value: Any) -> tuple[int, int]:
    """(characters of text, exact token ids) found in a prompt/messages/input value."""
    if value is None:
        return 0, 0
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return 0, len(value)
        chars = tokens = 0
        for item in value:
            c, t = _text_chars(item)
            chars, tokens = chars + c, tokens + t
        return chars, tokens
    if isinstance(value, dict):
        if "content" in value:
            return _text_chars(value["content"])
        if "text" in value:
            return _text_chars(value["text"])
    return 0, 0


class KvAdmission:
    """Admission decisions for one config; stateless apart from the reservations on the replicas."""

    def __init__(self, cfg: Admission):
        self.cfg = cfg
        self.block_tokens = cfg.blockTokens
        self.default_pool_blocks = cfg.kvPoolBlocks or int(
            cfg.kvPoolGiB * 2**30 // (cfg.bytesPerToken * cfg.blockTokens))
        self.sheddable_cap = min(cfg.admissionWatermark, 1.0 - cfg.interactiveReserve)
        self.interactive_cap = cfg.hardWatermark
        self.queue_deadline = cfg.queueDeadlineMs / 1000.0

    # -- estimates -----------------------------------------------------------------------------------------
    def estimate_tokens(self, body: Mapping[str, Any]) -> tuple[int, int]:
        """(prompt tokens, max new tokens) for a completions, chat or embeddings body."""
        chars, exact = 0, 0
        for key in ("messages", "prompt", "input"):
            c, t = _text_chars(body.get(key))
            chars, exact = chars + c, exact + t
        prompt = exact + math.ceil(chars / self.cfg.charsPerToken)
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        if "input" in body and "messages" not in body and "prompt" not in body:
            max_new = 0  # embeddings generate nothing
        elif not isinstance(max_new, int) or max_new <= 0:
            max_new = self.cfg.maxNewTokensDefault
        return prompt, max_new

    def estimate_blocks(self, raw_body: bytes) -> int:
        try:
            body = json.loads(raw_body) if raw_body else {}
        except (ValueError, UnicodeDecodeError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        prompt, max_new = self.estimate_tokens(body)
        return max(1, math.ceil((prompt + max_new) / self.block_tokens))

    # -- capacity ------------------------------------------------------------------------------------------
    def pool_blocks(self, replica: Replica) -> int:
        return replica.kv_blocks_total or self.default_pool_blocks

    def used_blocks(self, replica: Replica) -> float:
        pool = self.pool_blocks(replica)
        return max((replica.kv_usage or 0.0) * pool, float(replica.committed_blocks))

    def cap(self, priority: int) -> float:
        return self.sheddable_cap if priority < 0 else self.interactive_cap

    def fits(self, blocks: int, priority: int, replica: Replica) -> bool:
        pool = self.pool_blocks(replica)
        return self.used_blocks(replica) + blocks <= self.cap(priority) * pool

    def check(self, blocks: int, priority: int, fairness_id: str, replicas: Sequence[Replica],
              tenant_blocks: Mapping[str, int]) -> Verdict:
        healthy = [r for r in replicas if r.healthy]
        if not healthy:
            return Verdict.DISPATCH  # the no-endpoint path answers; admission has nothing to measure
        if all(blocks > self.cap(priority) * self.pool_blocks(r) for r in healthy):
            return Verdict.REJECT_KV
        total = sum(self.pool_blocks(r) for r in healthy)
        if tenant_blocks.get(fairness_id, 0) + blocks > self.cfg.tenantMaxShare * total:
            return Verdict.REJECT_QUOTA
        if any(self.fits(blocks, priority, r) for r in healthy):
            return Verdict.DISPATCH
        return Verdict.QUEUE

    def state(self) -> dict:
        return {"enabled": True, "default_pool_blocks": self.default_pool_blocks,
                "block_tokens": self.block_tokens, "sheddable_cap": self.sheddable_cap,
                "interactive_cap": self.interactive_cap, "tenant_max_share": self.cfg.tenantMaxShare,
                "queue_deadline_s": self.queue_deadline}
