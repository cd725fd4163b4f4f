"""The dashboard's Keys page: every tenant API key (id, tenant, prefix, created, revoked; never the
secret), creating a key for a tenant (its secret shown once, in the answer, never again), and a revoke
action with CSRF and a confirmation, like the queue actions. Creating here is `POST /admin/keys`; revoking
is `holdback keys revoke`: the key answers 401 from its next request. Below them, the gateway's own keys this
server knows of (`gateway_keys`).
"""

from __future__ import annotations

import logging

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from batch_api import admin
from batch_api.auth import ContextDep, SessionDep
from batch_api.dashboard.gateway_keys import gateway_keys
from batch_api.dashboard.rendering import flash, render
from batch_api.dashboard.session import CheckedPost, SessionCookie
from batch_api.schemas import KeyCreate
from holdback.db import transaction
from holdback.logs import log_event
from holdback.models import ApiKey
from holdback.tenancy import hash_key, list_keys, revoke_key

log = logging.getLogger("batch_api.dashboard")
# Paths are relative: batch_api.dashboard includes this router into the dashboard's (prefix /dashboard).
router = APIRouter(include_in_schema=False)


@router.get("/keys")
async def keys_page(request: Request, session: SessionCookie, db: SessionDep, context: ContextDep) -> HTMLResponse:
    return render(request, "keys.html", session, page="keys", keys=await run_in_threadpool(list_keys, db),
                  gateway=await gateway_keys(context.settings))


@router.get("/fragments/keys")
def keys_fragment(request: Request, session: SessionCookie, db: SessionDep) -> HTMLResponse:
    return render(request, "_keys.html", session, keys=list_keys(db))


@router.post("/keys")
def create(request: Request, _session: CheckedPost, db: SessionDep,
           tenant: Annotated[str, Form()] = "") -> HTMLResponse:
    try:
        body = KeyCreate(tenant=tenant)
    except ValidationError:
        return flash(request, "Name the tenant the key is for: 1 to 128 characters, not only spaces. A new name "
                              "creates the tenant.", ok=False, status_code=400)
    created = admin.create_tenant_key(body, db)
    key_id = db.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(created["key"])))
    # The page's headers include cache-control: no-store, so the secret outlives this answer nowhere.
    return render(request, "_new_key.html", _session, created=created, key_id=key_id,
                  headers={"HX-Trigger": "refresh"})


@router.post("/keys/{key_id}/revoke")
def revoke(request: Request, key_id: str, _session: CheckedPost) -> HTMLResponse:
    with transaction(request.app.state.context.sessions) as db:
        already = next((k.revoked_at for k in list_keys(db) if k.id == key_id), None)
        key = revoke_key(db, key_id)
    if key is None:
        return flash(request, f"No key {key_id}; it may have been deleted.", ok=False, status_code=404)
    if already is not None:
        return flash(request, f"Key {key.prefix}… of {key.tenant} was already revoked.")
    log_event(log, "key.revoked", key_id=key.id, tenant=key.tenant)
    return flash(request, f"Revoked key {key.prefix}… of {key.tenant}: it answers 401 from now on.")
