"""Prefix-cache scope: the `cache_salt` the gateway puts on every generation and embeddings request.

vLLM shares prefix-cache blocks only between requests with the same `cache_salt`. A private caller's salt is
derived from its tenant and the key's permission version (bump it to drop every cached prefix of the tenant
at once), and always replaces whatever salt the caller sent, so no caller can name another tenant's scope.
A key marked `sharePublicPrompts: true` gets no salt: its prompts share blocks with every other public
caller; a salt it sends itself is kept under a `public:` prefix, which no private salt ever has. vLLM refuses a
salt over 128 characters or with `@`, `/`, `\\` or NUL in it (vllm/entrypoints/generate/base/protocol.py
`validate_cache_salt`), so such a caller salt goes as `public:sha256-<its hex digest>`: the same scope every
time, and always one vLLM accepts.
"""

from __future__ import annotations

import hashlib
import json

# The bodies that reach vLLM's prefix cache (its pooling requests take a cache_salt too); the rest pass untouched.
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
PUBLIC_PREFIX = "public:"
# vLLM's limits on a cache_salt (`_MAX_CACHE_SALT_LENGTH`, `_CACHE_SALT_FORBIDDEN_CHARS`).
MAX_SALT_LENGTH = 128
_FORBIDDEN = frozenset("@/\\\x00")


def private_salt(tenant: str, permission_version: int) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{permission_version}".encode()).hexdigest()[:32]
    return f"tenant:{digest}"


def public_salt(own: str) -> str:
    """A public caller's own salt under the public prefix, hashed when vLLM would refuse it as it is."""
    salt = PUBLIC_PREFIX + own
    if len(salt) > MAX_SALT_LENGTH or not _FORBIDDEN.isdisjoint(own):
        salt = f"{PUBLIC_PREFIX}sha256-{hashlib.sha256(own.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return salt


def salted_body(body: bytes, path: str, salt: str | None, doc: object) -> bytes:
    """The request body with the caller's cache scope applied; `salt=None` means a public caller.

    `doc` is `body` already parsed (None when it is not JSON): the proxy parses each body once, for this
    and for KV admission, and serialises it again only when the salt changes it."""
    if path not in SALTED_PATHS or not body or not isinstance(doc, dict):
        return body  # the replica answers the caller's bad JSON with its own 400
    own = doc.get("cache_salt")
    if salt is not None:
        doc["cache_salt"] = salt
    elif isinstance(own, str) and own:
        doc["cache_salt"] = public_salt(own)
    else:
        return body
    return json.dumps(doc, separators=(",", ":")).encode()
