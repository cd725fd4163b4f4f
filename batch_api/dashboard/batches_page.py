"""The dashboard's Batches page (its home): every batch with its progress, filtered and searched; a batch's own page
with its summary, pace and requests; a request's attempts and result; cancelling a batch and downloading its files,
which reuse the operator API's functions (`batch_api.admin`, `admin_queries`); and the charts' fragment, which the
Batches and Gateway pages poll.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import HTMLResponse, Response
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from batch_api import admin, admin_queries
from batch_api.auth import ContextDep, SessionDep
from batch_api.dashboard.history import BATCHES_CHARTS, GATEWAY_CHARTS, chart_panels
from batch_api.dashboard.outcomes import Outcomes, shown_status
from batch_api.dashboard.rendering import flash, render
from batch_api.dashboard.session import CheckedPost, SessionCookie
from batch_api.errors import ApiError
from holdback import lifecycle
from holdback.models import BATCH_TERMINAL, Batch, BatchStatus, RequestRow, RequestStatus

router = APIRouter(include_in_schema=False)

BATCHES_PER_PAGE = 50
REQUESTS_PER_PAGE = 50
SEARCH_CHARS = 512
BODY_CHARS = 64 * 1024  # of a result body in the drawer; the download has it all
RATE_WINDOW = 60.0  # a batch's throughput and ETA are measured over its last minute
CANCELLABLE = {s.value for s in lifecycle.BATCH_REQUEST_CANCEL.sources}
TERMINAL_BATCH = {s.value for s in BATCH_TERMINAL}


def _batch_rows(session: Session, filters: dict) -> tuple[list[dict], bool]:
    search = dict(limit=BATCHES_PER_PAGE, status=filters["status"], tenant_id=filters["tenant"],
                  text=filters["q"])
    try:
        found, has_more = admin_queries.search_batches(session, after=filters["after"], **search)
    except ApiError:  # the cursor's batch is gone: start again from the newest
        found, has_more = admin_queries.search_batches(session, **search)
    names = admin_queries.tenant_names(session, (b.tenant_id for b in found))
    return [_batch_view(b, names.get(b.tenant_id, b.tenant_id)) for b in found], has_more


def _batch_view(batch: Batch, tenant: str) -> dict:
    counts = Outcomes.of(batch)
    return {
        "batch": batch, "tenant": tenant, "total": counts.total, "completed": counts.succeeded,
        "failed": counts.failed, "cancelled": counts.cancelled, "finished": counts.finished,
        "done_share": counts.share(counts.succeeded), "failed_share": counts.share(counts.failed),
        "cancelled_share": counts.share(counts.cancelled), "shown": shown_status(batch.status, counts),
        "cancellable": batch.status in CANCELLABLE, "terminal": batch.status in TERMINAL_BATCH,
        "ended_at": batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at,
        "first_error": _first_error(batch),
    }


def _first_error(batch: Batch) -> str | None:
    """A failed batch's first error (`line N: message`), shown on its row: why it failed, without opening it."""
    errors = batch.errors.get("data") if isinstance(batch.errors, dict) else batch.errors
    if batch.status != BatchStatus.failed.value or not errors or not isinstance(errors[0], dict):
        return None
    first = errors[0]
    where = f"line {first['line']}: " if first.get("line") else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}{first.get('message') or first.get('code') or ''}{more}"


def _batch_filters(db: Session, status: str | None, tenant: str | None, q: str | None, after: str | None) -> dict:
    tenants = admin_queries.all_tenants(db)
    return {"status": _status_filter(status, BatchStatus),
            "tenant": tenant if tenant in {i for i, _ in tenants} else None,
            "q": (q or "").strip()[:SEARCH_CHARS] or None, "after": after or None, "tenants": tenants}


def _status_filter(value: str | None, allowed: type) -> str | None:
    return value if value in {s.value for s in allowed} else None


