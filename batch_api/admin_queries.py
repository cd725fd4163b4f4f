"""The operator API's reads from the database, over every tenant: a batch by id, a search over batches,
tenant names, one page of a batch's request rows with each row's first attempt and error message, a row's
attempts, rows' statuses by id (what retry-failed asks before it requeues a job), and each tenant's usage
over a period. The admin routes and the dashboard share them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable

from sqlalchemy import Text, and_, case, cast, func, or_, select
from sqlalchemy.orm import Session

from batch_api.errors import NotFound
from batch_api.schemas import batch_to_api
from holdback.models import (
    REQUEST_TERMINAL_VALUES, Attempt, AttemptOutcome, Batch, RequestRow, RequestStatus, Tenant,
)

ID_CHUNK = 500
# An error body longer than this is not read for its message (the drawer still shows it whole).
ERROR_BODY_CHARS = 8192


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


def all_tenants(session: Session) -> list[tuple[str, str]]:
    """(id, name) of every tenant, by name."""
    return [(i, n) for i, n in session.execute(select(Tenant.id, Tenant.name).order_by(Tenant.name)).all()]


def search_batches(
    session: Session, *, limit: int, after: str | None = None, status: str | None = None,
    tenant_id: str | None = None, text: str | None = None,
) -> tuple[list[Batch], bool]:
    """Every tenant's batches, newest first, narrowed by status, tenant and a search text: a batch id (or its
    start), a file id of the batch, a custom_id of one of its lines (exact), or text in its metadata
    (`key=value` matches one entry; anything else, any key or value containing it, ignoring case)."""
    query = select(Batch)
    if status is not None:
        query = query.where(Batch.status == status)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    if text:
        query = query.where(_matching(text))
    if after is not None:
        cursor = session.get(Batch, after)
        if cursor is None:
            raise NotFound(f"No batch with id '{after}'; pass the last_id of the previous page as after.",
                           param="after")
        query = query.where(or_(Batch.seq < cursor.seq, and_(Batch.seq == cursor.seq, Batch.id < cursor.id)))
    rows = list(session.scalars(query.order_by(Batch.seq.desc(), Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def _matching(text: str):  # noqa: ANN202 - a SQL condition
    by_custom_id = select(RequestRow.batch_id).where(RequestRow.custom_id == text)
    ids = or_(Batch.id == text, Batch.id.like(_like_escape(text) + "%", escape="\\"), Batch.input_file_id == text,
              Batch.output_file_id == text, Batch.error_file_id == text, Batch.id.in_(by_custom_id))
    # Metadata is stored as the JSON text SQLAlchemy writes (json.dumps: `{"k": "v"}`, non-ASCII escaped).
    stored = func.lower(cast(Batch.metadata_, Text))
    key, sep, value = text.partition("=")
    if sep and key.strip():
        pair = json.dumps({key.strip(): value.strip()}).lower()[1:-2]  # `"k": "v` (a value that starts so)
        return or_(ids, stored.like("%" + _like_escape(pair) + "%", escape="\\"))
    needles = {text.lower(), json.dumps(text.lower())[1:-1]}
    return or_(ids, *(stored.like("%" + _like_escape(n) + "%", escape="\\") for n in needles))


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


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
    error_body = case((and_(page.c.status != RequestStatus.succeeded.value,
                            func.length(page.c.response_body) <= ERROR_BODY_CHARS), page.c.response_body))
    found = session.execute(
        select(page, first_attempt.c.first_attempt_at, error_body.label("error_body"))
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
        "error_message": error_message(r["error_message"], r["error_body"]),
    }


def error_message(own: str | None, body: str | None) -> str | None:
    """Why a row failed, in one line: the replica's own error message when its body has one (OpenAI's and
    vLLM's envelopes: `{"error": {"message"}}`, `{"message"}`), else ours (a cancel, a spent budget)."""
    if body:
        try:
            doc = json.loads(body)
        except ValueError:
            return body.strip()[:500] or own
        error = doc.get("error", doc) if isinstance(doc, dict) else None
        message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        if isinstance(message, str) and message.strip():
            return message.strip()
    return own


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


