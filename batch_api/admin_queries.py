"""The operator API's reads from the database, over every tenant: a batch by id, tenant names, one page of a
batch's request rows with each row's first attempt, a row's attempts, and rows' statuses by id (what
retry-failed asks before it requeues a job). The admin routes and the dashboard share them."""

from __future__ import annotations

from typing import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batch_api.errors import NotFound
from batch_api.schemas import batch_to_api
from holdback.models import REQUEST_TERMINAL_VALUES, Attempt, Batch, RequestRow, Tenant

ID_CHUNK = 500


def admin_batch(batch: Batch) -> dict:
    return {**batch_to_api(batch), "tenant_id": batch.tenant_id}


def any_batch(session: Session, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None:
        raise NotFound(f"No batch with id '{batch_id}'. GET /admin/batches lists every tenant's batches.",
                       param="batch_id")
    return batch


def tenant_names(session: Session, tenant_ids: Iterable[str]) -> dict[str, str]:
    ids = list(set(tenant_ids))
    return dict(session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).all()) if ids else {}


def request_page(
    session: Session, batch_id: str, *, limit: int, after: str | None = None, status: str | None = None,
    evicted: bool | None = None, unfinished: bool | None = None,
) -> tuple[list[dict], bool]:
    """One page of the batch's rows in line order, each with the start of its first attempt."""
    query = select(RequestRow).where(RequestRow.batch_id == batch_id)
    if after is not None:
        line = session.scalar(select(RequestRow.line).where(RequestRow.batch_id == batch_id, RequestRow.id == after))
        if line is None:
            raise NotFound(f"No request row '{after}' in batch '{batch_id}'; pass the last_id of the previous "
                           "page as after.", param="after")
        query = query.where(RequestRow.line > line)
    if status is not None:
        query = query.where(RequestRow.status == status)
    if evicted is not None:
        query = query.where(RequestRow.evictions > 0 if evicted else RequestRow.evictions == 0)
    if unfinished is not None:
        terminal = RequestRow.status.in_(REQUEST_TERMINAL_VALUES)
        query = query.where(~terminal if unfinished else terminal)
    page = query.order_by(RequestRow.line).limit(limit + 1).subquery()
    # min(started_at) grouped over the attempts of this page's rows only (attempts are indexed by request_id).
    first_attempt = (
        select(Attempt.request_id, func.min(Attempt.started_at).label("first_attempt_at"))
        .where(Attempt.request_id.in_(select(page.c.id)))
        .group_by(Attempt.request_id)
        .subquery()
    )
    found = session.execute(
        select(page, first_attempt.c.first_attempt_at)
        .outerjoin(first_attempt, first_attempt.c.request_id == page.c.id)
        .order_by(page.c.line)
    ).mappings().all()
    rows = [_row_to_api(r) for r in found]
    return rows[:limit], len(rows) > limit


def _row_to_api(r) -> dict:  # noqa: ANN001 - a result mapping
    return {
        "id": r["id"], "custom_id": r["custom_id"], "line": r["line"], "status": r["status"],
        "attempts": r["attempts"] or 0, "evictions": r["evictions"] or 0, "duplicates": r["duplicates"] or 0,
        "transient_failures": r["transient_failures"] or 0, "created_at": r["created_at"],
        "enqueued_at": r["enqueued_at"], "first_attempt_at": r["first_attempt_at"], "finished_at": r["finished_at"],
        "input_tokens": r["input_tokens"] or 0, "output_tokens": r["output_tokens"] or 0,
        "response_status": r["response_status"], "error_code": r["error_code"],
    }


def attempts_of(session: Session, row_id: str) -> list[dict]:
    return [
        {
            "number": a.number, "worker": a.worker, "replica": a.replica, "started_at": a.started_at,
            "ended_at": a.ended_at, "outcome": a.outcome, "status_code": a.status_code,
            "drop_reason": a.drop_reason, "evicted": bool(a.evicted), "input_tokens": a.input_tokens or 0,
            "output_tokens": a.output_tokens or 0, "error": a.error, "cached_tokens": a.cached_tokens or 0,
            "tokens_kept": a.tokens_kept or 0, "tokens_recomputed": a.tokens_recomputed or 0,
        }
        for a in session.scalars(select(Attempt).where(Attempt.request_id == row_id).order_by(Attempt.number))
    ]


def row_statuses(session: Session, row_ids: list[str]) -> dict[str, str]:
    """Row id -> status for the rows among these ids that exist."""
    statuses: dict[str, str] = {}
    for start in range(0, len(row_ids), ID_CHUNK):
        chunk = row_ids[start:start + ID_CHUNK]
        statuses.update(session.execute(select(RequestRow.id, RequestRow.status).where(RequestRow.id.in_(chunk))).all())
    return statuses
