"""/v1/responses through the gateway: relayed, salted per tenant like every generation path (vLLM's Responses API
takes a cache_salt), the caller's priority removed, and its prompt counted for KV admission as the chat vLLM
renders it (never the characters ÷ 4 estimate)."""

from __future__ import annotations

import json

import httpx

from gateway.cache_salt import private_salt, salted_body
from tests.gateway.test_cache_salt import KEYS

RESPONSES = "/v1/responses"


def test_a_responses_body_gets_the_tenants_salt_and_loses_the_callers_priority():
    doc = {"model": "m", "input": "hi", "priority": -100, "cache_salt": "someone-else"}
    salt = private_salt("tenant-a", 1)
    sent = json.loads(salted_body(json.dumps(doc).encode(), RESPONSES, salt, dict(doc)))
    assert sent == {"model": "m", "input": "hi", "cache_salt": salt}


def _prompt_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("holdback_gateway_prompt_counts_total{"):
            counts[line.split('source="')[1].split('"')[0]] = float(line.split()[-1])
    return counts


def test_responses_are_relayed_counted_and_never_share_cached_prefixes_across_tenants(stack):
    sims = stack.sim(1, "--enable-prefix-caching", "--block-size", "16", "--zero-latency")
    gw = stack.gateway(sims, KEYS)
    text = " ".join(["w"] * 80)

    def cached(key: str) -> int:
        r = httpx.post(gw.url + RESPONSES, json={"model": "sim-model", "input": text, "max_output_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "response" and r.headers["x-holdback-replica"] == sims[0]
        return body["usage"]["input_tokens_details"]["cached_tokens"]

    assert cached("a-key") == 0
    assert cached("a-key") >= 64, "tenant a's repeat hits its own cached prefix"
    assert cached("b-key") == 0, "the same input from tenant b is computed afresh"
    counts = _prompt_counts(gw.url)
    assert sum(counts.values()) == 3 and not counts.get("estimate"), counts
