"""Cached-first dispatch (DESIGN, "Batches planned for the cache"): when the next request of a batch band may run
on a replica, flow control looks a bounded way down the same flow's queue for a request whose prompt prefix is
cached there, and sends that one first.

What is cached, as flow control can know it: the prefix blocks (gateway/bodies.py `prefix_blocks`, chained hashes
under the tenant's cache salt, so a tenant's prefix never matches another's) of the requests running on each
replica, which hold their blocks in the engine's KV for certain, and of the last requests that ended there (as many
as the replica has slots), whose blocks vLLM keeps in its prefix cache until the pool needs them. Anything that
ended longer ago is not counted: the pool turns over within a generation or two of its slots, and a prefix the
engine dropped would reorder the queue for nothing.

Bounded and fair: only the flow whose turn it is (the band's fairness policy named it) is looked at, so no tenant
gains on another; only its first `lookahead` requests in the band's order; and a request passed over `lookahead`
times goes next whatever is cached. A request goes ahead only if strictly more of its leading blocks are cached
than of the head's, so with nothing shared the order is the band's own. `flowControl.cachedFirstLookahead`; 0: off.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from gateway.settings import GatewayConfig


class CachedPrefixes:
    """Per replica, the prefix blocks of what runs there and of the last requests that ended there."""

    def __init__(self) -> None:
        self._running: dict[str, Counter[int]] = {}
        self._ended: dict[str, deque[Sequence[int]]] = {}
        self._ended_blocks: dict[str, Counter[int]] = {}

    def ran(self, url: str, prefix: Sequence[int]) -> None:
        """A request with this prefix was dispatched to (or adopted on) `url`."""
        if prefix:
            self._running.setdefault(url, Counter()).update(prefix)

    def ended(self, url: str, prefix: Sequence[int], keep: int) -> None:
        """It ended there (finished, failed or evicted): its blocks count among the last `keep` that ended."""
        if not prefix:
            return
        self._drop_running(url, prefix)
        ended = self._ended.setdefault(url, deque())
        blocks = self._ended_blocks.setdefault(url, Counter())
        ended.append(prefix)
        blocks.update(prefix)
        while len(ended) > max(keep, 0):
            _forget(blocks, ended.popleft())

    def moved(self, old: str, new: str, prefix: Sequence[int]) -> None:
        """A dispatched request moved to another replica before it ran (its replica refused the connection)."""
        if prefix:
            self._drop_running(old, prefix)
            self.ran(new, prefix)

    def knows(self, url: str) -> bool:
        """Whether anything is counted as cached on `url` (else no request can go ahead of another there)."""
        return bool(self._running.get(url) or self._ended_blocks.get(url))

    def held(self, url: str, prefix: Sequence[int]) -> int:
        """How many of the prompt's leading blocks are cached on `url` as far as flow control knows (the chained
        hashes: the first block missing ends the run)."""
        running, ended = self._running.get(url), self._ended_blocks.get(url)
        if not prefix or (not running and not ended):
            return 0
        n = 0
        for block in prefix:
            if not ((running and block in running) or (ended and block in ended)):
                break
            n += 1
        return n

    def _drop_running(self, url: str, prefix: Sequence[int]) -> None:
        running = self._running.get(url)
        if running is not None:
            _forget(running, prefix)


def _forget(counts: Counter[int], prefix: Sequence[int]) -> None:
    for block in prefix:
        left = counts[block] - 1
        if left > 0:
            counts[block] = left
        else:
            counts.pop(block, None)


def wants_prefix(config: GatewayConfig, priority: int) -> bool:
    """Whether a request's prefix blocks are computed (by the relay that takes it): for the prefix-affinity picker,
    every request; for cached-first dispatch, batch requests (priority below 0), the only ones it reorders."""
    return config.picker.policy == "prefix-affinity" or (priority < 0 and config.flowControl.cachedFirstLookahead > 0)
