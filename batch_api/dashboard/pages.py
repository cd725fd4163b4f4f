"""The dashboard's routes: pages, the fragments htmx polls every 2 s, and the operator actions.

Pages render their fragments inline on first load; each live region then re-fetches its fragment
(`/dashboard/fragments/...`) on a timer and whenever an action answers with `HX-Trigger: refresh`.
Actions reuse the operator API's functions (`batch_api.admin`, `admin_queries`, `queues`) and answer with a
flash message.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from batch_api import admin, admin_queries, queues
from batch_api.auth import ContextDep, SessionDep, is_admin_key
from batch_api.context import ApiContext
from batch_api.dashboard import charts
from batch_api.dashboard.history import BATCHES_CHARTS, GATEWAY_CHARTS, chart_panels
from batch_api.dashboard.gateway_view import DROP_REASON_MEANINGS, fetch_gateway
from batch_api.dashboard.outcomes import Outcomes, shown_status
from batch_api.dashboard.session import (
    CheckedPost,
    SessionCookie,
    clear_cookie,
    close_session,
    open_session,
    safe_next,
    set_cookie,
    signed_in,
)
from batch_api.dashboard.throttle import LOGIN_ATTEMPTS, LoginThrottle
from batch_api.errors import ApiError
from holdback.logs import log_event
from holdback import lifecycle
from holdback.contract import requests_queue_name
from holdback.models import BATCH_TERMINAL, Batch, BatchStatus, RequestRow, RequestStatus

log = logging.getLogger("batch_api.dashboard")
router = APIRouter(prefix="/dashboard", include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))

BATCHES_PER_PAGE = 50
REQUESTS_PER_PAGE = 50
SEARCH_CHARS = 512
BODY_CHARS = 64 * 1024  # of a result body in the drawer; the download has it all
RATE_WINDOW = 60.0  # a batch's throughput and ETA are measured over its last minute
CANCELLABLE = {s.value for s in lifecycle.BATCH_REQUEST_CANCEL.sources}
TERMINAL_BATCH = {s.value for s in BATCH_TERMINAL}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


# ---- rendering ------------------------------------------------------------------------------------------------


def _ts(value: float | None) -> str:
    if value is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + " UTC"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    return f"{hours // 24}d {hours % 24}h"


def _clock(value: float | None) -> str:
    """Time of day with milliseconds (UTC): attempts of one request are seconds apart."""
    if value is None:
        return "—"
    return time.strftime("%H:%M:%S", time.gmtime(value)) + f".{int(value % 1 * 1000):03d}"


def _ago(value: float | None) -> str:
    if value is None:
        return "—"
    age = time.time() - value
    if age < 1:
        return "just now"
    return f"{int(age)} s ago" if age < 60 else f"{_duration(age)} ago"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _seconds(value: float | None) -> str:
    return "—" if value is None else charts.seconds_label(value)


def _query(**params: object) -> str:
    """A query string of the params that are set, for the URLs live regions poll."""
    return urlencode({k: v for k, v in params.items() if v not in (None, "")})


templates.env.filters.update(ts=_ts, clock=_clock, duration=_duration, ago=_ago, percent=_percent,
                             seconds=_seconds)
templates.env.globals.update(query=_query, meanings=DROP_REASON_MEANINGS)


def render(request: Request, name: str, session: object | None = None, status_code: int = 200,
           headers: dict[str, str] | None = None, **values: object) -> HTMLResponse:
    context: ApiContext = request.app.state.context
    values.setdefault("namespace", context.settings.redis_namespace)
    values.setdefault("csrf", getattr(session, "csrf", ""))
    values.setdefault("now_ts", time.time())
    response = templates.TemplateResponse(request, name, values, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    if headers:
        response.headers.update(headers)
    return response


def flash(request: Request, message: str, *, ok: bool = True, status_code: int = 200) -> HTMLResponse:
    """An action's answer: the toast text, and a trigger that refreshes every live region at once."""
    return render(request, "_flash.html", ok=ok, message=message, status_code=status_code,
                  headers={"HX-Trigger": "refresh"})


