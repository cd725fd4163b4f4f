"""Tenants and their API keys. Keys are random secrets shown once; only their sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

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


def revoked_key(session: Session, secret: str) -> "KeyInfo | None":
    """The key with this secret if it was revoked (asked only once a key was refused: the refusal says why)."""
    row = session.execute(
        select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(secret), ApiKey.revoked_at.is_not(None))
    ).first()
    if row is None:
        return None
    key, name = row
    return KeyInfo(key.id, name, key.prefix, key.created_at, key.revoked_at)


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown about a key: never the secret, only its first characters."""

    id: str
    tenant: str
    prefix: str
    created_at: int
    revoked_at: int | None


def list_keys(session: Session, tenant_name: str | None = None) -> list[KeyInfo]:
    query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id)
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    rows = session.execute(query.order_by(ApiKey.created_at, ApiKey.id)).all()
    return [KeyInfo(k.id, name, k.prefix, k.created_at, k.revoked_at) for k, name in rows]


def revoke_key(session: Session, key_id: str) -> KeyInfo | None:
    """Revoke the key (by id); it answers 401 from then on. Revoking twice keeps the first time."""
    key = session.get(ApiKey, key_id)
    if key is None:
        return None
    if key.revoked_at is None:
        key.revoked_at = int(time.time())
        session.flush()
    tenant = session.get(Tenant, key.tenant_id)
    return KeyInfo(key.id, tenant.name if tenant else "?", key.prefix, key.created_at, key.revoked_at)
