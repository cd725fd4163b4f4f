"""Prefix-cache scope between Batch API tenants, on one replica with prefix caching: every batch goes out under
the workers' one gateway key, and the gateway gives each tenant the worker relays its own cache salt, so a
tenant's prompt is a cache hit for that tenant's later batches and never for another tenant's (a hit would tell
tenant B that tenant A sent that prompt).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_e2e_pipeline import TERMINAL, Platform
from tests.support import submit_batch, wait_batch

pytestmark = pytest.mark.e2e

# About 1,400 tokens of the simulator's tokenizer: many full blocks to hit.
PROMPT = " ".join(f"clause {i} of the shared contract says nothing new" for i in range(160))


def _client(p: Platform, tenant: str) -> openai.OpenAI:
    key = httpx.post(f"{p.api_url}/admin/keys", json={"tenant": tenant},
                     headers={"Authorization": f"Bearer {p.backend.admin_key}"}, timeout=30)
    key.raise_for_status()
    return openai.OpenAI(base_url=f"{p.api_url}/v1", api_key=key.json()["key"], max_retries=5)


def _cached_tokens(p: Platform, client: openai.OpenAI) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a one-line batch with PROMPT, run to completion."""
    line = json.dumps({"custom_id": "only", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "sim-model", "max_tokens": 4,
                                "messages": [{"role": "user", "content": PROMPT}]}})
    batch_id = submit_batch(client, [line])
    batch = wait_batch(client, batch_id, lambda b: b.status in TERMINAL, 120,
                       lambda: f"{p.procs.log('worker')}\n{p.procs.log('gateway')}")
    assert batch.status == "completed" and batch.request_counts.completed == 1, (batch.status, batch.errors)
    out = json.loads(client.files.content(batch.output_file_id).text.splitlines()[0])
    usage = out["response"]["body"]["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_one_tenants_prompt_is_never_a_cache_hit_for_another_tenants_batch(backend, tmp_path):
    p = Platform(backend, tmp_path, replicas=1,
                 sim_args=("--enable-prefix-caching", "--enable-prompt-tokens-details"))
    try:
        alpha, beta = _client(p, "alpha"), _client(p, "beta")
        prompt_tokens, first = _cached_tokens(p, alpha)
        assert prompt_tokens > 1000 and first == 0
        # The control: the same tenant's next batch hits the blocks its first one left.
        _, again = _cached_tokens(p, alpha)
        assert again >= prompt_tokens - 64, ("the replica's prefix cache serves alpha's own prompt", again)
        _, other = _cached_tokens(p, beta)
        assert other == 0, f"beta's batch hit {other} tokens cached by alpha's"
    finally:
        p.close()
