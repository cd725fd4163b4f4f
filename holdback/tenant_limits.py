"""Per-tenant limits on queued work: open batches, enqueued requests and enqueued tokens.

One tenant's volume must not reach the others through the parts every tenant shares (the processor's single
writer, the database, the queues). Three limits, each 0 for none:
- open batches (validating, in progress, finalizing or cancelling): checked when a batch is created, which is
  refused with 429 `batch_limit_exceeded`;
- enqueued requests (requests of open batches without a final result) and enqueued tokens (their prompts,
  estimated as input bytes ÷ 4, in proportion to the requests still open): checked when a batch is validated,
  which fails it with `request_limit_exceeded` / `token_limit_exceeded`, as OpenAI fails a batch over its
  organisation's enqueued-token limit. Nothing of the batch was created, so failing it loses nothing.
Defaults come from settings (`HOLDBACK_TENANT_MAX_*`); `HOLDBACK_TENANT_LIMITS` overrides them per tenant name,
e.g. `{"acme": {"enqueued_requests": 5000000}}`. Two batches of one tenant validated at the same moment by two
processors may both pass: the limits bound a tenant's volume, they are not an exact quota.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from holdback.models import Batch, BatchStatus, File, Tenant

OPEN = (BatchStatus.validating.value, BatchStatus.in_progress.value, BatchStatus.finalizing.value,
        BatchStatus.cancelling.value)
BYTES_PER_TOKEN = 4  # the estimate of a prompt's tokens from its input line's bytes


@dataclass(frozen=True)
class Limits:
    open_batches: int
    enqueued_requests: int
    enqueued_tokens: int


@dataclass(frozen=True)
class TenantLoad:
    """What a tenant holds against its `Limits`."""

    open_batches: int
    enqueued_requests: int
    enqueued_tokens: int


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str


def limits_for(settings, tenant_name: str) -> Limits:  # noqa: ANN001 (holdback.settings.Settings)
    base = Limits(settings.tenant_max_open_batches, settings.tenant_max_enqueued_requests,
                  settings.tenant_max_enqueued_tokens)
    own = settings.tenant_limits.get(tenant_name)
    if own is None:
        return base
    return Limits(*(getattr(own, f) if getattr(own, f) is not None else getattr(base, f)
                    for f in ("open_batches", "enqueued_requests", "enqueued_tokens")))


def usage(session: Session, tenant_id: str, *, excluding: str | None = None) -> TenantLoad:
    """The tenant's open batches and their unfinished requests and estimated tokens (`excluding` one batch)."""
    remaining = Batch.total - Batch.completed - Batch.failed
    tokens = case((Batch.total > 0, File.bytes * remaining / Batch.total), else_=File.bytes) / BYTES_PER_TOKEN
    q = (select(func.count(), func.coalesce(func.sum(remaining), 0), func.coalesce(func.sum(tokens), 0))
         .select_from(Batch).outerjoin(File, File.id == Batch.input_file_id)
         .where(Batch.tenant_id == tenant_id, Batch.status.in_(OPEN)))
    if excluding is not None:
        q = q.where(Batch.id != excluding)
    count, requests, estimated = session.execute(q).one()
    return TenantLoad(int(count), int(requests), int(estimated))


def tenant_name(session: Session, tenant_id: str) -> str:
    return session.scalar(select(Tenant.name).where(Tenant.id == tenant_id)) or tenant_id


def refuse_new_batch(limits: Limits, used: TenantLoad, tenant: str) -> Refusal | None:
    """A batch about to be created: refused when the tenant already has its limit of open batches."""
    if limits.open_batches and used.open_batches >= limits.open_batches:
        return Refusal("batch_limit_exceeded", f"Tenant {tenant!r} has {used.open_batches} open batches, its limit "
                       f"({limits.open_batches}). Wait for some to finish or cancel some, then create this batch "
                       "again; an operator can raise the limit (HOLDBACK_TENANT_LIMITS).")
    return None


def refuse_expansion(limits: Limits, used: TenantLoad, tenant: str, requests: int, input_bytes: int) -> Refusal | None:
    """A validated batch of `requests` lines from `input_bytes` of input, about to be queued."""
    if limits.enqueued_requests and used.enqueued_requests + requests > limits.enqueued_requests:
        return Refusal("request_limit_exceeded", f"Enqueued request limit reached for tenant {tenant!r}: "
                       f"{used.enqueued_requests} requests of its open batches are not finished and this batch has "
                       f"{requests}; the limit is {limits.enqueued_requests}. Submit it again once earlier batches "
                       "have finished, or in smaller batches.")
    tokens = input_bytes // BYTES_PER_TOKEN
    if limits.enqueued_tokens and used.enqueued_tokens + tokens > limits.enqueued_tokens:
        return Refusal("token_limit_exceeded", f"Enqueued token limit reached for tenant {tenant!r}: its open "
                       f"batches hold about {used.enqueued_tokens} prompt tokens and this batch about {tokens} "
                       f"(input bytes ÷ {BYTES_PER_TOKEN}); the limit is {limits.enqueued_tokens}. Submit it again "
                       "once earlier batches have finished.")
    return None
