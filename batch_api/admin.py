"""Operator routes under /admin, open only to the admin key: every tenant's batches, their request rows
and attempts, downloads, tenant keys, and the RQ queues and workers behind dispatch.

The dashboard (`batch_api.dashboard`) renders the same functions; the study benchmark reads the JSON. The
routes are thin: response models in `batch_api.admin_schemas`, SQL in `batch_api.admin_queries`, the RQ
queues (through `holdback.jobs`) in `batch_api.queues`.
Every route is documented in /docs (tag "admin"); the queue contract is:

- `GET /admin/queues` counts each RQ queue of this namespace: `queued` (the list), and the registries
  `started`, `scheduled` (retries waiting for their time), `failed`, `deferred`, `finished`, plus `paused`.
- `POST /admin/queues/{name}/pause` sets `holdback.broker.pause_key`: `holdback worker` stops taking jobs
  from the queue within about a second; in-flight jobs finish; enqueueing goes on. `.../resume` clears it.
- `POST /admin/queues/{name}/retry-failed` asks the database about each job in the FailedJobRegistry: a job
  whose row is still in flight (queued, running, retry_wait) goes back on the queue; one whose row is final
  stays failed as the operator's record; an entry with no failed job behind it is cleared.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Query
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from batch_api import batches, files
from batch_api.admin_queries import admin_batch, any_batch, attempts_of, request_page, search_batches, tenant_usage
from batch_api.admin_schemas import (
    AttemptList, QueueList, QueuePaused, RequestRowList, RetriedFailed, UsageList, WorkerList,
)
from batch_api.auth import AdminDep, AdminRoute, ContextDep, CurrentTenant, SessionDep
from batch_api.errors import BadRequest, NotFound
from batch_api.openapi import ADMIN_ERRORS
from batch_api.queues import (
    known_queue, queue_counts, queue_names, queue_redis, retry_failed, set_queue_paused, workers,
)
from batch_api.schemas import AdminBatch, AdminBatchList, CreatedKey, KeyCreate, list_page
from holdback.logs import log_event
from holdback.models import BatchStatus, File, RequestRow, RequestStatus
from holdback.tenancy import create_key, get_or_create_tenant

router = APIRouter(tags=["admin"], dependencies=[AdminDep], route_class=AdminRoute, responses=ADMIN_ERRORS)
log = logging.getLogger("batch_api.admin")

# ---- batches -----------------------------------------------------------------------------------------------


@router.get("/admin/batches", response_model=AdminBatchList, summary="List every tenant's batches, newest first")
def list_all_batches(
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: BatchStatus | None = None,
    tenant_id: Annotated[str | None, Query(description="Only this tenant's batches (tnt_...).")] = None,
    q: Annotated[str | None, Query(max_length=512, description=(
        "A batch id or its start, a file id of the batch, a custom_id of one of its lines, or text in its "
        "metadata (`key=value` matches one entry)."))] = None,
) -> dict:
    batches_, has_more = search_batches(
        session, limit=limit, after=after, status=status.value if status else None, tenant_id=tenant_id,
        text=(q or "").strip() or None,
    )
    return list_page([admin_batch(b) for b in batches_], has_more)


@router.get("/admin/batches/{batch_id}", response_model=AdminBatch, summary="Retrieve any tenant's batch")
def retrieve_any_batch(batch_id: str, session: SessionDep) -> dict:
    return admin_batch(any_batch(session, batch_id))


@router.post("/admin/batches/{batch_id}/cancel", response_model=AdminBatch, summary="Cancel any tenant's batch")
def cancel_any_batch(batch_id: str, session: SessionDep, context: ContextDep, background: BackgroundTasks) -> dict:
    """The tenant route's cancel, on behalf of the batch's tenant: validating/in_progress → cancelling."""
    batch = any_batch(session, batch_id)
    batches.cancel_batch(batch.id, CurrentTenant(batch.tenant_id, ""), session, context, background)
    log_event(log, "batch.cancel_by_operator", batch_id=batch.id, tenant_id=batch.tenant_id, status=batch.status)
    return admin_batch(batch)


@router.get(
    "/admin/batches/{batch_id}/requests",
    response_model=RequestRowList,
    summary="A batch's request rows in line order, with attempts, evictions and timings",
)
def list_batch_requests(
    batch_id: str,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(description="A row id: rows after its line.")] = None,
    status: RequestStatus | None = None,
    evicted: Annotated[bool | None, Query(description="true: evicted at least once; false: never.")] = None,
    unfinished: Annotated[bool | None, Query(description="true: not terminal yet; false: terminal.")] = None,
) -> dict:
    batch = any_batch(session, batch_id)
    rows, has_more = request_page(
        session, batch.id, limit=limit, after=after, status=status.value if status else None,
        evicted=evicted, unfinished=unfinished,
    )
    return list_page(rows, has_more)


@router.get("/admin/requests/{row_id}/attempts", response_model=AttemptList, summary="Every attempt of a request")
def list_request_attempts(row_id: str, session: SessionDep) -> dict:
    row = session.get(RequestRow, row_id)
    if row is None:
        raise NotFound(f"No request row with id '{row_id}'. Row ids (batch_req_...) are listed by "
                       "GET /admin/batches/{batch_id}/requests.", param="row_id")
    return {"object": "list", "request_id": row.id, "batch_id": row.batch_id, "data": attempts_of(session, row.id)}


@router.get(
    "/admin/files/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
    summary="Download any tenant's file",
)
def download_any_file(file_id: str, context: ContextDep, session: SessionDep) -> StreamingResponse:
    file = session.scalar(select(File).where(File.id == file_id, File.deleted_at.is_(None)))
    if file is None:
        raise NotFound(f"No file with id '{file_id}' (or it was deleted). A batch's output_file_id and "
                       "error_file_id name its result files.", param="file_id")
    return files.download_file(file.id, CurrentTenant(file.tenant_id, ""), context, session)


@router.post("/admin/keys", response_model=CreatedKey, status_code=201, summary="Create a tenant API key (shown once)")
def create_tenant_key(body: KeyCreate, session: SessionDep) -> dict:
    name = body.tenant.strip()
    try:
        secret = create_key(session, name)
        session.commit()
    except IntegrityError:
        # Another request created the same new tenant a moment ago; it exists now.
        session.rollback()
        secret = create_key(session, name)
        session.commit()
    tenant = get_or_create_tenant(session, name)
    log_event(log, "tenant_key.created", tenant_id=tenant.id, tenant=name, key_prefix=secret[:8])
    return {"object": "api_key", "tenant": name, "tenant_id": tenant.id, "key": secret}


# Periods are unix seconds from 1970 to 2100: a database timestamp holds every one of them.
USAGE_LATEST = 4_102_444_800


@router.get("/admin/usage", response_model=UsageList, summary="Each tenant's usage over a period")
def usage(
    session: SessionDep,
    since: Annotated[float | None, Query(ge=0, le=USAGE_LATEST,
                                         description="Unix seconds; default 24 hours ago.")] = None,
    until: Annotated[float | None, Query(ge=0, le=USAGE_LATEST, description="Unix seconds; default now.")] = None,
) -> dict:
    """Per tenant: batches created, requests finished by outcome with their tokens, attempts rejected and
    evicted in the period; requests running now and their share of every tenant's."""
    end = time.time() if until is None else until
    start = end - 86400 if since is None else since
    if start >= end:
        raise BadRequest(f"since ({start}) must be before until ({end}); pass unix seconds.", param="since")
    return {"object": "list", "since": start, "until": end,
            "data": [u.to_api() for u in tenant_usage(session, start, end)]}


