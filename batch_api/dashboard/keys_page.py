"""The dashboard's Keys page: every tenant API key (id, tenant, prefix, created, revoked; never the
secret) and a revoke action with CSRF and a confirmation, like the queue actions. Revoking here is
`holdback keys revoke`: the key answers 401 from its next request.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from batch_api.auth import SessionDep
from batch_api.dashboard.pages import flash, render
from batch_api.dashboard.session import CheckedPost, SessionCookie
from holdback.db import transaction
from holdback.logs import log_event
from holdback.tenancy import list_keys, revoke_key

log = logging.getLogger("batch_api.dashboard")
# Paths are relative: batch_api.dashboard includes this router into the dashboard's (prefix /dashboard).
router = APIRouter(include_in_schema=False)


@router.get("/keys")
def keys_page(request: Request, session: SessionCookie, db: SessionDep) -> HTMLResponse:
    return render(request, "keys.html", session, page="keys", keys=list_keys(db))


@router.get("/fragments/keys")
def keys_fragment(request: Request, session: SessionCookie, db: SessionDep) -> HTMLResponse:
    return render(request, "_keys.html", session, keys=list_keys(db))


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
