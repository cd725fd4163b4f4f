"""The KV ledger: the one owner of every KV reservation the gateway holds on a replica.

A reservation is a request's worst-case commitment, ceil(safetyFactor × ceil((prompt + max new) ÷
blockTokens)) blocks, taken at dispatch. As the response is relayed its used part (prompt + output so far)
grows and the remaining allowance shrinks; when generation ends the reservation shrinks to what is used,
and at end, cancel, disconnect or eviction it is released at once. The relay revises a reservation when its
blocks change (a block boundary, the output limit, the finish marker), so held tokens and token-seconds follow
the stream block by block. Totals are kept per replica, per fairness id and per traffic class, plus occupied
token-seconds (tokens held × seconds) over a window.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass


@dataclass(eq=False)
class Reservation:
    request_id: str
    fairness_id: str
    traffic_class: str
    priority: int
    replica: str
    prompt_tokens: int
    max_new_tokens: int
    blocks: int
    used_blocks: int
    output_tokens: int = 0
    accrued_at: float = 0.0
    generation_done: bool = False
    released: bool = False

    @property
    def held_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class TokenSecondsMeter:
    """Occupied token-seconds per key in one-second buckets, summed over a sliding window."""

    def __init__(self, window: float):
        self.window = window
        self._buckets: dict[str, deque[list[float]]] = defaultdict(deque)
        self._swept = 0.0

    def add(self, key: str, amount: float, now: float) -> None:
        if now - self._swept > self.window:
            # Forget keys with nothing in the window (fairness ids come and go).
            self._swept = now
            for stale in [k for k, b in self._buckets.items() if not b or b[-1][0] <= now - self.window - 1]:
                del self._buckets[stale]
        if amount <= 0:
            return
        buckets = self._buckets[key]
        second = math.floor(now)
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += amount
        else:
            buckets.append([second, amount])

    def total(self, key: str, now: float) -> float:
        buckets = self._buckets.get(key)
        if not buckets:
            return 0.0
        while buckets and buckets[0][0] <= now - self.window - 1:
            buckets.popleft()
        return sum(b[1] for b in buckets)


@dataclass
class Totals:
    reserved_blocks: int = 0
    used_blocks: int = 0
    reserved_tokens: int = 0
    active: int = 0


class KvLedger:
    def __init__(self, *, block_tokens: int, safety_factor: float, window: float):
        self.configure(block_tokens=block_tokens, safety_factor=safety_factor, window=window)
        self.by_replica: dict[str, Totals] = defaultdict(Totals)
        self.by_tenant: dict[str, Totals] = defaultdict(Totals)
        self.by_class: dict[str, Totals] = defaultdict(Totals)
        # Batch-class reservations per replica: the interactive reserve caps them.
        self.batch_by_replica: Counter[str] = Counter()
        self.active: set[Reservation] = set()

    def configure(self, *, block_tokens: int, safety_factor: float, window: float) -> None:
        """New settings apply to new reservations; the ones held keep their sizes."""
        self.block_tokens = block_tokens
        self.safety_factor = safety_factor
        if not hasattr(self, "meter") or self.meter.window != window:
            self.meter = TokenSecondsMeter(window)

    # -- sizing -----------------------------------------------------------------------------------------------
    def blocks_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        raw = math.ceil((prompt_tokens + max_new_tokens) / self.block_tokens)
        return max(1, math.ceil(raw * self.safety_factor - 1e-9))

    def _used_blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    # -- life cycle -------------------------------------------------------------------------------------------
    def reserve(self, *, request_id: str, fairness_id: str, traffic_class: str, priority: int, replica: str,
                prompt_tokens: int, max_new_tokens: int, now: float) -> Reservation:
        res = Reservation(request_id, fairness_id, traffic_class, priority, replica, prompt_tokens,
                          max_new_tokens, self.blocks_for(prompt_tokens, max_new_tokens),
                          self._used_blocks(prompt_tokens), accrued_at=now)
        res.used_blocks = min(res.used_blocks, res.blocks)
        self.active.add(res)
        self._apply(res, +1)
        return res

    def revise(self, res: Reservation, output_tokens: int, now: float, *, done: bool = False) -> None:
        """Output so far is `output_tokens`; `done` when generation has ended (the rest is never needed)."""
        if res.released or (output_tokens <= res.output_tokens and not done):
            return
        self._accrue(res, now)
        self._apply(res, -1)
        res.output_tokens = max(res.output_tokens, output_tokens)
        res.used_blocks = self._used_blocks(res.held_tokens)
        res.generation_done = res.generation_done or done or res.output_tokens >= res.max_new_tokens
        if res.generation_done:
            res.blocks = res.used_blocks
        # An estimate that was too low grows the reservation to what is really held.
        res.blocks = max(res.blocks, res.used_blocks)
        self._apply(res, +1)

    def revision_due(self, res: Reservation) -> int:
        """The output-token count at which `revise` next changes the reservation (a block boundary of the
        held tokens, or the output limit): the relay revises only then, not on every streamed chunk."""
        return min(res.max_new_tokens, res.used_blocks * self.block_tokens - res.prompt_tokens + 1)

    def move(self, res: Reservation, replica: str) -> None:
        self._apply(res, -1)
        res.replica = replica
        self._apply(res, +1)

    def release(self, res: Reservation, now: float) -> bool:
        if res.released:
            return False
        self._accrue(res, now)
        self._apply(res, -1)
        res.released = True
        self.active.discard(res)
        return True

    # -- token-seconds ----------------------------------------------------------------------------------------
    def _accrue(self, res: Reservation, now: float) -> None:
        amount = res.held_tokens * max(0.0, now - res.accrued_at)
        res.accrued_at = now
        self.meter.add("tenant:" + res.fairness_id, amount, now)
        self.meter.add("class:" + res.traffic_class, amount, now)

    def token_seconds(self, *, fairness_id: str | None = None, traffic_class: str | None = None,
                      now: float, accrued: bool = False) -> float:
        """Occupied token-seconds in the window, including what running requests hold up to `now`
        (`accrued`: the caller has just run `accrue_all(now)`)."""
        if not accrued:
            for res in self.active:
                if (fairness_id is not None and res.fairness_id == fairness_id) or (
                        traffic_class is not None and res.traffic_class == traffic_class):
                    self._accrue(res, now)
        key = "tenant:" + fairness_id if fairness_id is not None else "class:" + str(traffic_class)
        return self.meter.total(key, now)

    def accrue_all(self, now: float) -> None:
        for res in self.active:
            self._accrue(res, now)

    # -- totals -----------------------------------------------------------------------------------------------
    def _apply(self, res: Reservation, sign: int) -> None:
        tokens = res.prompt_tokens + max(res.max_new_tokens, res.output_tokens)
        if res.generation_done:
            tokens = res.held_tokens
        for totals in (self.by_replica[res.replica], self.by_tenant[res.fairness_id],
                       self.by_class[res.traffic_class]):
            totals.reserved_blocks += sign * res.blocks
            totals.used_blocks += sign * res.used_blocks
            totals.reserved_tokens += sign * tokens
            totals.active += sign
        if res.traffic_class == "batch":
            self.batch_by_replica[res.replica] += sign * res.blocks
        if sign < 0:
            for table, key in ((self.by_tenant, res.fairness_id), (self.by_class, res.traffic_class)):
                if table[key].active <= 0:
                    del table[key]

    def reserved_on(self, replica: str) -> int:
        totals = self.by_replica.get(replica)
        return totals.reserved_blocks if totals else 0

    def tenant(self, fairness_id: str) -> Totals:
        return self.by_tenant.get(fairness_id) or Totals()

    def traffic_class(self, name: str) -> Totals:
        return self.by_class.get(name) or Totals()
