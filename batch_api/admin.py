"""Operator routes under /admin, open only to the admin key: every tenant's batches, tenant keys.

The dashboard builds on these; `POST /admin/keys` is how tests and `holdback up` mint tenant keys.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.exc import IntegrityError

from batch_api.auth import AdminDep, SessionDep
from batch_api.observability import log_event
from batch_api.schemas import AdminBatchList, CreatedKey, KeyCreate, batch_to_api, list_page
from batch_api.tenant_scope import list_batches
from holdback.models import BatchStatus
from holdback.tenancy import create_key, get_or_create_tenant

router = APIRouter(tags=["admin"], dependencies=[AdminDep])
log = logging.getLogger("batch_api.admin")


@router.get("/admin/batches", response_model=AdminBatchList, summary="List every tenant's batches, newest first")
def list_all_batches(
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: BatchStatus | None = None,
) -> dict:
    batches, has_more = list_batches(
        session, None, limit=limit, after=after, status=status.value if status else None
    )
    return list_page([{**batch_to_api(b), "tenant_id": b.tenant_id} for b in batches], has_more)


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
