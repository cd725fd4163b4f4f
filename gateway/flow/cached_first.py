"""Cached-first dispatch (DESIGN, "Batches planned for the cache"): when the next request of a batch band may run
on a replica, flow control looks a bounded way down the same flow's queue for a request whose prompt prefix is
cached there, and sends that one first.

What is cached, as flow control can know it: the prefix blocks (gateway/bodies.py `prefix_blocks`, chained hashes
under the tenant's cache salt, so a tenant's prefix never matches another's) of the requests running on each
replica, which hold their blocks in the engine's KV, and of the last requests that ended there, whose blocks vLLM
keeps in its prefix cache until it hands them out again, those freed longest ago first. So of what ended, only the
latest that fit in the replica's free KV count (KV admission knows it: the pool less what is taken there); with
admission off, as many as the replica has slots. Anything older is not counted: a prefix the engine dropped would
reorder the queue for nothing.

Bounded and fair: only the flow whose turn it is (the band's fairness policy named it) is looked at, so no tenant
gains on another; only its first `lookahead` requests in the band's order; and a request passed over `lookahead`
times goes next whatever is cached. A request goes ahead only if strictly more of its leading blocks are cached
than of the head's, so with nothing shared the order is the band's own. `flowControl.cachedFirstLookahead`; 0: off.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from gateway.bodies import prefix_share
from gateway.settings import GatewayConfig

ENDED_MAX = 10_000  # requests that ended remembered per replica at most, whatever its free KV holds


class CachedPrefixes:
    """Per replica, the prefix blocks of what runs there and of the last requests that ended there."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    def ran(self, url: str, prefix: Sequence[int]) -> None:
        """A request with this prefix was dispatched to (or adopted on) `url`."""
        if prefix:
            self._of(url).running.update(prefix)

    def ended(self, url: str, prefix: Sequence[int], tokens: int, keep: int) -> None:
        """It ended there (finished, failed or evicted) holding `tokens` of KV: its blocks count among the last
        `keep` that ended (the replica's slots), while the replica's free KV holds them (`trim`)."""
        if not prefix:
            return
        r = self._of(url)
        _forget(r.running, prefix)
        r.ended.append((prefix, tokens))
        r.ended_blocks.update(prefix)
        r.ended_tokens += tokens
        while len(r.ended) > max(keep, 0):
            r.forget_oldest()

    def trim(self, url: str, free_tokens: float) -> None:
        """Forget the oldest that ended until the rest fit in `free_tokens`, the KV the replica has free: vLLM hands
        out the blocks freed longest ago first, so of what ended only the latest that much can still be cached."""
        r = self._replicas.get(url)
        while r is not None and r.ended and r.ended_tokens > free_tokens:
            r.forget_oldest()

    def moved(self, old: str, new: str, prefix: Sequence[int]) -> None:
        """A dispatched request moved to another replica before it ran (its replica refused the connection)."""
        if prefix:
            _forget(self._of(old).running, prefix)
            self.ran(new, prefix)

    def knows(self, url: str) -> bool:
        """Whether anything is counted as cached on `url` (else no request can go ahead of another there)."""
        r = self._replicas.get(url)
        return r is not None and bool(r.running or r.ended_blocks)

    def held(self, url: str, prefix: Sequence[int]) -> int:
        """How many of the prompt's leading blocks are cached on `url` as far as flow control knows (the chained
        hashes: the first block missing ends the run)."""
        r = self._replicas.get(url)
        if r is None:
            return 0
        n = 0
        for block in prefix:
            if block not in r.running and block not in r.ended_blocks:
                break
            n += 1
        return n

    def _of(self, url: str) -> "_Replica":
        r = self._replicas.get(url)
        if r is None:
            r = self._replicas[url] = _Replica()
        return r


class _Replica:
    __slots__ = ("running", "ended", "ended_blocks", "ended_tokens")

    def __init__(self) -> None:
        self.running: Counter[int] = Counter()
        self.ended: deque[tuple[Sequence[int], int]] = deque()
        self.ended_blocks: Counter[int] = Counter()
        self.ended_tokens = 0

    def forget_oldest(self) -> None:
        prefix, tokens = self.ended.popleft()
        _forget(self.ended_blocks, prefix)
        self.ended_tokens -= tokens


def _forget(counts: Counter[int], prefix: Sequence[int]) -> None:
    for block in prefix:
        left = counts[block] - 1
        if left > 0:
            counts[block] = left
        else:
            counts.pop(block, None)


def wants_prefix(config: GatewayConfig, priority: int) -> bool:
    """Whether a request's prefix blocks are computed (by the relay that takes it): for the prefix-affinity picker
    and for KV admission (a prefix shared with what runs is held once), every request; for cached-first dispatch,
    batch requests (priority below 0), the only ones it reorders."""
    return (config.picker.policy == "prefix-affinity" or config.admission.enabled
            or (priority < 0 and config.flowControl.cachedFirstLookahead > 0))


def request_prefix(config: GatewayConfig, priority: int, doc: object, path: str,
                   salt: str | None) -> tuple[tuple[int, ...], float]:
    """The request's prefix blocks and the share of its prompt they cover (gateway/bodies.py `prefix_share`), where
    `wants_prefix`; else ((), 0.0)."""
    return prefix_share(doc, path, salt) if wants_prefix(config, priority) else ((), 0.0)
