"""Window refill: move a batch's next pending rows to `queued`, in the fair order of `fairness`.

The move is a conditional UPDATE (`status = 'pending'`) committed before anything is pushed, so a
row is handed to dispatch once per transition even if two processors raced for it; if the push
itself is lost (crash, Redis down), reconciliation finds the row `queued` without a job.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.lease import held_by
from batch_processor.prefix_plan import PrefixPlans
from holdback import lifecycle
from holdback.db import transaction
from holdback.models import Batch, BatchStatus, RequestRow, RequestStatus

IN_FLIGHT = (RequestStatus.queued.value, RequestStatus.running.value, RequestStatus.retry_wait.value)
PENDING = RequestStatus.pending.value
ID_CHUNK = 500


@dataclass(frozen=True)
class WindowCount:
    in_flight: int = 0  # queued, running or waiting to retry
    pending: int = 0  # not handed out yet


def window_counts(session: Session, batch_ids: list[str]) -> dict[str, WindowCount]:
    """Rows in flight and rows still pending, per batch (zeros for a batch with none); one query per chunk."""
    counts: dict[str, dict[str, int]] = {b: {} for b in batch_ids}
    for start in range(0, len(batch_ids), ID_CHUNK):
        chunk = batch_ids[start:start + ID_CHUNK]
        for batch_id, status, n in session.execute(
            select(RequestRow.batch_id, RequestRow.status, func.count())
            .where(RequestRow.batch_id.in_(chunk), RequestRow.status.in_((PENDING, *IN_FLIGHT)))
            .group_by(RequestRow.batch_id, RequestRow.status)
        ):
            counts[batch_id][status] = n
    return {b: WindowCount(sum(by.get(s, 0) for s in IN_FLIGHT), by.get(PENDING, 0)) for b, by in counts.items()}


def in_flight_elsewhere(session: Session, tenant_ids: set[str], own: set[str]) -> dict[str, int]:
    """Rows in flight per tenant in in_progress batches outside `own` (held by other processors)."""
    if not tenant_ids:
        return {}
    others = session.execute(
        select(Batch.id, Batch.tenant_id)
        .where(Batch.tenant_id.in_(sorted(tenant_ids)), Batch.status == BatchStatus.in_progress.value)
    ).all()
    others = [(batch_id, tenant_id) for batch_id, tenant_id in others if batch_id not in own]
    counts = window_counts(session, [batch_id for batch_id, _ in others])
    out: dict[str, int] = defaultdict(int)
    for batch_id, tenant_id in others:
        out[tenant_id] += counts[batch_id].in_flight
    return dict(out)


def take_pending(factory: sessionmaker[Session], steps: list[tuple[str, int]],
                 owner: str | None, plans: PrefixPlans | None = None) -> list[tuple[str, str]]:
    """Queue the rows the plan asks for; returns (row_id, batch_id) in the plan's interleaved order. Within a
    batch, the rows come in its prefix plan's order (`plans`, batch_processor.prefix_plan), else in line order."""
    wanted: dict[str, int] = defaultdict(int)
    for batch_id, n in steps:
        wanted[batch_id] += n
    if not wanted:
        return []
    if plans is not None:
        plans.prepare(factory, wanted)
    taken: dict[str, deque[str]] = {}
    now = time.time()
    with transaction(factory) as session:
        open_batches = set(session.scalars(
            select(Batch.id).where(Batch.id.in_(list(wanted)), Batch.status == BatchStatus.in_progress.value,
                                   held_by(owner))
        ))
        for batch_id, n in wanted.items():
            if batch_id not in open_batches:
                continue
            ids = plans.take(batch_id, n) if plans is not None else None
            if ids is None:
                ids = session.scalars(
                    select(RequestRow.id)
                    .where(RequestRow.batch_id == batch_id, RequestRow.status == RequestStatus.pending.value)
                    .order_by(RequestRow.line)
                    .limit(n)
                ).all()
            if not ids:
                continue
            moved = lifecycle.enqueue(session, ids, now)
            taken[batch_id] = deque(row_id for row_id in ids if row_id in moved)  # keep the order taken
    ordered: list[tuple[str, str]] = []
    for batch_id, n in steps:
        rows = taken.get(batch_id)
        while rows and n > 0:
            ordered.append((rows.popleft(), batch_id))
            n -= 1
    return ordered


def take_due_retries(factory: sessionmaker[Session], batch_ids: list[str], owner: str | None,
                     limit: int) -> list[tuple[str, str]]:
    """Sync dispatch: rows whose retry time has come go back to `queued`; returns (row_id, batch_id)."""
    if not batch_ids or limit <= 0:
        return []
    now = time.time()
    with transaction(factory) as session:
        open_batches = list(session.scalars(
            select(Batch.id).where(Batch.id.in_(batch_ids), Batch.status == BatchStatus.in_progress.value,
                                   held_by(owner))
        ))
        if not open_batches:
            return []
        ids = session.scalars(
            select(RequestRow.id)
            .where(RequestRow.batch_id.in_(open_batches), RequestRow.status == RequestStatus.retry_wait.value,
                   RequestRow.next_attempt_at <= now)
            .order_by(RequestRow.next_attempt_at)
            .limit(limit)
        ).all()
        if not ids:
            return []
        return lifecycle.requeue_due(session, ids, now)