# ---- queues and workers ----------------------------------------------------------------------------------------


@router.get("/admin/queues", response_model=QueueList, summary="Each RQ queue of this namespace, with counts")
def list_queues(context: ContextDep) -> dict:
    connection, namespace = queue_redis(context), context.settings.redis_namespace
    return {"object": "list", "data": [queue_counts(connection, namespace, name)
                                       for name in queue_names(connection, namespace)]}


@router.post("/admin/queues/{name}/pause", response_model=QueuePaused, summary="Stop dispatch from a queue")
def pause_queue(name: str, context: ContextDep) -> dict:
    return set_queue_paused(context, name, True)


@router.post("/admin/queues/{name}/resume", response_model=QueuePaused, summary="Restart dispatch from a queue")
def resume_queue(name: str, context: ContextDep) -> dict:
    return set_queue_paused(context, name, False)


@router.post(
    "/admin/queues/{name}/retry-failed", response_model=RetriedFailed,
    summary="Requeue failed jobs whose request rows are still in flight",
)
def retry_failed_jobs(name: str, context: ContextDep, session: SessionDep) -> dict:
    connection = queue_redis(context)
    known_queue(connection, context.settings.redis_namespace, name)
    result = retry_failed(connection, session, name)
    log_event(log, "queue.retry_failed", **{k: v for k, v in result.items() if k != "object"})
    return result


@router.get("/admin/workers", response_model=WorkerList, summary="Workers registered on this namespace's queues")
def list_workers(context: ContextDep) -> dict:
    connection = queue_redis(context)
    return {"object": "list", "data": workers(connection, queue_names(connection, context.settings.redis_namespace))}