@router.get("")
def batches_page(request: Request, session: SessionCookie, db: SessionDep, status: str | None = None,
                 tenant: str | None = None, q: str | None = None, after: str | None = None,
                 range: str | None = None) -> HTMLResponse:  # noqa: A002 - the charts' query parameter
    filters = _batch_filters(db, status, tenant, q, after)
    rows, has_more = _batch_rows(db, filters)
    return render(request, "batches.html", session, page="batches", rows=rows, has_more=has_more, filters=filters,
                  statuses=[s.value for s in BatchStatus], charts=chart_panels(request, range, BATCHES_CHARTS))


@router.get("/fragments/batches")
def batches_fragment(request: Request, session: SessionCookie, db: SessionDep, status: str | None = None,
                     tenant: str | None = None, q: str | None = None, after: str | None = None) -> HTMLResponse:
    filters = _batch_filters(db, status, tenant, q, after)
    rows, has_more = _batch_rows(db, filters)
    return render(request, "_batches_table.html", session, rows=rows, has_more=has_more, filters=filters)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str, _session: CheckedPost, db: SessionDep, context: ContextDep,
                 background: BackgroundTasks) -> HTMLResponse:
    try:
        before = admin_queries.any_batch(db, batch_id).status
        after = admin.cancel_any_batch(batch_id, db, context, background)["status"]
    except ApiError as exc:
        return flash(request, exc.message, ok=False, status_code=exc.status)
    if before in CANCELLABLE:
        message = (f"Cancelled batch {batch_id} (was {before}, now {after}): no new requests start, requests in "
                   "flight are aborted, and finished results are kept in its output and error files.")
    else:
        message = f"Batch {batch_id} was already {before}; nothing changed."
    return flash(request, message)


@router.get("/batches/{batch_id}")
def batch_page(request: Request, batch_id: str, session: SessionCookie, db: SessionDep,
               status: str | None = None, evicted: str | None = None, after: str | None = None) -> HTMLResponse:
    batch = db.get(Batch, batch_id)
    if batch is None:
        return render(request, "not_found.html", session, page="batches", status_code=404,
                      message=f"No batch with id '{batch_id}'.")
    filters = _request_filters(status, evicted, after)
    return render(request, "batch.html", session, page="batches", **_batch_summary(db, batch),
                  **_request_table(db, batch.id, filters), statuses=[s.value for s in RequestStatus])


@router.get("/fragments/batches/{batch_id}/summary")
def batch_summary_fragment(request: Request, batch_id: str, session: SessionCookie, db: SessionDep) -> HTMLResponse:
    batch = db.get(Batch, batch_id)
    if batch is None:
        return render(request, "_gone.html", session, message=f"Batch '{batch_id}' no longer exists.")
    return render(request, "_batch_summary.html", session, **_batch_summary(db, batch))


@router.get("/fragments/batches/{batch_id}/requests")
def batch_requests_fragment(request: Request, batch_id: str, session: SessionCookie, db: SessionDep,
                            status: str | None = None, evicted: str | None = None,
                            after: str | None = None) -> HTMLResponse:
    batch = db.get(Batch, batch_id)
    if batch is None:
        return render(request, "_gone.html", session, message=f"Batch '{batch_id}' no longer exists.")
    return render(request, "_requests_table.html", session, batch=batch,
                  **_request_table(db, batch.id, _request_filters(status, evicted, after)))


@router.get("/fragments/requests/{row_id}/attempts")
def attempts_fragment(request: Request, row_id: str, session: SessionCookie, db: SessionDep) -> HTMLResponse:
    row = db.get(RequestRow, row_id)
    if row is None:
        return render(request, "_gone.html", session, message=f"Request '{row_id}' no longer exists.")
    return render(request, "_attempts.html", session, row=row, attempts=admin_queries.attempts_of(db, row.id),
                  result=_result(row))


