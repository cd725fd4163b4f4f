"""The Batches API under /v1: create, retrieve, list and cancel a tenant's batches.

The API only records intent: a new batch waits in `validating` and a cancel moves it to
`cancelling`; the batch processor does the work and the remaining transitions.
"""

from __future__ import annotations

import logging
from typing import Annotated

import redis
from fastapi import APIRouter, BackgroundTasks, Query

from batch_api.auth import ContextDep, SessionDep, TenantDep, TenantRoute
from batch_api.errors import BadRequest, LimitReached
from holdback import tracing
from holdback.logs import log_event
from batch_api.openapi import TENANT_ERRORS
from batch_api.schemas import BatchCreate, BatchList, BatchObject, batch_to_api, list_page
from batch_api.tenant_scope import get_batch, get_file, list_batches
from holdback import lifecycle, tenant_limits
from holdback.contract import wake_channel
from holdback.models import Batch, BatchStatus, now

router = APIRouter(tags=["batches"], route_class=TenantRoute, responses=TENANT_ERRORS)
log = logging.getLogger("batch_api.batches")

ALREADY_CANCELLING = (BatchStatus.cancelling.value, BatchStatus.cancelled.value)


@router.post("/v1/batches", response_model=BatchObject, summary="Create a batch from an uploaded JSONL file")
def create_batch(body: BatchCreate, tenant: TenantDep, session: SessionDep, context: ContextDep,
                 background: BackgroundTasks) -> dict:
    file = get_file(session, tenant.id, body.input_file_id, param="input_file_id")
    if file.purpose != "batch":
        raise BadRequest(
            f"File '{file.id}' was uploaded with purpose={file.purpose!r}; "
            "a batch needs a JSONL file uploaded with purpose='batch'.",
            param="input_file_id",
        )
    limits = tenant_limits.limits_for(context.settings, tenant.name)
    refused = tenant_limits.refuse_new_batch(limits, tenant_limits.usage(session, tenant.id), tenant.name)
    if refused is not None:
        raise LimitReached(refused.message, code=refused.code)
    created = now()
    window = body.window_seconds
    batch = Batch(
        tenant_id=tenant.id,
        endpoint=body.endpoint,
        input_file_id=file.id,
        completion_window=body.completion_window,
        window_seconds=window,
        status=BatchStatus.validating.value,
        metadata_=body.metadata,
        output_expires_after=body.output_expires_after.seconds if body.output_expires_after else None,
        created_at=created,
        expires_at=created + window,
        # The processor and the workers continue this request's trace (holdback.tracing).
        trace_context=tracing.current_traceparent(),
    )
    session.add(batch)
    session.commit()
    log_event(
        log, "batch.created", batch_id=batch.id, tenant_id=tenant.id, input_file_id=file.id,
        endpoint=batch.endpoint, window_seconds=window,
    )
    background.add_task(wake_processors, context, batch.id)
    return batch_to_api(batch)


@router.get("/v1/batches", response_model=BatchList, summary="List batches, newest first")
def list_tenant_batches(
    tenant: TenantDep,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict:
    batches, has_more = list_batches(session, tenant.id, limit=limit, after=after)
    return list_page([batch_to_api(b) for b in batches], has_more)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, summary="Retrieve a batch")
def retrieve_batch(batch_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    return batch_to_api(get_batch(session, tenant.id, batch_id))


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, summary="Cancel a batch")
def cancel_batch(batch_id: str, tenant: TenantDep, session: SessionDep, context: ContextDep,
                 background: BackgroundTasks) -> dict:
    batch = get_batch(session, tenant.id, batch_id)
    # Compare-and-set on the status: the processor may move the batch at the same moment.
    moved = lifecycle.request_cancel(session, batch.id, now())
    session.commit()
    session.refresh(batch)
    if moved:
        log_event(log, "batch.cancel_requested", batch_id=batch.id, tenant_id=tenant.id)
        background.add_task(wake_processors, context, batch.id)
    elif batch.status not in ALREADY_CANCELLING:
        raise BadRequest(_not_cancellable(batch), param="batch_id", code="batch_not_cancellable")
    return batch_to_api(batch)


def _not_cancellable(batch: Batch) -> str:
    if batch.status == BatchStatus.finalizing.value:
        return (
            f"Batch '{batch.id}' is finalizing: every request has finished and its files are being written, "
            "so it can no longer be cancelled. Retrieve it again shortly for its results."
        )
    return (
        f"Batch '{batch.id}' is already {batch.status} and cannot be cancelled; only validating or "
        "in_progress batches can. Its results, if any, are in output_file_id and error_file_id."
    )


def wake_processors(context, batch_id: str) -> None:  # noqa: ANN001 - ApiContext
    """After the answer went: the processors take the batch up now, not at their next poll. Best effort: without
    Redis they find it at their next poll, as before."""
    if context.redis is None:
        return
    try:
        context.redis.publish(wake_channel(context.settings.redis_namespace), batch_id)
    except redis.RedisError as exc:
        log_event(log, "processor_wake_failed", level=logging.WARNING, batch_id=batch_id, error=str(exc))
