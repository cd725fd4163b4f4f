"""The KV ledger: the one owner of every KV reservation the gateway holds on a replica.

Everything is counted in KV tokens: token slots of a replica's pool, always whole blocks of that replica's own
block size (vLLM's `block_size`: 16 to 128 and more, per attention backend). A reservation is a request's
worst-case commitment, ceil(safetyFactor × ceil((prompt + max new) ÷ block size)) blocks, taken at dispatch,
where max new is every sequence's output together (n × the output limit). As the response is relayed its used
part (prompt + output so far) grows and the remaining allowance shrinks; when generation ends the reservation
shrinks to what is used, and at end, cancel, disconnect or eviction it is released at once. The relay revises
a reservation when its blocks change (a block boundary, the output limit, the finish marker), so held tokens
and token-seconds follow the stream block by block. Totals are kept per replica, per fairness id and per
traffic class, plus occupied token-seconds (tokens held × seconds) over a window.

A prompt prefix that running requests on one replica share is held there once: vLLM's prefix cache hands a request
the blocks of its prefix that another running request already holds. Each reservation keeps its own worst case;
the totals take off, per replica and per traffic class and fairness id on it, the prefix blocks counted more than
once (`SharedPrefixes`). So a batch whose every line starts with one long system prompt is counted as vLLM holds it,
not once per line.
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
    # Every sequence's output together (n × the per-sequence limit the replica applies).
    max_new_tokens: int
    # The replica's tokens per KV block; kv_tokens and used_kv_tokens are whole blocks of it.
    block_size: int
    kv_tokens: int
    used_kv_tokens: int
    output_tokens: int = 0
    accrued_at: float = 0.0
    # When output_tokens last changed (the relay revises at block boundaries), or the reservation was made.
    revised_at: float = 0.0
    generation_done: bool = False
    released: bool = False
    # The prompt's leading blocks as chained hashes (gateway/bodies.py `prefix_blocks`, every SHARE_STRIDE-th) and
    # the prompt tokens they cover (estimated from characters): what other requests on its replica may share with
    # it, where its replica's prefix cache is on (`sharing`).
    prefix: tuple[int, ...] = ()
    prefix_tokens: int = 0
    sharing: bool = False

    @property
    def held_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def blocks(self) -> int:
        return self.kv_tokens // self.block_size

    @property
    def used_blocks(self) -> int:
        return self.used_kv_tokens // self.block_size


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
    # KV tokens reserved and used (whole blocks of each replica's block size).
    kv_tokens: int = 0
    used_kv_tokens: int = 0
    # Tokens asked (prompt + every sequence's output limit, or what is held once generation ended): the
    # maxReservedTokens quota's unit, independent of block sizes.
    reserved_tokens: int = 0
    active: int = 0


def whole_blocks(tokens: int, block_size: int) -> int:
    """`tokens` rounded up to whole blocks, in tokens."""
    return math.ceil(tokens / block_size) * block_size


# The ledger follows a prefix in steps of this many of its 128-character blocks (about 128 tokens of English): each
# step is one dictionary entry per scope, updated at every dispatch and end; a finer step would find at most a
# step's tokens more shared per request.
SHARE_STRIDE = 4


def coarse_prefix(prefix: tuple[int, ...], tokens: int) -> tuple[tuple[int, ...], int]:
    """Every SHARE_STRIDE-th of a prompt's chained block hashes (each stands for the prompt up to its end) and the
    tokens they cover, of the `tokens` the whole `prefix` covers."""
    coarse = prefix[SHARE_STRIDE - 1::SHARE_STRIDE]
    if not coarse or tokens <= 0:
        return (), 0
    return coarse, tokens * len(coarse) * SHARE_STRIDE // len(prefix)


def shared_whole_blocks(tokens: float, block_size: int) -> int:
    """Of a prefix of `tokens` (estimated) that two prompts share, the KV tokens vLLM shares between them: its whole
    blocks, less one for where the prompts part (the estimate's error and the template's tokens fall there)."""
    return max(0, math.floor(tokens / block_size) - 1) * block_size


class SharedPrefixes:
    """The prefix blocks of the reservations in one scope (a replica; a traffic class or a fairness id on it), each
    block with how many hold it. `counted_twice` is what summing the reservations counts more than once: for each
    block, its tokens once per holder after the first; less, per holder that shares a first block with another, the
    block where its prompt parts from the other (vLLM shares whole KV blocks only).

    The hashes are chained, so whoever holds a block holds every block before it: along a prompt's prefix the
    holders' count never grows, and how far a count holds is found by bisection. Each block keeps the tokens from
    the prompt's start to its end (`upto`, as its first holder estimated them), so a shared run's tokens are one
    lookup, and a prefix is added with C-level bulk updates: flow control does this for every dispatch."""

    __slots__ = ("holders", "upto", "extra", "sharers")

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.upto: dict[int, float] = {}
        self.extra = 0.0
        self.sharers = 0

    def _depth(self, prefix: tuple[int, ...], holders: int) -> int:
        """How many of the prefix's leading blocks at least `holders` hold."""
        lo, hi = 0, len(prefix)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.holders.get(prefix[mid - 1], 0) >= holders:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _tokens(self, prefix: tuple[int, ...], depth: int) -> float:
        return self.upto[prefix[depth - 1]] if depth else 0.0

    def add(self, prefix: tuple[int, ...], per_block: float) -> None:
        held = self._depth(prefix, 1)
        base = self._tokens(prefix, held)
        holders = self.holders
        if held:
            self.extra += base
            self.sharers += 1
            for block in prefix[:held]:
                holders[block] += 1
        rest = prefix[held:]
        holders.update(dict.fromkeys(rest, 1))
        self.upto.update(zip(rest, [base + per_block * (i + 1) for i in range(len(rest))]))

    def remove(self, prefix: tuple[int, ...]) -> None:
        shared = self._depth(prefix, 2)
        if shared:
            self.extra -= self._tokens(prefix, shared)
            self.sharers -= 1
            if not self.sharers:  # no block has two holders: nothing is counted twice (no float residue kept)
                self.extra = 0.0
        holders, upto = self.holders, self.upto
        for block in prefix[:shared]:
            holders[block] -= 1
        for block in prefix[shared:]:  # held by this one alone
            del holders[block], upto[block]

    def counted_twice(self, block_size: int) -> int:
        """KV tokens (whole blocks) the scope's reservations count more than once."""
        if not self.sharers:
            return 0
        return max(0, math.floor((self.extra - self.sharers * block_size) / block_size + 1e-9)) * block_size

    def held(self, prefix: tuple[int, ...]) -> float:
        """Tokens of `prefix`'s leading blocks held here."""
        return self._tokens(prefix, self._depth(prefix, 1))

    def held_by_others(self, prefix: tuple[int, ...]) -> float:
        """Tokens of the leading blocks of `prefix` (one of the holders) that another holder holds too."""
        return self._tokens(prefix, self._depth(prefix, 2))


