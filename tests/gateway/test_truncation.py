"""A prompt longer than the context that asks to be truncated is served, as vLLM serves it, not refused.

vLLM keeps the last N tokens of a prompt under `truncate_prompt_tokens` (chat, completions, embeddings), -1 being
the context less the one token held for output, and a Responses body's `truncation: "auto"` beside
`max_output_tokens` the same (seen on vLLM 0.32: tests/real_vllm/surface.py, the truncated_* cases). The gateway
refused such a prompt with 400 `rejected-context-length`, final for the workers.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.bodies import responses_as_chat
from gateway.request_size import truncated_prompt
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.test_kv_admission_sim import BASE, prompt

CONTEXT = 512


@pytest.mark.unit
@pytest.mark.parametrize("path, keep, counted, expected", [
    ("/v1/completions", 100, 600, 100),
    ("/v1/completions", 100, 40, 40),  # a shorter prompt is not padded
    ("/v1/chat/completions", -1, 600, CONTEXT - 1),  # one token held for output
    ("/v1/embeddings", -1, 600, CONTEXT),  # embeddings generate nothing: the whole context
    ("/v1/completions", CONTEXT + 1, 600, 600),  # vLLM refuses it: the replica answers
    ("/v1/completions", "100", 600, 600),
    ("/v1/completions", True, 600, 600),
    ("/v1/completions", None, 600, 600),
])
def test_the_prompt_counted_is_the_one_vllm_runs(path, keep, counted, expected):
    body = {"prompt": "x"} if keep is None else {"prompt": "x", "truncate_prompt_tokens": keep}
    assert truncated_prompt(body, path, counted, CONTEXT) == expected


@pytest.mark.unit
def test_an_unknown_context_leaves_minus_one_to_the_replica():
    assert truncated_prompt({"truncate_prompt_tokens": -1}, "/v1/completions", 600, None) == 600
    assert truncated_prompt({"truncate_prompt_tokens": 100}, "/v1/completions", 600, None) == 100


@pytest.mark.unit
def test_a_responses_body_truncated_auto_is_counted_as_a_truncated_chat():
    chat, _path = responses_as_chat({"model": "m", "input": "hi", "max_output_tokens": 4, "truncation": "auto"})
    assert chat["truncate_prompt_tokens"] == -1 and chat["max_completion_tokens"] == 4
    chat, _path = responses_as_chat({"model": "m", "input": "hi", "truncation": "auto"})
    assert "truncate_prompt_tokens" not in chat  # vLLM 0.32 truncates only beside max_output_tokens


def test_a_prompt_over_the_context_asking_to_be_truncated_is_served(stack):
    [sim] = stack.sim(1, "--num-blocks", "1000", "--max-model-len", str(CONTEXT))
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: any(r["max_model_len"] == CONTEXT for r in gw.state()["replicas"]), 30)
            long = prompt(CONTEXT + 40)
            refused = await client.post("/v1/completions", json={"model": "sim-model", "prompt": long,
                                                                 "max_tokens": 4})
            cut = await client.post("/v1/completions", json={"model": "sim-model", "prompt": long, "max_tokens": 4,
                                                             "truncate_prompt_tokens": 100})
            whole = await client.post("/v1/chat/completions", json={
                "model": "sim-model", "messages": [{"role": "user", "content": long}], "max_tokens": 4,
                "truncate_prompt_tokens": -1})
            responses = await client.post("/v1/responses", json={"model": "sim-model", "input": long,
                                                                 "max_output_tokens": 4, "truncation": "auto"})
            return refused, cut, whole, responses

    refused, cut, whole, responses = asyncio.run(main())
    assert refused.status_code == 400 and refused.headers["x-llm-d-request-dropped-reason"] == "rejected-context-length"
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 100
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"] == {**whole.json()["usage"], "prompt_tokens": CONTEXT - 1, "completion_tokens": 1}
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"]["input_tokens"] == CONTEXT - 1
