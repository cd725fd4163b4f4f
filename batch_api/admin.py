"""Operator routes under /admin, open only to the admin key: every tenant's batches, their request rows
and attempts, downloads, tenant keys, and the RQ queues and workers behind dispatch.

The dashboard (`batch_api.dashboard`) renders the same functions; the study benchmark reads the JSON.
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
from typing import Annotated, Iterable

import redis
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.utils import utcparse
from rq.worker_registration import WORKERS_BY_QUEUE_KEY
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batch_api import batches, files
from batch_api.auth import AdminDep, AdminRoute, ContextDep, CurrentTenant, SessionDep
from batch_api.errors import NotFound
from holdback.logs import log_event
from batch_api.openapi import ADMIN_ERRORS
from batch_api.schemas import AdminBatch, AdminBatchList, CreatedKey, KeyCreate, batch_to_api, list_page
from batch_api.tenant_scope import list_batches
from holdback.broker import is_paused, set_paused
from holdback.contract import queue_name_prefix, requests_queue_name
from holdback.models import (
    REQUEST_TERMINAL_VALUES,
    Attempt,
    Batch,
    BatchStatus,
    File,
    RequestRow,
    RequestStatus,
    Tenant,
)
from holdback.tenancy import create_key, get_or_create_tenant

router = APIRouter(tags=["admin"], dependencies=[AdminDep], route_class=AdminRoute, responses=ADMIN_ERRORS)
log = logging.getLogger("batch_api.admin")

# Rows whose job belongs in RQ: a failed job of such a row is requeued by retry-failed.
DISPATCHED = (RequestStatus.queued.value, RequestStatus.running.value, RequestStatus.retry_wait.value)
ID_CHUNK = 500
REGISTRIES = {
    "started": StartedJobRegistry,
    "scheduled": ScheduledJobRegistry,
    "failed": FailedJobRegistry,
    "deferred": DeferredJobRegistry,
    "finished": FinishedJobRegistry,
}


# ---- response models (the OpenAPI docs; the functions below build plain dicts) ---------------------------


class RequestRowObject(BaseModel):
    id: str
    custom_id: str
    line: int
    status: str
    attempts: int
    evictions: int
    duplicates: int
    transient_failures: int
    created_at: float
    enqueued_at: float | None
    first_attempt_at: float | None
    finished_at: float | None
    input_tokens: int
    output_tokens: int
    response_status: int | None
    error_code: str | None


class RequestRowList(BaseModel):
    object: str = "list"
    data: list[RequestRowObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class AttemptObject(BaseModel):
    number: int
    worker: str | None
    replica: str | None
    started_at: float
    ended_at: float | None
    outcome: str | None
    status_code: int | None
    drop_reason: str | None
    evicted: bool
    input_tokens: int
    output_tokens: int
    error: str | None
    cached_tokens: int = 0
    tokens_kept: int = Field(0, description="output tokens carried in from earlier attempts (resumed)")
    tokens_recomputed: int = Field(0, description="earlier attempts' prompt + output this attempt computed again")


class AttemptList(BaseModel):
    object: str = "list"
    request_id: str
    batch_id: str
    data: list[AttemptObject]


class QueueObject(BaseModel):
    object: str = "queue"
    name: str
    paused: bool
    queued: int
    started: int
    scheduled: int
    failed: int
    deferred: int
    finished: int
    workers: int


class QueueList(BaseModel):
    object: str = "list"
    data: list[QueueObject]


class QueuePaused(QueueObject):
    changed: bool


class RetriedFailed(BaseModel):
    object: str = "queue.retry_failed"
    queue: str
    examined: int
    requeued: int
    kept: int
    cleared: int


class WorkerObject(BaseModel):
    name: str
    queues: list[str]
    state: str | None
    hostname: str | None
    pid: int | None
    birth: str | None
    last_heartbeat: str | None
    heartbeat_age_s: float | None
    concurrency: int | None
    in_flight: int
    current_jobs: list[str]
    successful_job_count: int
    failed_job_count: int
    total_working_time: float


class WorkerList(BaseModel):
    object: str = "list"
    data: list[WorkerObject]


# ---- batches -----------------------------------------------------------------------------------------------


@router.get("/admin/batches", response_model=AdminBatchList, summary="List every tenant's batches, newest first")
def list_all_batches(
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: BatchStatus | None = None,
) -> dict:
    batches_, has_more = list_batches(
        session, None, limit=limit, after=after, status=status.value if status else None
    )
    return list_page([admin_batch(b) for b in batches_], has_more)


@router.get("/admin/batches/{batch_id}", response_model=AdminBatch, summary="Retrieve any tenant's batch")
def retrieve_any_batch(batch_id: str, session: SessionDep) -> dict:
    return admin_batch(any_batch(session, batch_id))


@router.post("/admin/batches/{batch_id}/cancel", response_model=AdminBatch, summary="Cancel any tenant's batch")
def cancel_any_batch(batch_id: str, session: SessionDep) -> dict:
    """The tenant route's cancel, on behalf of the batch's tenant: validating/in_progress → cancelling."""
    batch = any_batch(session, batch_id)
    batches.cancel_batch(batch.id, CurrentTenant(batch.tenant_id, ""), session)
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


def queue_names(connection: redis.Redis, namespace: str) -> list[str]:
    """The request queue, plus every other queue RQ knows whose name starts with `<namespace>-`."""
    names = {requests_queue_name(namespace)}
    prefix = Queue.redis_queue_namespace_prefix
    for key in connection.smembers(Queue.redis_queues_keys):
        name = _text(key).removeprefix(prefix)
        if name.startswith(queue_name_prefix(namespace)):
            names.add(name)
    return sorted(names)


def known_queue(connection: redis.Redis, namespace: str, name: str) -> str:
    if name not in queue_names(connection, namespace):
        raise NotFound(f"No queue named '{name}' in namespace '{namespace}'. GET /admin/queues lists them; "
                       f"the request queue is '{requests_queue_name(namespace)}'.", param="name")
    return name


def queue_counts(connection: redis.Redis, namespace: str, name: str) -> dict:
    with connection.pipeline(transaction=False) as pipe:
        pipe.llen(Queue.redis_queue_namespace_prefix + name)
        for registry in REGISTRIES.values():
            pipe.zcard(registry.key_template.format(name))
        pipe.scard(WORKERS_BY_QUEUE_KEY % name)
        queued, *registry_counts, worker_count = pipe.execute()
    return {
        "object": "queue", "name": name, "paused": is_paused(connection, namespace, name), "queued": queued,
        **dict(zip(REGISTRIES, registry_counts)), "workers": worker_count,
    }


def set_queue_paused(context, name: str, paused: bool) -> dict:  # noqa: ANN001 - ApiContext
    connection, namespace = queue_redis(context), context.settings.redis_namespace
    known_queue(connection, namespace, name)
    changed = set_paused(connection, namespace, name, paused)
    log_event(log, "queue.paused" if paused else "queue.resumed", queue=name, changed=changed)
    return {**queue_counts(connection, namespace, name), "changed": changed}


def retry_failed(connection: redis.Redis, session: Session, queue_name: str) -> dict:
    """Requeue each failed job whose row is queued, running or retry_wait; the database decides."""
    registry = FailedJobRegistry(queue_name, connection=connection)
    job_ids = [_text(x) for x in connection.zrange(registry.key, 0, -1)]
    statuses: dict[str, str] = {}
    for start in range(0, len(job_ids), ID_CHUNK):
        chunk = job_ids[start:start + ID_CHUNK]
        statuses.update(session.execute(select(RequestRow.id, RequestRow.status).where(RequestRow.id.in_(chunk))).all())
    requeued = kept = cleared = 0
    for job_id in job_ids:
        if statuses.get(job_id) not in DISPATCHED:
            kept += 1  # final (the record of a failed request), pending (the processor's), or no row at all
            continue
        try:
            job = Job.fetch(job_id, connection=connection)
        except NoSuchJobError:
            job = None
        if job is None or job.get_status(refresh=False) != JobStatus.FAILED:
            # The job expired, or reconciliation already dispatched the row again under the same id.
            cleared += connection.zrem(registry.key, job_id)
            continue
        try:
            registry.requeue(job)
            requeued += 1
        except InvalidJobOperation:
            cleared += 1  # someone else took it out of the registry meanwhile
    return {"object": "queue.retry_failed", "queue": queue_name, "examined": len(job_ids),
            "requeued": requeued, "kept": kept, "cleared": cleared}


def workers(connection: redis.Redis, queues: list[str]) -> list[dict]:
    keys = sorted({_text(k) for name in queues for k in connection.smembers(WORKERS_BY_QUEUE_KEY % name)})
    with connection.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
            pipe.smembers(WORKER_EXECUTIONS_KEY_TEMPLATE.format(key.removeprefix("rq:worker:")))
        replies = pipe.execute()
    found = []
    now = time.time()
    for i, key in enumerate(keys):
        fields = {_text(k): _text(v) for k, v in replies[2 * i].items()}
        if not fields or "death" in fields:
            continue  # expired or shut down: RQ drops the set member lazily
        jobs = sorted({_text(x).rsplit(":", 1)[0] for x in replies[2 * i + 1]})
        heartbeat = fields.get("last_heartbeat")
        found.append({
            "name": key.removeprefix("rq:worker:"),
            "queues": [q for q in fields.get("queues", "").split(",") if q],
            "state": fields.get("state"),
            "hostname": fields.get("hostname"),
            "pid": _int(fields.get("pid")),
            "birth": fields.get("birth"),
            "last_heartbeat": heartbeat,
            "heartbeat_age_s": round(now - utcparse(heartbeat).timestamp(), 1) if heartbeat else None,
            "concurrency": _int(fields.get("concurrency")),
            "in_flight": _int(fields.get("in_flight")) or len(jobs),
            "current_jobs": jobs[:50],
            "successful_job_count": _int(fields.get("successful_job_count")) or 0,
            "failed_job_count": _int(fields.get("failed_job_count")) or 0,
            "total_working_time": float(fields.get("total_working_time") or 0.0),
        })
    return found


def queue_redis(context) -> redis.Redis:  # noqa: ANN001 - ApiContext
    return context.require_redis()


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
