"""/v1/responses batches through the whole stack with the official `openai` client: API → processor (which checks
the models against the gateway) → workers → gateway → simulator, and back as OpenAI's batch output lines whose
bodies read as the SDK's own `Response`."""

from __future__ import annotations

import io
import json

import pytest
from openai.types.responses import Response

from model_sim.generation import output_text
from tests.e2e.test_e2e_pipeline import platform_factory  # noqa: F401

pytestmark = pytest.mark.e2e


def _line(i: int, model: str = "sim-model") -> str:
    body = {"model": model, "instructions": "Answer briefly.", "max_output_tokens": 5 + i % 3,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": f"question {i}"}]}]}
    return json.dumps({"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses", "body": body})


def _submit(client, lines: list[str]) -> str:  # noqa: ANN001
    f = client.files.create(file=("responses.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h").id


def test_a_responses_batch_round_trips_with_the_official_client(platform_factory):  # noqa: F811
    p = platform_factory(replicas=1)
    n = 12
    batch = p.wait(_submit(p.client, [_line(i) for i in range(n)]))

    assert batch.status == "completed", (batch.status, batch.errors)
    assert batch.endpoint == "/v1/responses" and batch.model == "sim-model"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n, n, 0)
    assert batch.error_file_id is None
    lines = [json.loads(x) for x in p.client.files.content(batch.output_file_id).text.splitlines() if x]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"resp-{i}" for i in range(n))
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == line["id"]
        answer = Response.model_validate(line["response"]["body"])
        i = int(line["custom_id"].split("-")[1])
        assert answer.object == "response" and answer.output_text == output_text(0, 5 + i % 3)
        assert answer.usage.output_tokens == 5 + i % 3 and answer.usage.input_tokens > 0
    assert batch.usage.output_tokens == sum(5 + i % 3 for i in range(n))


def test_a_responses_batch_with_an_unknown_model_keeps_its_served_lines_and_lists_the_rest_as_errors(
        platform_factory):  # noqa: F811
    p = platform_factory(replicas=1)
    batch = p.wait(_submit(p.client, [_line(i, "sim-model" if i < 3 else "gpt-4.1") for i in range(5)]))

    assert batch.status == "completed", (batch.status, batch.errors)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 3, 2)
    output = [json.loads(x) for x in p.client.files.content(batch.output_file_id).text.splitlines() if x]
    assert sorted(x["custom_id"] for x in output) == ["resp-0", "resp-1", "resp-2"]
    errors = [json.loads(x) for x in p.client.files.content(batch.error_file_id).text.splitlines() if x]
    assert sorted(x["custom_id"] for x in errors) == ["resp-3", "resp-4"]
    for line in errors:
        assert line["response"] is None and line["error"]["code"] == "model_not_found"
        assert "'gpt-4.1'" in line["error"]["message"] and "sim-model" in line["error"]["message"]

    failed = p.wait(_submit(p.client, [_line(i, "gpt-4.1") for i in range(2)]))
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [
        ("model_not_found", 1, "body.model"), ("model_not_found", 2, "body.model")]
    assert "sim-model" in failed.errors.data[0].message
