"""A batch's plan for the prefix cache: the order its pending rows are queued in, so that rows sharing a prompt
prefix run close together, the longest shared prefix first. A batch in which no two rows share a leading block
keeps file order (no plan is kept for it).

A prompt is the text the engine renders (holdback.sim_tokenizer.prompt_text: its chat template for chats and
Responses, the prompt for completions), cut into `BLOCK_CHARS`-character blocks; the first `MAX_BLOCKS` of them are hashed. Blocks
of characters, not tokens: the processor has no tokenizer of the served model in process (the gateway asks a
replica), and a shared run of characters is a shared run of tokens up to the block the two texts part in, which is
all the grouping needs. A plan is per batch, hence per tenant: one tenant's rows are never grouped with another's,
whose cache salt differs. It changes only which of a batch's pending rows `take_pending` queues next; how many,
and in which interleaving with other batches and tenants, stays the fair plan's (batch_processor.fairness).

Plans live in the processor holding the batch's lease and are rebuilt from the database's pending rows whenever
one is missing (a restart, a takeover) or used up while rows are still pending, so nothing about them needs to be
durable: a lost plan costs one read of the pending rows.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from holdback.models import RequestRow, RequestStatus
from holdback.sim_tokenizer import prompt_text

BLOCK_CHARS = 128  # about 30 tokens of English: two of vLLM's 16-token KV blocks
MAX_BLOCKS = 64  # 8,192 characters: rows alike this far are one group, however long they are
DIGEST = 8  # bytes of each block's hash
READ_CHUNK = 2000


def prefix_key(text: str) -> bytes:
    """The hashes of the text's leading blocks, packed: two keys start alike for as many blocks as the two texts
    start alike (the last, partial block counts only when equal in full). Python's own string hash, salted per
    process: keys are compared only with keys made by the same process, and the plan they give does not depend
    on the hash values (ties go by file position), so a plan rebuilt elsewhere is the same plan."""
    hashes = [hash(text[start:start + BLOCK_CHARS])
              for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS), BLOCK_CHARS)]
    return struct.pack(f"<{len(hashes)}q", *hashes)


def _shared_blocks(a: bytes, b: bytes) -> int:
    """How many leading blocks two keys share (binary search on slice equality: a few C-speed compares)."""
    lo, hi = 0, min(len(a), len(b)) // DIGEST
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * DIGEST] == b[:mid * DIGEST]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_order(keys: Iterable[tuple[str, bytes | None]]) -> list[str] | None:
    """Row ids in plan order, from (row id, prefix key or None) in file order; None when no two rows share a
    leading block (file order stands).

    Each row's depth is the most leading blocks it shares with any other row (in key order that other row is a
    neighbour); its group, the rows with the same depth and the same blocks that far. Groups run deepest first
    (ties: the group whose first row comes first in the file), each in file order; rows sharing nothing come
    last, in file order. So each document's questions run together, and a prompt shared by every row is held
    by all of them."""
    rows = list(keys)
    keyed = sorted((key, i) for i, (_, key) in enumerate(rows) if key)
    depth = [0] * len(rows)
    for (a, i), (b, j) in zip(keyed, keyed[1:]):
        shared = _shared_blocks(a, b)
        depth[i] = max(depth[i], shared)
        depth[j] = max(depth[j], shared)
    if not any(depth):
        return None
    groups: dict[bytes, list[int]] = {}
    loose: list[int] = []
    for i, (_, key) in enumerate(rows):
        if depth[i]:
            groups.setdefault(key[:depth[i] * DIGEST], []).append(i)
        else:
            loose.append(i)
    ordered = sorted(groups.values(), key=lambda members: (-depth[members[0]], members[0]))
    order = [i for members in ordered for i in members] + loose
    if order == list(range(len(rows))):
        return None
    return [rows[i][0] for i in order]


def _row_key(url: str, body: str) -> bytes | None:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    text = prompt_text(url, doc) if isinstance(doc, dict) else None
    return prefix_key(text) if text else None


class PrefixPlans:
    """The plans of the batches this processor hands out: per batch, its pending row ids in plan order (None: the
    batch keeps file order). `prepare` makes the missing ones, `take` hands out the next ids, `retain` forgets the
    batches no longer running."""

    def __init__(self) -> None:
        self._plans: dict[str, deque[str] | None] = {}

    def prepare(self, factory: sessionmaker[Session], batch_ids: Iterable[str]) -> None:
        """Plan the batches that have no plan yet, or whose plan is used up, from their pending rows: in a session
        of its own, before the refill's transaction, so no write waits while the rows are read and hashed."""
        missing = [b for b in batch_ids if b not in self._plans or self._plans[b] == deque()]
        if not missing:
            return
        with factory() as session:
            for batch_id in missing:
                self._plans[batch_id] = self._build(session, batch_id)

    def take(self, batch_id: str, n: int) -> list[str] | None:
        """The next `n` row ids of the batch's plan (some may have left `pending` since the plan was made: the
        caller's conditional move skips them), or None when the batch keeps file order (or was not prepared)."""
        plan = self._plans.get(batch_id)
        if not plan:
            return None
        return [plan.popleft() for _ in range(min(n, len(plan)))]

    def retain(self, batch_ids: Iterable[str]) -> None:
        keep = set(batch_ids)
        for batch_id in [b for b in self._plans if b not in keep]:
            del self._plans[batch_id]

    @staticmethod
    def _build(session: Session, batch_id: str) -> deque[str] | None:
        rows = session.execute(
            select(RequestRow.id, RequestRow.url, RequestRow.body)
            .where(RequestRow.batch_id == batch_id, RequestRow.status == RequestStatus.pending.value)
            .order_by(RequestRow.line)
            .execution_options(yield_per=READ_CHUNK)
        )
        order = plan_order((row_id, _row_key(url, body)) for row_id, url, body in rows)
        return deque(order) if order is not None else None
