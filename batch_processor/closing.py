"""Cancel and expiry: close a batch's unfinished rows, stop their jobs, keep the partial output.

The order is the database first (the source of truth), then Redis: rows are made final by
`holdback.results.close_unfinished`, each only while unfinished, so a worker's late success either
landed before and is kept, or loses the compare-and-set after. Rows are closed in chunks of
`CLOSE_CHUNK`, each its own transaction, and a call stops at its deadline: a 40,000-row cancel holds
the database's write lock (SQLite's one writer) for one chunk at a time, and the processor's round
goes on to other tenants' batches and continues the cancel next round. Then waiting jobs are removed,
a cancel event tells workers to abort the batch's in-flight requests, and once no row is left open,
finalization writes both files. Every step is safe to repeat, so a processor that dies half-way is
simply re-run by the next lease holder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.enqueue import IN_FLIGHT
from batch_processor.finalize import FinalizeResult, finalize_batch
from batch_processor.lease import held_by
from holdback.contract import CANCELLED_CODE, EXPIRED_CODE
from holdback.logs import log_event
from holdback.db import transaction
from holdback.models import REQUEST_TERMINAL_VALUES, Batch, BatchStatus, RequestRow, RequestStatus
from holdback.results import close_unfinished
from holdback.storage import FileStore

log = logging.getLogger("batch_processor.closing")

CANCELLED_MESSAGE = "The batch was cancelled before this request finished."
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


class BatchStopper(Protocol):
    def stop_batch(self, batch_id: str, row_ids: list[str]) -> None:
        """Remove these rows' waiting jobs and make in-flight requests of the batch abort."""


CLOSE_CHUNK = 2000  # rows made final per transaction


@dataclass(frozen=True)
class Closed:
    rows: int  # made final by this call
    dispatched: list[str]  # of those, the ids that may have a job
    done: bool  # no unfinished row is left


def close_rows(factory: sessionmaker[Session], batch_id: str, owner: str | None, from_statuses: tuple[BatchStatus, ...],
               status: RequestStatus, code: str, message: str, *, chunk: int = CLOSE_CHUNK,
               deadline: float | None = None, keepalive: Callable[[], None] | None = None) -> Closed | None:
    """Make the unfinished rows final, a chunk per transaction until none is left or `deadline` (monotonic)
    has passed, calling `keepalive` between chunks; None if the batch is not in `from_statuses` under this
    owner."""
    rows, dispatched = 0, []
    while True:
        with transaction(factory) as session:
            held = session.scalar(
                select(Batch.id).where(Batch.id == batch_id, Batch.status.in_([s.value for s in from_statuses]),
                                       held_by(owner))
            )
            if held is None:
                return None
            open_rows = session.execute(
                select(RequestRow.id, RequestRow.status)
                .where(RequestRow.batch_id == batch_id, RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
                .limit(chunk)
            ).all()
            if open_rows:
                rows += close_unfinished(session, batch_id, status, code, message, ids=[r.id for r in open_rows])
                dispatched += [r.id for r in open_rows if r.status in IN_FLIGHT]
        if len(open_rows) < chunk:
            return Closed(rows, dispatched, True)
        if deadline is not None and time.monotonic() >= deadline:
            return Closed(rows, dispatched, False)
        if keepalive is not None:
            keepalive()


def cancel_batch(factory: sessionmaker[Session], store: FileStore, stopper: BatchStopper, batch_id: str, *,
                 owner: str | None, keepalive: Callable[[], None] | None = None,
                 deadline: float | None = None) -> FinalizeResult | None:
    """cancelling -> cancelled, keeping what finished; a batch cancelled while validating has no rows
    and goes straight to cancelled with no files. None while rows are left open at `deadline` (call again)."""
    return _close_batch(factory, store, stopper, batch_id, owner=owner, keepalive=keepalive, deadline=deadline,
                        from_statuses=(BatchStatus.cancelling,), row_status=RequestStatus.cancelled,
                        code=CANCELLED_CODE, message=CANCELLED_MESSAGE, to_status=BatchStatus.cancelled,
                        event="batch_rows_cancelled")


def expire_batch(factory: sessionmaker[Session], store: FileStore, stopper: BatchStopper, batch_id: str, *,
                 owner: str | None, keepalive: Callable[[], None] | None = None,
                 deadline: float | None = None) -> FinalizeResult | None:
    """validating|in_progress -> expired at the end of the completion window, keeping what finished."""
    return _close_batch(factory, store, stopper, batch_id, owner=owner, keepalive=keepalive, deadline=deadline,
                        from_statuses=(BatchStatus.validating, BatchStatus.in_progress),
                        row_status=RequestStatus.expired, code=EXPIRED_CODE, message=EXPIRED_MESSAGE,
                        to_status=BatchStatus.expired, event="batch_rows_expired")


def _close_batch(factory: sessionmaker[Session], store: FileStore, stopper: BatchStopper, batch_id: str, *,
                 owner: str | None, keepalive: Callable[[], None] | None, deadline: float | None,
                 from_statuses: tuple[BatchStatus, ...], row_status: RequestStatus, code: str, message: str,
                 to_status: BatchStatus, event: str) -> FinalizeResult | None:
    """Close unfinished rows in the DB, stop their jobs and in-flight requests, then finalize with partial output."""
    closed = close_rows(factory, batch_id, owner, from_statuses, row_status, code, message, deadline=deadline,
                        keepalive=keepalive)
    if closed is None:
        return None
    stopper.stop_batch(batch_id, closed.dispatched)
    log_event(log, event, batch_id=batch_id, closed=closed.rows, jobs_removed=len(closed.dispatched),
              done=closed.done)
    if not closed.done:
        return None  # the rest next round
    return finalize_batch(factory, store, batch_id, to_status=to_status, from_statuses=from_statuses,
                          owner=owner, keepalive=keepalive)


def was_expiring(session: Session, batch_id: str) -> bool:
    """True if an expiry already closed rows of this batch (a processor died before finishing it)."""
    return session.scalar(
        select(RequestRow.id).where(RequestRow.batch_id == batch_id, RequestRow.status == RequestStatus.expired.value,
                                    RequestRow.error_code == EXPIRED_CODE).limit(1)
    ) is not None