class KvLedger:
    def __init__(self, *, block_tokens: int, safety_factor: float, window: float):
        self.configure(block_tokens=block_tokens, safety_factor=safety_factor, window=window)
        self.by_replica: dict[str, Totals] = defaultdict(Totals)
        self.by_tenant: dict[str, Totals] = defaultdict(Totals)
        self.by_class: dict[str, Totals] = defaultdict(Totals)
        # Batch-class KV tokens per replica: the interactive reserve caps them.
        self.batch_kv_tokens: Counter[str] = Counter()
        self.active: set[Reservation] = set()
        # Per scope (the replica; ("class", name, replica); ("tenant", fairness id, replica)): shared prefixes.
        self.shared: dict[object, SharedPrefixes] = {}

    def configure(self, *, block_tokens: int, safety_factor: float, window: float) -> None:
        """New settings apply to new reservations; the ones held keep their sizes. `block_tokens` is only the
        block size of a reservation whose replica reported none (admission.blockTokens)."""
        self.block_tokens = block_tokens
        self.safety_factor = safety_factor
        if not hasattr(self, "meter") or self.meter.window != window:
            self.meter = TokenSecondsMeter(window)

    # -- sizing -----------------------------------------------------------------------------------------------
    def kv_tokens_for(self, prompt_tokens: int, max_new_tokens: int, block_size: int | None = None) -> int:
        """The reservation for prompt + max new tokens on a replica with this block size, in KV tokens."""
        size = block_size or self.block_tokens
        raw = math.ceil((prompt_tokens + max_new_tokens) / size)
        return max(1, math.ceil(raw * self.safety_factor - 1e-9)) * size

    # -- life cycle -------------------------------------------------------------------------------------------
    def reserve(self, *, request_id: str, fairness_id: str, traffic_class: str, priority: int, replica: str,
                prompt_tokens: int, max_new_tokens: int, now: float, block_size: int | None = None,
                prefix: tuple[int, ...] = (), prefix_tokens: int = 0, sharing: bool = True) -> Reservation:
        """`max_new_tokens`: every sequence's output together; `block_size`: the replica's (None: blockTokens);
        `prefix`, `prefix_tokens`: the prompt's prefix blocks and the tokens they cover (nothing shared: ());
        `sharing`: the replica's prefix cache is on (else nothing is shared there)."""
        size = block_size or self.block_tokens
        kv_tokens = self.kv_tokens_for(prompt_tokens, max_new_tokens, size)
        coarse, covered = coarse_prefix(prefix, min(prefix_tokens, prompt_tokens))
        res = Reservation(request_id, fairness_id, traffic_class, priority, replica, prompt_tokens,
                          max_new_tokens, size, kv_tokens, min(whole_blocks(prompt_tokens, size), kv_tokens),
                          accrued_at=now, revised_at=now, prefix=coarse, prefix_tokens=covered, sharing=sharing)
        self.active.add(res)
        self._apply(res, +1)
        self._share(res, +1)
        return res

    def revise(self, res: Reservation, output_tokens: int, now: float, *, done: bool = False) -> None:
        """Output so far is `output_tokens`; `done` when generation has ended (the rest is never needed)."""
        if res.released or (output_tokens <= res.output_tokens and not done):
            return
        self._accrue(res, now)
        self._apply(res, -1)
        res.output_tokens = max(res.output_tokens, output_tokens)
        res.revised_at = now
        res.used_kv_tokens = whole_blocks(res.held_tokens, res.block_size)
        res.generation_done = res.generation_done or done or res.output_tokens >= res.max_new_tokens
        if res.generation_done:
            res.kv_tokens = res.used_kv_tokens
        # An estimate that was too low grows the reservation to what is really held.
        res.kv_tokens = max(res.kv_tokens, res.used_kv_tokens)
        self._apply(res, +1)

    def revision_due(self, res: Reservation) -> int:
        """The output-token count at which `revise` next changes the reservation (a block boundary of the
        held tokens, or the output limit): the relay revises only then, not on every streamed chunk."""
        return min(res.max_new_tokens, res.used_kv_tokens - res.prompt_tokens + 1)

    def move(self, res: Reservation, replica: str, block_size: int | None = None, sharing: bool = True) -> None:
        """To another replica: what is held is rounded to that replica's blocks (None: keep the block size);
        `sharing`: that replica's prefix cache is on."""
        self._share(res, -1)
        self._apply(res, -1)
        res.replica = replica
        res.sharing = sharing
        if block_size and block_size != res.block_size:
            res.block_size = block_size
            res.used_kv_tokens = whole_blocks(res.held_tokens, block_size)
            res.kv_tokens = max(whole_blocks(res.kv_tokens, block_size), res.used_kv_tokens)
        self._apply(res, +1)
        self._share(res, +1)

    def release(self, res: Reservation, now: float) -> bool:
        if res.released:
            return False
        self._accrue(res, now)
        self._share(res, -1)
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
            totals.kv_tokens += sign * res.kv_tokens
            totals.used_kv_tokens += sign * res.used_kv_tokens
            totals.reserved_tokens += sign * tokens
            totals.active += sign
        if res.traffic_class == "batch":
            self.batch_kv_tokens[res.replica] += sign * res.kv_tokens
        if sign < 0:
            for table, key in ((self.by_tenant, res.fairness_id), (self.by_class, res.traffic_class)):
                if table[key].active <= 0:
                    del table[key]

    # -- shared prefixes --------------------------------------------------------------------------------------
    def _scopes(self, res: Reservation) -> tuple[tuple[object, Totals], ...]:
        """Each scope a reservation's prefix counts in, with the totals its double count comes off."""
        return ((res.replica, self.by_replica[res.replica]),
                (("class", res.traffic_class, res.replica), self.by_class[res.traffic_class]),
                (("tenant", res.fairness_id, res.replica), self.by_tenant[res.fairness_id]))

    def _share(self, res: Reservation, sign: int) -> None:
        """Add (+1) or take out (-1) the reservation's prefix in its scopes, and the totals' double count with it."""
        if not (res.prefix and res.sharing):
            return
        per_block = res.prefix_tokens / len(res.prefix)
        for key, totals in self._scopes(res):
            scope = self.shared.get(key)
            if scope is None:
                scope = self.shared[key] = SharedPrefixes()
            before = scope.counted_twice(res.block_size)
            if sign > 0:
                scope.add(res.prefix, per_block)
            else:
                scope.remove(res.prefix)
            change = scope.counted_twice(res.block_size) - before
            totals.kv_tokens -= change
            totals.used_kv_tokens -= change
            if key == ("class", "batch", res.replica):
                self.batch_kv_tokens[res.replica] -= change
            if not scope.holders:
                del self.shared[key]

    def shared_on(self, replica: str, block_size: int, prefix: tuple[int, ...], prefix_tokens: int,
                  traffic_class: str | None = None) -> int:
        """KV tokens of a new request's prompt that it would share with what runs on `replica` (among that traffic
        class's requests there, if named): what its reservation would not add to the replica's (or class's) total."""
        prefix, prefix_tokens = coarse_prefix(prefix, prefix_tokens)
        if not prefix:
            return 0
        scope = self.shared.get(replica if traffic_class is None else ("class", traffic_class, replica))
        if scope is None:
            return 0
        return shared_whole_blocks(min(scope.held(prefix), prefix_tokens), block_size)

    def unshared(self, res: Reservation, tokens: int) -> int:
        """Of `tokens` that `res` holds, what its end frees: the blocks of its prefix that another request running
        on its replica holds stay held."""
        scope = self.shared.get(res.replica) if res.prefix and res.sharing else None
        if scope is None:
            return tokens
        return max(0, tokens - shared_whole_blocks(scope.held_by_others(res.prefix), res.block_size))

    def kv_tokens_on(self, replica: str) -> int:
        totals = self.by_replica.get(replica)
        return totals.kv_tokens if totals else 0

    def tenant(self, fairness_id: str) -> Totals:
        return self.by_tenant.get(fairness_id) or Totals()

    def traffic_class(self, name: str) -> Totals:
        return self.by_class.get(name) or Totals()
