"""Per-tenant open-batch limit at create (holdback.tenant_limits): 429 `batch_limit_exceeded` that the SDK
does not re-send, nothing created, and another tenant untouched."""

from __future__ import annotations

import io

import httpx
import openai
import pytest

from tests.batch_processor.test_processor_support import chat, jsonl


def test_open_batches_over_the_limit_are_refused_at_create_and_the_sdk_does_not_resend(start_api):
    api = start_api(tenant_limits={"acme": {"open_batches": 2}})
    key, other_key = api.create_key("acme"), api.create_key("beta")
    sent: list[str] = []
    http_client = httpx.Client(timeout=60, event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=3, http_client=http_client)
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat(0)]))), purpose="batch")
    for _ in range(2):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    sent.clear()
    with pytest.raises(openai.RateLimitError) as exc:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert exc.value.body["code"] == "batch_limit_exceeded" and "2 open batches" in exc.value.body["message"]
    assert sent == ["/v1/batches"], "the SDK did not re-send a request that stays refused"
    assert len(client.batches.list().data) == 2, "nothing was created for the refused request"
    other = openai.OpenAI(base_url=f"{api.url}/v1", api_key=other_key, max_retries=0)
    g = other.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat(0)]))), purpose="batch")
    for _ in range(3):
        other.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="24h")
