"""Tenants and their API keys. Keys are random secrets shown once; only their sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from holdback.models import ApiKey, Tenant

KEY_PREFIX = "hb-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(session: Session, tenant_name: str) -> str:
    """Create a key for the tenant (creating the tenant if new) and return the secret."""
    tenant = get_or_create_tenant(session, tenant_name)
    secret = KEY_PREFIX + secrets.token_urlsafe(24)
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(secret), prefix=secret[:8]))
    session.flush()
    return secret


def tenant_for_key(session: Session, secret: str) -> Tenant | None:
    row = session.execute(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(secret), ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
    return row
