"""Dependencies for the DB session, the calling tenant and the operator (admin) key.

/v1 routes take `TenantDep`: a bearer key that `holdback.tenancy` resolves to a tenant. The admin
key is deliberately not a tenant key: on /v1 it gets 403, and operator routes take `AdminDep`.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Annotated, Iterator

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from batch_api.boundary import guarded_route
from batch_api.context import ApiContext, get_context
from batch_api.errors import Forbidden, Unauthorized
from holdback.tenancy import revoked_key, tenant_for_key

ContextDep = Annotated[ApiContext, Depends(get_context)]


def get_session(context: ContextDep) -> Iterator[Session]:
    """A session for the route; it connects on first use and routes commit their own writes."""
    with context.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


@dataclass(frozen=True)
class CurrentTenant:
    id: str
    name: str


def bearer_key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized(
            "Missing API key: send 'Authorization: Bearer <key>'. "
            "An operator creates keys with `holdback keys create --tenant NAME`.",
            code="missing_api_key",
        )
    return key


def is_admin_key(context: ApiContext, key: str) -> bool:
    admin = context.settings.admin_key
    return bool(admin) and hmac.compare_digest(key.encode(), admin.encode())


def current_tenant(request: Request, context: ContextDep) -> CurrentTenant:
    # The route class (batch_api.boundary) authenticates before the body is read; the dependency reuses that.
    known = getattr(request.state, "tenant", None)
    if known is not None:
        return known
    key = bearer_key(request)
    if is_admin_key(context, key):
        raise Forbidden(
            "The admin key is for operator routes (/admin/...), not for /v1. "
            "Call /v1 with a tenant key (create one with POST /admin/keys or `holdback keys create`).",
            code="tenant_key_required",
        )
    # A short session of its own: a long upload must not hold a DB connection while it streams.
    with context.sessions() as session:
        tenant = tenant_for_key(session, key)
        identity = CurrentTenant(tenant.id, tenant.name) if tenant is not None else None
        revoked = revoked_key(session, key) if identity is None else None
    if revoked is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(revoked.revoked_at))
        raise Unauthorized(
            f"This API key ({revoked.id}, {revoked.prefix}..., tenant {revoked.tenant}) was revoked at {when}: "
            f"ask an operator for a new one (`holdback keys create --tenant {revoked.tenant}`).",
            code="revoked_api_key")
    if identity is None:
        raise Unauthorized("Invalid API key: check the key you send as 'Authorization: Bearer <key>'.")
    request.state.tenant_id = identity.id
    request.state.tenant = identity
    return identity


TenantDep = Annotated[CurrentTenant, Depends(current_tenant)]


def require_admin(request: Request, context: ContextDep) -> None:
    if getattr(request.state, "admin", False):
        return
    if not context.settings.admin_key:
        raise Forbidden(
            "Operator routes are disabled because no admin key is configured; "
            "set HOLDBACK_ADMIN_KEY and restart the API server.",
            code="admin_disabled",
        )
    key = bearer_key(request)
    if is_admin_key(context, key):
        request.state.admin = True
        return
    with context.sessions() as session:
        is_tenant_key = tenant_for_key(session, key) is not None
    if is_tenant_key:
        raise Forbidden(
            "This operator route needs the admin key (HOLDBACK_ADMIN_KEY); tenant keys only work on /v1.",
            code="admin_key_required",
        )
    raise Unauthorized("Invalid admin key: send the value of HOLDBACK_ADMIN_KEY as 'Authorization: Bearer <key>'.")


AdminDep = Depends(require_admin)


# Route classes that authenticate before FastAPI reads the body (see batch_api.boundary).
TenantRoute = guarded_route(current_tenant)
AdminRoute = guarded_route(require_admin)