# ---- sign-in -----------------------------------------------------------------------------------------------------


@router.get("/login")
def login_form(request: Request, context: ContextDep, next: str | None = None) -> Response:  # noqa: A002
    admin_key = context.settings.admin_key
    if admin_key and signed_in(request, context):
        return RedirectResponse(safe_next(next), status_code=303)
    return render(request, "login.html", next=safe_next(next), error=None, disabled=not admin_key)


@router.post("/login")
def login(
    request: Request, context: ContextDep, admin_key: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/dashboard",  # noqa: A002
) -> Response:
    if not context.settings.admin_key:
        return render(request, "login.html", next=safe_next(next), error=None, disabled=True, status_code=403)
    connection, namespace = context.require_redis(), context.settings.redis_namespace
    client = request.client.host if request.client else "unknown"
    throttle = LoginThrottle(connection, namespace)
    wait = throttle.admit(client)
    if wait:
        log_event(log, "dashboard.login_throttled", level=logging.WARNING, client=client, retry_after_s=wait)
        return render(request, "login.html", next=safe_next(next), disabled=False, status_code=429,
                      headers={"retry-after": str(wait)},
                      error=f"Too many failed sign-ins from your address ({LOGIN_ATTEMPTS} a minute); "
                            f"try again in {wait} s.")
    if not is_admin_key(context, admin_key.strip()):
        log_event(log, "dashboard.login_failed", level=logging.WARNING, client=client)
        return render(request, "login.html", next=safe_next(next), disabled=False, status_code=401,
                      error="That is not the admin key. Use the value of HOLDBACK_ADMIN_KEY the API server runs with.")
    throttle.succeeded(client)
    response = RedirectResponse(safe_next(next), status_code=303)
    token = open_session(connection, namespace, context.settings.admin_key)
    set_cookie(response, token, secure=request.url.scheme == "https")
    log_event(log, "dashboard.login", client=client)
    return response


@router.post("/logout")
def logout(request: Request, session: CheckedPost, context: ContextDep) -> Response:
    # Ended on the server: the cookie is worthless even if a copy of it survives the browser's.
    close_session(context.require_redis(), context.settings.redis_namespace, session.token)
    response = Response(status_code=204, headers={"HX-Redirect": "/dashboard/login"})
    clear_cookie(response, secure=request.url.scheme == "https")
    log_event(log, "dashboard.logout", client=request.client.host if request.client else None)
    return response


# ---- batches -----------------------------------------------------------------------------------------------------


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
    }


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
def cancel_batch(request: Request, batch_id: str, _session: CheckedPost, db: SessionDep) -> HTMLResponse:
    try:
        before = admin_queries.any_batch(db, batch_id).status
        after = admin.cancel_any_batch(batch_id, db)["status"]
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
    overall = view["finished"] / (now - started) if started and view["finished"] and now > started else None
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


# ---- queues --------------------------------------------------------------------------------------------------------


def _queues(context: ApiContext, db: Session) -> dict:
    connection = queues.queue_redis(context)
    names = queues.queue_names(connection, context.settings.redis_namespace)
    workers = queues.workers(connection, names)
    # What each worker is doing, by batch: its in-flight job ids are request row ids.
    job_ids = {job for w in workers for job in w["current_jobs"]}
    batch_of = dict(db.execute(select(RequestRow.id, RequestRow.batch_id).where(RequestRow.id.in_(job_ids))).all()) \
        if job_ids else {}
    for w in workers:
        per_batch: dict[str, int] = {}
        for job in w["current_jobs"]:
            batch_id = batch_of.get(job)
            if batch_id is not None:
                per_batch[batch_id] = per_batch.get(batch_id, 0) + 1
        w["batches"] = sorted(per_batch.items(), key=lambda item: -item[1])
    return {
        "queues": [queues.queue_counts(connection, context.settings.redis_namespace, n) for n in names],
        "workers": workers,
        "requests_queue": requests_queue_name(context.settings.redis_namespace),
    }


@router.get("/queues")
def queues_page(request: Request, session: SessionCookie, context: ContextDep, db: SessionDep) -> HTMLResponse:
    return render(request, "queues.html", session, page="queues", **_queues(context, db))


