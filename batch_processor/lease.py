"""Batch leases: which processor owns a batch's lifecycle work (expand, enqueue, cancel, expire,
finalize) and until when.

A claim is one compare-and-set UPDATE that only matches a batch nobody holds or whose lease has
expired, so it is safe across processes on SQLite and PostgreSQL alike. The holder renews every
round; a processor that dies stops renewing and its batches are taken over when the lease runs
out. Every batch-level transition the processor makes also requires `claimed_by = owner`, so a
processor that lost its lease cannot move the batch any more.
"""

from __future__ import annotations

import time

from sqlalchemy import or_, select, true, update
from sqlalchemy.orm import Session, sessionmaker

from holdback.db import transaction
from holdback.models import Batch, BatchStatus

# Statuses that still need a processor.
ACTIVE_STATUSES = (
    BatchStatus.validating.value,
    BatchStatus.in_progress.value,
    BatchStatus.finalizing.value,
    BatchStatus.cancelling.value,
)


class BatchLease:
    def __init__(self, factory: sessionmaker[Session], owner: str, ttl: float):
        self.factory = factory
        self.owner = owner
        self.ttl = ttl

    def _claimable(self, now: float):
        return or_(Batch.claimed_by.is_(None), Batch.lease_until < now, Batch.claimed_by == self.owner)

    def claim(self, limit: int) -> list[str]:
        """Claim up to `limit` active batches nobody holds, oldest first; returns the ids won."""
        now = time.time()
        with self.factory() as session:
            candidates = session.scalars(
                select(Batch.id)
                .where(Batch.status.in_(ACTIVE_STATUSES),
                       or_(Batch.claimed_by.is_(None), Batch.lease_until < now))
                .order_by(Batch.seq)
                .limit(limit)
            ).all()
        won = []
        for batch_id in candidates:
            # One short transaction per claim: a processor never holds locks on batches it did not win.
            with transaction(self.factory) as session:
                moved = session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id, Batch.status.in_(ACTIVE_STATUSES), self._claimable(now))
                    .values(claimed_by=self.owner, lease_until=now + self.ttl)
                    .execution_options(synchronize_session=False)
                ).rowcount
            if moved == 1:
                won.append(batch_id)
        return won

    def renew(self, batch_ids: set[str]) -> set[str]:
        """Extend the leases still held; returns the subset this processor still owns."""
        if not batch_ids:
            return set()
        now = time.time()
        ids = sorted(batch_ids)
        with transaction(self.factory) as session:
            session.execute(
                update(Batch)
                .where(Batch.id.in_(ids), Batch.claimed_by == self.owner, Batch.status.in_(ACTIVE_STATUSES))
                .values(lease_until=now + self.ttl)
                .execution_options(synchronize_session=False)
            )
            held = session.scalars(
                select(Batch.id).where(Batch.id.in_(ids), Batch.claimed_by == self.owner,
                                       Batch.status.in_(ACTIVE_STATUSES))
            ).all()
        return set(held)

    def release(self, batch_ids: set[str]) -> None:
        """Give the leases back (clean shutdown) so another processor takes over at once."""
        if not batch_ids:
            return
        with transaction(self.factory) as session:
            session.execute(
                update(Batch)
                .where(Batch.id.in_(sorted(batch_ids)), Batch.claimed_by == self.owner)
                .values(claimed_by=None, lease_until=None)
                .execution_options(synchronize_session=False)
            )


def held_by(owner: str | None):
    """WHERE clause for a batch-level transition: only while `owner` holds the lease (None: anyone,
    for tools such as benchmarks that drive one step without a processor loop)."""
    return true() if owner is None else Batch.claimed_by == owner
