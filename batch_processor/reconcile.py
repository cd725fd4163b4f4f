"""Reconciliation: the database is the source of truth; Redis is made to agree with it.

Run at start-up and every few seconds over the in_progress batches this processor holds. A row is
re-dispatched when, after a grace period, RQ holds no job for it (not in the queue, the
intermediate list, the started registry with a live heartbeat, or the scheduled registry):

- lost_queued:  `queued`, enqueued more than `grace` ago (Redis restarted without persistence,
                a FLUSHALL, or a processor died between its commit and its push);
- lost_retry:   `retry_wait` whose `next_attempt_at` passed more than `grace` ago (the worker died
                between parking the row and scheduling its job, or the scheduled job was lost);
- abandoned:    `running`, not touched for `running_grace`, and neither a started-registry entry
                nor a fresh job heartbeat: its worker died mid-request. The open attempt is closed
                as `abandoned` and the row is queued again.

Each move is a conditional UPDATE that re-checks the state the decision was made on, so a worker
that picked the job up meanwhile wins and nothing is dispatched twice by reconciliation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from holdback.logs import log_event
from holdback import lifecycle
from holdback.db import transaction
from holdback.models import Attempt, AttemptOutcome, RequestRow, RequestStatus

log = logging.getLogger("batch_processor.reconcile")

ID_CHUNK = 500


@dataclass
class Reconciled:
    lost_queued: list[tuple[str, str]] = field(default_factory=list)
    lost_retry: list[tuple[str, str]] = field(default_factory=list)
    abandoned: list[tuple[str, str]] = field(default_factory=list)

    @property
    def rows(self) -> list[tuple[str, str]]:
        """(row_id, batch_id) to dispatch again."""
        return self.lost_queued + self.lost_retry + self.abandoned

    def counts(self) -> dict[str, int]:
        return {"lost_queued": len(self.lost_queued), "lost_retry": len(self.lost_retry),
                "abandoned": len(self.abandoned)}


def reconcile(
    factory: sessionmaker[Session],
    batch_ids: list[str],
    live_ids: Callable[[], set[str]],
    heartbeating: Callable[[Iterable[str]], set[str]],
    *,
    grace: float,
    running_grace: float,
) -> Reconciled:
    """Find rows of these batches that nothing will run, requeue them in the DB, return them to push."""
    result = Reconciled()
    if not batch_ids:
        return result
    now = time.time()
    cutoff, run_cutoff = now - grace, now - running_grace
    queued_stale = and_(RequestRow.status == RequestStatus.queued.value,
                        or_(RequestRow.enqueued_at.is_(None), RequestRow.enqueued_at < cutoff))
    retry_stale = and_(RequestRow.status == RequestStatus.retry_wait.value,
                       or_(RequestRow.next_attempt_at.is_(None), RequestRow.next_attempt_at < cutoff))
    running_stale = and_(RequestRow.status == RequestStatus.running.value, RequestRow.updated_at < run_cutoff)

    candidates: list[tuple[str, str, str]] = []
    with factory() as session:
        for start in range(0, len(batch_ids), ID_CHUNK):
            chunk = batch_ids[start:start + ID_CHUNK]
            candidates += session.execute(
                select(RequestRow.id, RequestRow.batch_id, RequestRow.status)
                .where(RequestRow.batch_id.in_(chunk), or_(queued_stale, retry_stale, running_stale))
            ).all()
    if not candidates:
        return result
    # Read Redis only after the database: a job that finishes in between has changed its row's state,
    # which the conditional UPDATEs below notice.
    live = live_ids()
    missing = {status: [] for status in (RequestStatus.queued.value, RequestStatus.retry_wait.value,
                                         RequestStatus.running.value)}
    for row_id, _batch_id, status in candidates:
        if row_id not in live:
            missing[status].append(row_id)
    running = missing[RequestStatus.running.value]
    if running:
        beating = heartbeating(running)
        missing[RequestStatus.running.value] = [r for r in running if r not in beating]

    with transaction(factory) as session:
        result.lost_queued = _requeue(session, missing[RequestStatus.queued.value], RequestStatus.queued,
                                      queued_stale, now)
        result.lost_retry = _requeue(session, missing[RequestStatus.retry_wait.value], RequestStatus.retry_wait,
                                     retry_stale, now)
        result.abandoned = _requeue_abandoned(session, missing[RequestStatus.running.value], running_stale, now)
    if result.rows:
        log_event(log, "rows_reconciled", level=logging.WARNING, **result.counts(),
                  batch_ids=sorted({b for _, b in result.rows}))
    return result


def _requeue(session: Session, row_ids: list[str], source: RequestStatus, still_stale,
             now: float) -> list[tuple[str, str]]:
    moved: list[tuple[str, str]] = []
    for start in range(0, len(row_ids), ID_CHUNK):
        chunk = row_ids[start:start + ID_CHUNK]
        moved += [(row_id, batch_id) for row_id, batch_id, _ in
                  lifecycle.requeue_lost(session, chunk, source, still_stale, now)]
    return moved


def _requeue_abandoned(session: Session, row_ids: list[str], still_stale, now: float) -> list[tuple[str, str]]:
    moved: list[tuple[str, str]] = []
    closing: list[dict] = []
    for start in range(0, len(row_ids), ID_CHUNK):
        chunk = row_ids[start:start + ID_CHUNK]
        for row_id, batch_id, attempts in lifecycle.requeue_lost(session, chunk, RequestStatus.running,
                                                                 still_stale, now):
            moved.append((row_id, batch_id))
            closing.append({"rid": row_id, "num": attempts})
    if closing:
        session.connection().execute(
            update(Attempt.__table__)
            .where(Attempt.__table__.c.request_id == bindparam("rid"), Attempt.__table__.c.number == bindparam("num"),
                   Attempt.__table__.c.ended_at.is_(None))
            .values(ended_at=now, outcome=AttemptOutcome.abandoned.value,
                    error="worker lost: no live RQ job or heartbeat; requeued by the processor"),
            closing,
        )
    return moved