def _result(row: RequestRow) -> dict | None:
    """A final row's answer as the drawer shows it: the replica's status and body (pretty when JSON), and the
    error message the table shows."""
    if row.response_status is None and row.error_message is None:
        return None
    body = row.response_body or ""
    try:
        pretty = json.dumps(json.loads(body), indent=2, ensure_ascii=False) if body else ""
    except ValueError:
        pretty = body
    shown = pretty[:BODY_CHARS]
    return {"status": row.response_status, "ok": row.status == RequestStatus.succeeded.value,
            "message": None if row.status == RequestStatus.succeeded.value
            else admin_queries.error_message(row.error_message, body),
            "code": row.error_code, "body": shown, "cut": len(pretty) - len(shown)}


def _batch_summary(db: Session, batch: Batch) -> dict:
    names = admin_queries.tenant_names(db, [batch.tenant_id])
    now = time.time()
    recent = func.sum(case((RequestRow.finished_at >= now - RATE_WINDOW, 1), else_=0))
    by_status = {
        status: {"rows": rows, "evictions": int(evictions or 0), "attempts": int(attempts or 0),
                 "recent": int(finished or 0)}
        for status, rows, evictions, attempts, finished in db.execute(
            select(RequestRow.status, func.count(), func.sum(RequestRow.evictions), func.sum(RequestRow.attempts),
                   recent)
            .where(RequestRow.batch_id == batch.id).group_by(RequestRow.status)
        )
    }
    order = [s.value for s in RequestStatus]
    view = _batch_view(batch, names.get(batch.tenant_id, batch.tenant_id))
    return {
        "view": view,
        "api": admin_queries.admin_batch(batch),
        "row_counts": [(s, by_status[s]["rows"]) for s in order if s in by_status],
        "evictions": sum(v["evictions"] for v in by_status.values()),
        "attempts": sum(v["attempts"] for v in by_status.values()),
        "errors": list((admin_queries.admin_batch(batch)["errors"] or {}).get("data") or []),
        "pace": _pace(batch, view, sum(v["recent"] for v in by_status.values()), now),
    }


def _pace(batch: Batch, view: dict, recent: int, now: float) -> dict:
    """Requests finished per second over the last RATE_WINDOW (and since the batch started), and when the
    rest will be done at the recent rate; None where there is nothing to measure."""
    started = batch.in_progress_at
    end = view["ended_at"] or now  # an ended batch's pace is over the time it ran, not until now
    overall = view["finished"] / (end - started) if started and view["finished"] and end > started else None
    window = min(RATE_WINDOW, now - started) if started else RATE_WINDOW
    rate = recent / window if recent and window > 0 else None
    left = view["total"] - view["finished"]
    running = batch.status in (BatchStatus.in_progress.value, BatchStatus.finalizing.value)
    return {"rate": rate, "overall": overall, "left": left, "window": RATE_WINDOW,
            "eta": left / rate if running and rate and left > 0 else None,
            "stalled": running and left > 0 and not rate}


def _request_filters(status: str | None, evicted: str | None, after: str | None) -> dict:
    return {"status": _status_filter(status, RequestStatus), "evicted": evicted if evicted in ("yes", "no") else None,
            "after": after or None}


def _request_table(db: Session, batch_id: str, filters: dict) -> dict:
    evicted = {"yes": True, "no": False}.get(filters["evicted"] or "")
    try:
        rows, has_more = admin_queries.request_page(db, batch_id, limit=REQUESTS_PER_PAGE, after=filters["after"],
                                            status=filters["status"], evicted=evicted)
    except ApiError:
        filters = {**filters, "after": None}
        rows, has_more = admin_queries.request_page(db, batch_id, limit=REQUESTS_PER_PAGE, status=filters["status"],
                                            evicted=evicted)
    return {"requests": rows, "requests_more": has_more, "filters": filters}


@router.get("/files/{file_id}/content")
def download(file_id: str, _session: SessionCookie, context: ContextDep, db: SessionDep) -> Response:
    return admin.download_any_file(file_id, context, db)


@router.get("/fragments/charts")
def charts_fragment(request: Request, session: SessionCookie, range: str | None = None,  # noqa: A002
                    show: str | None = None) -> HTMLResponse:
    which = GATEWAY_CHARTS if show == "gateway" else BATCHES_CHARTS
    return render(request, "_charts.html", session, charts=chart_panels(request, range, which))
