"""The `prefix-affinity` replica scorer: a request goes where its prompt's prefix was sent before (so is likely still
in that replica's prefix cache), unless that replica is much busier than the least loaded one.

It remembers, per replica, the chained block hashes (gateway/bodies.py `prefix_blocks`, salted per tenant) of the
prompts it sent there, the most recent `blocks_per_replica` of them (LRU). For a request it counts, on each
candidate, how many of the prompt's leading blocks it sent there. The rule: the candidate holding the most blocks
wins unless its load (least-loaded's score: in-flight ÷ slots + KV occupancy) exceeds the least loaded
candidate's by more than `max_load_gap`; then, and when no candidate holds any block, the least loaded one wins.
Like llm-d's prefix-cache scorer it knows what it sent, not what the replica still holds: a prefix the engine
evicted since is found missing only by the prefill that follows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence, TypeVar

from gateway.policies.picker import LeastLoaded, ReplicaLoad

R = TypeVar("R")
MAX_LOAD_GAP = 0.5  # half a replica's slots (or half its KV) busier than the least loaded: go elsewhere
BLOCKS_PER_REPLICA = 200_000  # 8-byte hashes of 128-char blocks: about 25 M characters of prompts per replica


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, in_flight_weight: float = 1.0, kv_usage_weight: float = 1.0,
                 max_load_gap: float = MAX_LOAD_GAP, blocks_per_replica: int = BLOCKS_PER_REPLICA):
        if max_load_gap < 0:
            raise ValueError(f"max_load_gap must not be negative, got {max_load_gap}")
        if blocks_per_replica < 1:
            raise ValueError(f"blocks_per_replica must be at least 1, got {blocks_per_replica}")
        self.load = LeastLoaded(in_flight_weight, kv_usage_weight)
        self.max_load_gap = max_load_gap
        self.blocks_per_replica = blocks_per_replica
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def score(self, view: ReplicaLoad) -> float:
        """Without a prefix to place: least-loaded's score."""
        return self.load.score(view)

    def held(self, url: str, prefix: Sequence[int]) -> int:
        """How many of the prompt's leading blocks were sent to `url` (its chained hashes: the first one missing
        ends the run)."""
        sent = self._sent.get(url)
        if not sent:
            return 0
        n = 0
        for block in prefix:
            if block not in sent:
                break
            n += 1
        return n

    def choose(self, candidates: Sequence[R], load: Callable[[R], ReplicaLoad], prefix: Sequence[int]) -> R:
        """The replica for a request whose prompt has `prefix` (candidates in the picker's rotation, all with
        room); remembers the prefix as sent there."""
        loads = [load(r) for r in candidates]
        scores = [self.score(v) for v in loads]
        least = min(range(len(candidates)), key=scores.__getitem__)
        held = [self.held(v.url, prefix) for v in loads]
        best = max(range(len(candidates)), key=lambda i: (held[i], -scores[i]))
        if held[best] == 0 or scores[best] - scores[least] > self.max_load_gap:
            best = least
        self.sent(loads[best].url, prefix)
        return candidates[best]

    def sent(self, url: str, prefix: Sequence[int]) -> None:
        sent = self._sent.setdefault(url, OrderedDict())
        for block in prefix:
            sent[block] = None
            sent.move_to_end(block)
        while len(sent) > self.blocks_per_replica:
            sent.popitem(last=False)