# ---- usage -----------------------------------------------------------------------------------------------------


@dataclass
class TenantUsage:
    """One tenant's figures over a period: batches created, requests finished by outcome and their tokens,
    attempts rejected (429 other than an eviction) and evicted, and the requests running now."""

    tenant_id: str
    tenant: str
    batches: int = 0
    succeeded: int = 0
    failed: int = 0  # failed or expired; cancelled apart
    cancelled: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    rejections: int = 0
    evictions: int = 0
    in_flight: int = 0
    in_flight_share: float = 0.0

    def to_api(self) -> dict:
        return {"object": "tenant.usage", **asdict(self)}


_OUTCOME_OF = {RequestStatus.succeeded.value: "succeeded", RequestStatus.failed.value: "failed",
               RequestStatus.expired.value: "failed", RequestStatus.cancelled.value: "cancelled"}


def tenant_usage(session: Session, since: float, until: float) -> list[TenantUsage]:
    """Every tenant with activity in [since, until), most tokens first.

    A request counts when it finished in the period, an attempt when it started in it, a batch when it was
    created in it. Rows and attempts are read only from batches that had not ended before `since` (a row
    ends before its batch does), so a period's query does not walk all history."""
    ended = func.coalesce(Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at)
    live = select(Batch.id).where(Batch.created_at < until, or_(ended.is_(None), ended >= int(since) - 1))
    usage: dict[str, TenantUsage] = {}

    def of(tenant_id: str) -> TenantUsage:
        return usage.setdefault(tenant_id, TenantUsage(tenant_id, tenant_id))

    for tenant_id, n in session.execute(
        select(Batch.tenant_id, func.count()).where(Batch.created_at >= since, Batch.created_at < until)
        .group_by(Batch.tenant_id)
    ):
        of(tenant_id).batches = int(n)
    for tenant_id, status, n, tokens_in, tokens_out in session.execute(
        select(RequestRow.tenant_id, RequestRow.status, func.count(), func.sum(RequestRow.input_tokens),
               func.sum(RequestRow.output_tokens))
        .where(RequestRow.batch_id.in_(live), RequestRow.finished_at >= since, RequestRow.finished_at < until)
        .group_by(RequestRow.tenant_id, RequestRow.status)
    ):
        u = of(tenant_id)
        name = _OUTCOME_OF.get(status)
        if name is not None:
            setattr(u, name, getattr(u, name) + int(n))
        u.input_tokens += int(tokens_in or 0)
        u.output_tokens += int(tokens_out or 0)
    rejected = func.sum(case((Attempt.outcome == AttemptOutcome.rejected.value, 1), else_=0))
    evicted = func.sum(case((Attempt.evicted.is_(True), 1), else_=0))
    for tenant_id, rejections, evictions in session.execute(
        select(Batch.tenant_id, rejected, evicted).join(Batch, Batch.id == Attempt.batch_id)
        .where(Attempt.batch_id.in_(live), Attempt.started_at >= since, Attempt.started_at < until)
        .group_by(Batch.tenant_id)
    ):
        if rejections or evictions:
            u = of(tenant_id)
            u.rejections, u.evictions = int(rejections or 0), int(evictions or 0)
    running = dict(session.execute(
        select(RequestRow.tenant_id, func.count()).where(RequestRow.status == RequestStatus.running.value)
        .group_by(RequestRow.tenant_id)
    ).all())
    everyone = sum(running.values())
    for tenant_id, n in running.items():
        u = of(tenant_id)
        u.in_flight, u.in_flight_share = int(n), n / everyone
    for tenant_id, name in tenant_names(session, usage).items():
        usage[tenant_id].tenant = name
    return sorted(usage.values(), key=lambda u: (-(u.input_tokens + u.output_tokens), u.tenant))
