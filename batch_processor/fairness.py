"""Fair refill order: an equal window per tenant, round-robin across tenants, then across a tenant's batches.

Each tenant may have at most `window` rows in flight (queued + running + retry_wait) over all its batches,
so splitting work into more batches buys no more throughput. A round hands every tenant's deficit out in
small chunks, one tenant at a time and within a tenant one batch at a time, so jobs land in the shared
FIFO queue interleaved and each tenant's share of the queue, hence of the workers, is the same.

The window shrinks with the number of tenants so that all of them together keep about `rounds` times the
dispatch capacity (the workers' total concurrency) in flight: one round running, the rest queued. A new
tenant's first rows then wait behind about one round of work, not behind every other tenant's full window;
and the first chunk of a tenant that had nothing in flight goes to the front of the queue (`jump_ahead`),
so it waits only for a free worker. Pure policy, no I/O: `plan()` returns (batch_id, rows) steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUEUE_ROUNDS = 2.0  # default: in flight over all tenants ≈ this many times the dispatch capacity


@dataclass(frozen=True)
class BatchWindow:
    batch_id: str
    tenant_id: str
    in_flight: int
    pending: int | None = None  # rows still to hand out; None: as many as asked for


def tenant_window(cap: int, tenants: int, capacity: int | None, rounds: float = QUEUE_ROUNDS,
                  floor: int = 16) -> int:
    """Each tenant's window: `cap`, shrunk so `tenants` windows together hold about `rounds` × `capacity`
    rows, but never below `floor` (one refill chunk). Unknown capacity or `rounds` <= 0: `cap`."""
    if not capacity or rounds <= 0 or tenants < 1:
        return cap
    return min(cap, max(floor, math.ceil(rounds * capacity / tenants)))


class RefillRoundRobin:
    """Remembers who went first, so the head of the queue rotates between tenants and batches."""

    def __init__(self, window: int, chunk: int = 16):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.window = window
        self.chunk = chunk
        self._last_tenant: str | None = None
        self._last_batch: dict[str, str] = {}

    def plan(self, batches: list[BatchWindow], window: int | None = None,
             elsewhere: dict[str, int] | None = None) -> list[tuple[str, int]]:
        """Steps (batch_id, n) in push order; `batches` in submission order (oldest first); `window` is
        each tenant's (default: the one this was built with); `elsewhere` counts a tenant's rows in flight
        in batches other processors hold, which share its window."""
        window = self.window if window is None else window
        elsewhere = elsewhere or {}
        tenants: list[str] = []
        by_tenant: dict[str, list[BatchWindow]] = {}
        for b in batches:
            if b.tenant_id not in by_tenant:
                tenants.append(b.tenant_id)
                by_tenant[b.tenant_id] = []
            by_tenant[b.tenant_id].append(b)
        deficit = {t: max(0, window - elsewhere.get(t, 0) - sum(b.in_flight for b in by_tenant[t])) for t in tenants}
        left = {b.batch_id: b.pending if b.pending is not None else window for b in batches}
        tenants = _rotate_after(tenants, self._last_tenant)
        queues = {t: _rotate_after([b.batch_id for b in by_tenant[t]], self._last_batch.get(t)) for t in tenants}

        steps: list[tuple[str, int]] = []
        first_tenant: str | None = None
        first_batch: dict[str, str] = {}
        while True:
            progressed = False
            for tenant in tenants:
                if deficit[tenant] <= 0:
                    continue
                queue = queues[tenant]
                # Next batch of this tenant that has rows left; it goes to the back of the tenant's line.
                for _ in range(len(queue)):
                    batch_id = queue.pop(0)
                    queue.append(batch_id)
                    if left[batch_id] > 0:
                        n = min(self.chunk, deficit[tenant], left[batch_id])
                        deficit[tenant] -= n
                        left[batch_id] -= n
                        steps.append((batch_id, n))
                        first_tenant = first_tenant or tenant
                        first_batch.setdefault(tenant, batch_id)
                        progressed = True
                        break
            if not progressed:
                break
        if first_tenant is not None:
            self._last_tenant = first_tenant
            self._last_batch.update(first_batch)
        return steps


def jump_ahead(jobs: list[tuple[str, str]], tenant_of: dict[str, str], idle_tenants: set[str],
               n: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split (row_id, batch_id) jobs into (front, back): the first `n` of each tenant that had nothing in
    flight go to the front of the queue. Such a tenant holds no share of the queue yet, so putting one chunk
    ahead of the others' backlog takes nothing from them that their windows promised."""
    front: list[tuple[str, str]] = []
    back: list[tuple[str, str]] = []
    taken: dict[str, int] = {}
    for job in jobs:
        tenant = tenant_of.get(job[1])
        if tenant in idle_tenants and taken.get(tenant, 0) < n:
            taken[tenant] = taken.get(tenant, 0) + 1
            front.append(job)
        else:
            back.append(job)
    return front, back


def _rotate_after(items: list[str], last: str | None) -> list[str]:
    """`items` starting just after `last` (unchanged if `last` is absent)."""
    if last is None or last not in items:
        return list(items)
    i = items.index(last) + 1
    return items[i:] + items[:i]
