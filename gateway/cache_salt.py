"""Prefix-cache scope: the `cache_salt` the gateway puts on every generation request.

vLLM shares prefix-cache blocks only between requests with the same `cache_salt`. A private caller's salt is
derived from its tenant and the key's permission version (bump it to drop every cached prefix of the tenant
at once), and always replaces whatever salt the caller sent, so no caller can name another tenant's scope.
A key marked `sharePublicPrompts: true` gets no salt: its prompts share blocks with every other public
caller; a salt it sends itself is kept under a `public:` prefix, which no private salt ever has.
"""

from __future__ import annotations

import hashlib
import json

# Only these bodies reach vLLM's prefix cache; embeddings and everything else pass untouched.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PUBLIC_PREFIX = "public:"


def private_salt(tenant: str, permission_version: int) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{permission_version}".encode()).hexdigest()[:32]
    return f"tenant:{digest}"


def salted_body(body: bytes, path: str, salt: str | None, doc: object) -> bytes:
    """The request body with the caller's cache scope applied; `salt=None` means a public caller.

    `doc` is `body` already parsed (None when it is not JSON): the proxy parses each body once, for this
    and for KV admission, and serialises it again only when the salt changes it."""
    if path not in GENERATION_PATHS or not body or not isinstance(doc, dict):
        return body  # the replica answers the caller's bad JSON with its own 400
    own = doc.get("cache_salt")
    if salt is not None:
        doc["cache_salt"] = salt
    elif isinstance(own, str) and own:
        doc["cache_salt"] = PUBLIC_PREFIX + own
    else:
        return body
    return json.dumps(doc, separators=(",", ":")).encode()