@router.get("/fragments/queues")
def queues_fragment(request: Request, session: SessionCookie, context: ContextDep, db: SessionDep) -> HTMLResponse:
    return render(request, "_queues.html", session, **_queues(context, db))


@router.post("/queues/{name}/pause")
def pause_queue(request: Request, name: str, _session: CheckedPost, context: ContextDep) -> HTMLResponse:
    try:
        result = queues.set_queue_paused(context, name, True)
    except ApiError as exc:
        return flash(request, exc.message, ok=False, status_code=exc.status)
    if not result["changed"]:
        return flash(request, f"Queue {name} was already paused.")
    return flash(request, f"Paused queue {name}: workers take no new jobs from it ({result['queued']} waiting); "
                          f"{result['started']} in flight will finish. Resume to restart dispatch.")


@router.post("/queues/{name}/resume")
def resume_queue(request: Request, name: str, _session: CheckedPost, context: ContextDep) -> HTMLResponse:
    try:
        result = queues.set_queue_paused(context, name, False)
    except ApiError as exc:
        return flash(request, exc.message, ok=False, status_code=exc.status)
    if not result["changed"]:
        return flash(request, f"Queue {name} was not paused; nothing changed.")
    return flash(request, f"Resumed queue {name}: workers take its {result['queued']} waiting jobs again.")


@router.post("/queues/{name}/retry-failed")
def retry_failed(request: Request, name: str, _session: CheckedPost, context: ContextDep,
                 db: SessionDep) -> HTMLResponse:
    try:
        connection = queues.queue_redis(context)
        queues.known_queue(connection, context.settings.redis_namespace, name)
        result = queues.retry_failed(connection, db, name)
    except ApiError as exc:
        return flash(request, exc.message, ok=False, status_code=exc.status)
    log_event(log, "queue.retry_failed", **{k: v for k, v in result.items() if k != "object"})
    message = f"Requeued {result['requeued']} of {result['examined']} failed jobs in {name}."
    if result["kept"]:
        message += f" {result['kept']} stay failed: their requests are final (or not dispatched yet)."
    if result["cleared"]:
        message += f" Cleared {result['cleared']} stale entries with no failed job behind them."
    return flash(request, message)


# ---- gateway and charts ----------------------------------------------------------------------------------------


@router.get("/gateway")
async def gateway_page(request: Request, session: SessionCookie, context: ContextDep,
                       range: str | None = None) -> HTMLResponse:  # noqa: A002
    view = await fetch_gateway(context.settings.gateway_url, admin_key=context.settings.admin_key)
    return render(request, "gateway.html", session, page="gateway", gw=view,
                  fairness_names=await run_in_threadpool(_fairness_names, context, view),
                  charts=await run_in_threadpool(chart_panels, request, range, GATEWAY_CHARTS))


@router.get("/fragments/gateway")
async def gateway_fragment(request: Request, session: SessionCookie, context: ContextDep) -> HTMLResponse:
    view = await fetch_gateway(context.settings.gateway_url, admin_key=context.settings.admin_key)
    return render(request, "_gateway.html", session, gw=view,
                  fairness_names=await run_in_threadpool(_fairness_names, context, view))


def _fairness_names(context: ApiContext, view) -> dict[str, str]:  # noqa: ANN001 - a GatewayView
    """Tenant names of the fairness ids the gateway reports: the workers relay each batch's tenant id."""
    kv = view.state.get("kv") or {}
    ids = [fid for fid in (kv.get("tenants") or {}) if isinstance(fid, str)]
    if not ids:
        return {}
    with context.sessions() as db:
        return admin_queries.tenant_names(db, ids)


@router.get("/fragments/charts")
def charts_fragment(request: Request, session: SessionCookie, range: str | None = None,  # noqa: A002
                    show: str | None = None) -> HTMLResponse:
    which = GATEWAY_CHARTS if show == "gateway" else BATCHES_CHARTS
    return render(request, "_charts.html", session, charts=chart_panels(request, range, which))
