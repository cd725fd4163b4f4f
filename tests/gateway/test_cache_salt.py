"""Prefix reuse never crosses tenants: the gateway's `cache_salt`, alone and end to end on a simulator."""

from __future__ import annotations

import json

import httpx
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.cache_salt import private_salt, salted_body
from gateway.classification import Classifier
from gateway.settings import parse_config

KEYS = """
keys:
  - {key: a-key, tenant: tenant-a}
  - {key: a2-key, tenant: tenant-a, permissionVersion: 2}
  - {key: b-key, tenant: tenant-b}
  - {key: pub1-key, tenant: docs-1, sharePublicPrompts: true}
  - {key: pub2-key, tenant: docs-2, sharePublicPrompts: true}
"""
CHAT = "/v1/chat/completions"


def salt_of(key: str) -> str | None:
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {key}"}))
    return Classifier(parse_config(KEYS, "t")).classify(headers).cache_salt


def test_private_salt_depends_on_tenant_and_permission_version_public_keys_get_none():
    assert salt_of("a-key") == private_salt("tenant-a", 1)
    assert salt_of("a2-key") == private_salt("tenant-a", 2) != salt_of("a-key")
    assert salt_of("b-key") != salt_of("a-key")
    assert salt_of("pub1-key") is None and salt_of("pub2-key") is None


def salted(body: bytes, path: str, salt: str | None) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    return salted_body(body, path, salt, doc)


def test_the_gateway_salt_replaces_the_callers_and_public_salts_are_namespaced():
    body = json.dumps({"messages": [], "cache_salt": private_salt("tenant-a", 1)}).encode()
    assert json.loads(salted(body, CHAT, salt_of("b-key")))["cache_salt"] == salt_of("b-key"), \
        "tenant b cannot claim tenant a's scope by naming it"
    assert json.loads(salted(body, CHAT, None))["cache_salt"] == "public:" + private_salt("tenant-a", 1)
    plain = json.dumps({"prompt": "x"}).encode()
    assert salted(plain, "/v1/completions", None) == plain, "a public caller without a salt sends none"
    assert salted(plain, "/v1/models", salt_of("a-key")) == plain, "only bodies that reach the prefix cache"
    assert salted(b"not json", CHAT, salt_of("a-key")) == b"not json", "the replica reports bad JSON"


def test_a_callers_priority_is_removed_from_every_body_that_reaches_a_replica():
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        body = json.dumps({"prompt": "x", "priority": -100}).encode()
        assert json.loads(salted(body, path, None)) == {"prompt": "x"}, path
        assert "priority" not in json.loads(salted(body, path, salt_of("a-key"))), path


def test_tenant_b_sending_tenant_as_exact_prompt_gets_no_cached_tokens(stack):
    sims = stack.sim(1, "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", "16",
                     "--zero-latency")
    gw = stack.gateway(sims, KEYS)
    prompt = " ".join(["w"] * 80)  # 80 tokens: 4 full blocks can hit (one token is always computed)

    def cached(key: str) -> int:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a-key") == 0
    assert cached("a-key") == 64, "tenant a's repeat hits its own cached prefix"
    assert cached("b-key") == 0, "the same prompt from tenant b is computed afresh"
    assert cached("a2-key") == 0, "a new permission version starts a new scope"
    assert cached("pub1-key") == 0
    assert cached("pub2-key") == 64, "public keys share each other's prefixes"
