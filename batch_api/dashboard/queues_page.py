"""The dashboard's Queues page: each RQ queue's counts, the workers and the batches of the jobs they run, and the
operator actions on a queue (pause, resume, retry its failed jobs), which reuse `batch_api.queues`.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_api import queues
from batch_api.auth import ContextDep, SessionDep
from batch_api.context import ApiContext
from batch_api.dashboard.rendering import flash, render
from batch_api.dashboard.session import CheckedPost, SessionCookie
from batch_api.errors import ApiError
from holdback.contract import requests_queue_name
from holdback.logs import log_event
from holdback.models import RequestRow

log = logging.getLogger("batch_api.dashboard")
router = APIRouter(include_in_schema=False)


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
    return _set_paused(request, context, name, True)


@router.post("/queues/{name}/resume")
def resume_queue(request: Request, name: str, _session: CheckedPost, context: ContextDep) -> HTMLResponse:
    return _set_paused(request, context, name, False)


def _set_paused(request: Request, context: ApiContext, name: str, paused: bool) -> HTMLResponse:
    """Pause or resume dispatch from queue `name`, answered with what changed."""
    try:
        result = queues.set_queue_paused(context, name, paused)
    except ApiError as exc:
        return flash(request, exc.message, ok=False, status_code=exc.status)
    if paused and not result["changed"]:
        return flash(request, f"Queue {name} was already paused.")
    if paused:
        return flash(request, f"Paused queue {name}: workers take no new jobs from it ({result['queued']} waiting); "
                              f"{result['started']} in flight will finish. Resume to restart dispatch.")
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
