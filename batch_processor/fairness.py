"""Fair refill order: round-robin across tenants, then across each tenant's batches.

Each batch may have at most `window` rows in flight (queued + running + retry_wait). A round asks
every batch for its deficit and hands rows out in small chunks, one tenant at a time and within a
tenant one batch at a time, so jobs land in the shared queue interleaved: a 50,000-row batch holds
at most one window of the queue, and a small batch submitted after it is queued on the next round,
ahead of the big batch's refills. Pure policy, no I/O: `plan()` returns (batch_id, rows) steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchWindow:
    batch_id: str
    tenant_id: str
    in_flight: int


class RoundRobin:
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

    def plan(self, batches: list[BatchWindow]) -> list[tuple[str, int]]:
        """Steps (batch_id, n) in push order; `batches` in submission order (oldest first)."""
        tenants: list[str] = []
        by_tenant: dict[str, list[BatchWindow]] = {}
        for b in batches:
            if b.tenant_id not in by_tenant:
                tenants.append(b.tenant_id)
                by_tenant[b.tenant_id] = []
            by_tenant[b.tenant_id].append(b)
        deficit = {b.batch_id: max(0, self.window - b.in_flight) for b in batches}
        tenants = _rotate_after(tenants, self._last_tenant)
        queues = {t: _rotate_after([b.batch_id for b in by_tenant[t]], self._last_batch.get(t)) for t in tenants}

        steps: list[tuple[str, int]] = []
        first_tenant: str | None = None
        first_batch: dict[str, str] = {}
        while True:
            progressed = False
            for tenant in tenants:
                queue = queues[tenant]
                # Next batch of this tenant that still wants rows; it goes to the back of the tenant's line.
                for _ in range(len(queue)):
                    batch_id = queue.pop(0)
                    queue.append(batch_id)
                    if deficit[batch_id] > 0:
                        n = min(self.chunk, deficit[batch_id])
                        deficit[batch_id] -= n
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


def _rotate_after(items: list[str], last: str | None) -> list[str]:
    """`items` starting just after `last` (unchanged if `last` is absent)."""
    if last is None or last not in items:
        return list(items)
    i = items.index(last) + 1
    return items[i:] + items[:i]
