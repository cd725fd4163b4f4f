"""The simulator's /v1/responses: vLLM 0.32's answer (ResponsesResponse as its route dumps it), through the
official client, and the prompt it renders the instructions and input to."""

from __future__ import annotations

import openai

from model_sim.generation import output_text

# The keys, in order, of vLLM 0.32's ResponsesResponse.model_dump(mode="json", by_alias=True) for a plain text
# answer (no per-request metrics: `metrics` is left out when None), its message item and its usage.
VLLM_RESPONSE_KEYS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "max_output_tokens",
    "max_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "status", "text",
    "top_logprobs", "truncation", "usage", "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
    "ec_transfer_params", "input_messages", "output_messages"]
VLLM_MESSAGE_KEYS = ["id", "content", "role", "status", "type", "phase"]
VLLM_USAGE = {"input_tokens_details": ["cached_tokens", "cache_write_tokens", "input_tokens_per_turn",
                                       "cached_tokens_per_turn"],
              "output_tokens_details": ["reasoning_tokens", "tool_output_tokens", "output_tokens_per_turn",
                                        "tool_output_tokens_per_turn"]}


def test_a_responses_answer_has_vllms_keys_and_reads_with_the_official_client(sim):
    body = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "Hello there",
                                                "max_output_tokens": 6}).json()
    assert list(body) == VLLM_RESPONSE_KEYS
    (message,) = body["output"]
    assert list(message) == VLLM_MESSAGE_KEYS and message["id"].startswith("msg_")
    assert message["content"] == [{"annotations": [], "text": output_text(0, 6), "type": "output_text",
                                   "logprobs": None}]
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["tool_choice"] == "none"
    # The output limit ended it: vLLM calls that incomplete.
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    for field, keys in VLLM_USAGE.items():
        assert list(body["usage"][field]) == keys
    chat = [{"role": "user", "content": "Hello there"}]
    assert body["usage"]["input_tokens"] == sim.http.post("/tokenize", json={"messages": chat}).json()["count"]
    assert body["usage"]["output_tokens"] == 6 and body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + 6

    oai = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    answer = oai.responses.create(model="sim-model", instructions="Answer briefly.", max_output_tokens=4,
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert answer.output_text == output_text(0, 4) and answer.usage.output_tokens == 4
    rendered = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    assert answer.usage.input_tokens == sim.http.post("/tokenize", json={"messages": rendered}).json()["count"]


def test_bad_responses_requests_say_what_to_change(sim):
    for body, param in (({"model": "sim-model"}, "input"), ({"model": "sim-model", "input": []}, "input"),
                        ({"model": "sim-model", "input": "hi", "stream": True, "background": True}, "stream"),
                        ({"model": "sim-model", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                         "input")):
        r = sim.http.post("/v1/responses", json=body)
        assert r.status_code == 400, body
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "BadRequestError" and len(error["message"]) > 20
    missing = sim.http.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert missing.status_code == 404 and "sim-model" in missing.json()["error"]["message"]
