"""Prefix-cache scope: the `cache_salt` the gateway puts on every generation and embeddings request.

vLLM shares prefix-cache blocks only between requests with the same `cache_salt`. A private caller's salt is
derived from its tenant and the key's permission version (bump it to drop every cached prefix of the tenant
at once), and always replaces whatever salt the caller sent, so no caller can name another tenant's scope.
A key marked `sharePublicPrompts: true` gets no salt: its prompts share blocks with every other public
caller; a salt it sends itself is kept under a `public:` prefix, which no private salt ever has. vLLM refuses a
salt over 128 characters or with `@`, `/`, `\\` or NUL in it (vLLM's
`validate_cache_salt`), so such a caller salt goes as `public:sha256-<its hex digest>`: the same scope every
time, and always one vLLM accepts.
"""

from __future__ import annotations

import hashlib
import json

from holdback.contract import INFERENCE_ENDPOINTS, PRIORITY_FIELD

# The bodies that reach vLLM's prefix cache (its pooling and Responses API requests take a cache_salt too); the
# rest pass untouched.
SALTED_PATHS = frozenset(e.path for e in INFERENCE_ENDPOINTS if e.salted)
PUBLIC_PREFIX = "public:"
# vLLM's limits on a cache_salt (`_MAX_CACHE_SALT_LENGTH`, `_CACHE_SALT_FORBIDDEN_CHARS`).
MAX_SALT_LENGTH = 128
_FORBIDDEN = frozenset("@/\\\x00")
_ABSENT = object()


def private_salt(tenant: str, permission_version: int) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{permission_version}".encode()).hexdigest()[:32]
    return f"tenant:{digest}"


def public_salt(own: str) -> str:
    """A public caller's own salt under the public prefix, hashed when vLLM would refuse it as it is."""
    salt = PUBLIC_PREFIX + own
    if len(salt) > MAX_SALT_LENGTH or not _FORBIDDEN.isdisjoint(own):
        salt = f"{PUBLIC_PREFIX}sha256-{hashlib.sha256(own.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return salt


# The caller's place in the replica's own queue is the gateway's to decide, never the caller's: under vLLM's
# `--scheduling-policy priority` a caller's `"priority": -100` would run ahead of every realtime request. The
# header is the same field (vLLM reads it over the body's).
PRIORITY_HEADER = "x-vllm-priority"


def replica_priority(priority: int) -> int:
    """A band's priority in vLLM's order, where lower values run first (ours: higher is more important)."""
    return -priority


def with_priority(body: bytes, priority: int) -> bytes:
    """The body with vLLM's `priority` field set: its pooling endpoints (embeddings) read a request's priority
    from the body only, never from the header (`entrypoints/pooling/base/serving.py` in vLLM 0.32 and 0.34)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(doc, dict):
        return body
    doc[PRIORITY_FIELD] = priority
    return json.dumps(doc, separators=(",", ":")).encode()


def salted_body(body: bytes, path: str, salt: str | None, doc: object) -> bytes:
    """The request body as the replica gets it: the caller's cache scope applied (`salt=None`: a public caller)
    and the caller's priority removed.

    `doc` is `body` already parsed (None when it is not JSON): the proxy parses each body once, for this
    and for KV admission, and serialises it again only when this changes it."""
    if path not in SALTED_PATHS or not body or not isinstance(doc, dict):
        return body  # the replica answers the caller's bad JSON with its own 400
    changed = doc.pop(PRIORITY_FIELD, _ABSENT) is not _ABSENT
    own = doc.get("cache_salt")
    if salt is not None:
        doc["cache_salt"] = salt
    elif isinstance(own, str) and own:
        doc["cache_salt"] = public_salt(own)
    elif not changed:
        return body
    return json.dumps(doc, separators=(",", ":")).encode()
