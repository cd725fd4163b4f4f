"""Batches and realtime through holdback in front of one real vLLM server: what vLLM answers, holdback answers.

The official SDK's round trip for chat and completions; exact prompt tokens (vLLM's `/tokenize` = the output's
`usage`); the lines vLLM serves that the gateway used to refuse (no `max_tokens`, prompt + limit over the
context); the lines vLLM refuses ending as line errors that say what to change; realtime streaming; the KV
ledger's pool equal to vLLM's own; prefix-cache isolation between tenants, read from vLLM's own counters.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.real_vllm.conftest import CONTEXT
from tests.real_vllm.stack import KEYS, RealStack, chat, completion
from tests.support import poll

pytestmark = pytest.mark.e2e

PROMPT_WORDS = "the quick brown fox jumps over the lazy dog and asks the batch gateway a question about tokens"


def tokenize(vllm, body: dict) -> int:
    r = httpx.post(f"{vllm.url}/tokenize", json={"model": "tiny", **body}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


@pytest.fixture
def stack(backend, tmp_path, vllm):
    s = RealStack(backend, tmp_path, [vllm.url])
    try:
        replicas = s.wait_identified()
        assert [r["model"] for r in replicas] == ["tiny"], "the served name, not vLLM's model path"
        yield s
    finally:
        s.close()


def test_sdk_batches_of_chat_and_completions_are_answered_as_vllm_answers(stack, vllm):
    prompt = f"{PROMPT_WORDS} number one"
    long_prompt = " ".join([PROMPT_WORDS] * 8)
    chat_prompt = tokenize(vllm, {"messages": [{"role": "user", "content": prompt}]})
    long_tokens = tokenize(vllm, {"prompt": long_prompt})
    assert long_tokens + 400 > CONTEXT > long_tokens, "the clamped line's prompt + limit must pass the context"
    chats = stack.submit([
        chat("limited", prompt, max_tokens=12),
        chat("no-limit", prompt),  # vLLM: up to the remaining context
        chat("max-completion-tokens", prompt, max_completion_tokens=7),
    ])
    completions = stack.submit([
        completion("default", prompt),  # vLLM's completions default: 16
        completion("clamped", long_prompt, max_tokens=400, ignore_eos=True),  # prompt + 400 > 512: clamped
        completion("token-ids", [11, 12, 13, 14], max_tokens=5, ignore_eos=True),
    ], endpoint="/v1/completions")
    for batch_id, n in ((chats, 3), (completions, 3)):
        batch = stack.wait(batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == n, (batch, stack.logs())
        assert batch.error_file_id is None, stack.lines(batch.error_file_id)
    out = {**stack.lines(stack.client.batches.retrieve(chats).output_file_id),
           **stack.lines(stack.client.batches.retrieve(completions).output_file_id)}
    usage = {cid: line["response"]["body"]["usage"] for cid, line in out.items()}
    assert usage["limited"]["prompt_tokens"] == chat_prompt, "prompt tokens are vLLM's own count"
    assert usage["limited"]["completion_tokens"] <= 12
    finish = out["no-limit"]["response"]["body"]["choices"][0]["finish_reason"]
    assert finish == "stop" or usage["no-limit"]["completion_tokens"] == CONTEXT - chat_prompt
    assert usage["max-completion-tokens"]["completion_tokens"] <= 7
    assert usage["default"]["prompt_tokens"] == tokenize(vllm, {"prompt": prompt})
    assert usage["default"]["completion_tokens"] <= 16
    assert usage["clamped"]["completion_tokens"] == CONTEXT - long_tokens
    assert usage["token-ids"]["prompt_tokens"] == 4
    for line in out.values():
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["model"] == "tiny"
        assert None not in (body.get("prompt_token_ids", 0), body.get("prompt_text", 0)), \
            "no streaming-chunk nulls in an assembled body"


def test_lines_vllm_refuses_are_line_errors_that_say_what_to_change(stack, vllm):
    over = " ".join([PROMPT_WORDS] * 40)
    assert tokenize(vllm, {"messages": [{"role": "user", "content": over}]}) >= CONTEXT
    refused = stack.submit([
        chat("fine", "hello there", max_tokens=4),
        chat("over-long", over, max_tokens=4),
        chat("limit-over-context", "hello", max_tokens=CONTEXT + 88),
    ])
    unknown = stack.submit([{**chat("unknown-model", "hello", max_tokens=4),
                             "body": {**chat("x", "hello", max_tokens=4)["body"], "model": "no-such-model"}}])
    embeddings = stack.submit([{"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "tiny", "input": "hello"}}], endpoint="/v1/embeddings")
    errors = {}
    for batch_id in (refused, embeddings):
        batch = stack.wait(batch_id)
        assert batch.status in ("completed", "failed"), (batch, stack.logs())
        errors.update(stack.lines(batch.error_file_id))
    assert stack.client.batches.retrieve(refused).request_counts.completed == 1
    assert set(errors) == {"over-long", "limit-over-context", "embed"}, errors
    messages = {cid: json.dumps(line["response"]["body"] if line["response"] else line["error"])
                for cid, line in errors.items()}
    # A model the gateway does not serve is refused at validation, before any request reaches vLLM; every line
    # of this batch is, so the batch fails with that line's error naming the model it serves.
    batch = stack.wait(unknown)
    assert batch.status == "failed" and batch.errors is not None, (batch, stack.logs())
    (refusal,) = batch.errors.data
    assert refusal.code == "model_not_found" and refusal.line == 1, refusal
    assert "no-such-model" in refusal.message and "tiny" in refusal.message, refusal
    assert "context" in messages["over-long"] and "reduce" in messages["over-long"].lower(), messages
    assert "max_tokens" in messages["limit-over-context"], messages
    assert errors["embed"]["response"]["status_code"] == 404, errors["embed"]
    assert "embedding" in messages["embed"].lower() and "Not Found" not in messages["embed"], messages


def test_realtime_streams_through_the_gateway(stack, vllm):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT_WORDS}], "max_tokens": 20,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{stack.gateway_url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer hb-real-realtime-key"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == tokenize(vllm, {"messages": body["messages"]})
    assert usage["completion_tokens"] <= 20 and any(c["choices"] for c in chunks)


def test_kv_ledger_pool_is_vllms_own(stack, vllm):
    """The pool the gateway admits against is vLLM's `kv_cache_size_tokens`, counted in vLLM's block size."""
    info = next(line for line in httpx.get(f"{vllm.url}/metrics", timeout=10).text.splitlines()
                if line.startswith("vllm:cache_config_info"))
    labels = dict(part.split("=", 1) for part in info[info.index("{") + 1:info.index("}")].replace('"', "").split(","))
    kv = poll(lambda: (stack.state().get("kv") or {}).get("replicas", {}).get(vllm.url), 30, "the ledger's pool")
    assert kv["total_kv_tokens"] == int(labels["kv_cache_size_tokens"])
    assert kv["block_size"] == int(labels["block_size"]) == 128, "the CPU build's blocks are 128 tokens, not 16"
    assert kv["total_blocks"] == int(labels["num_gpu_blocks"])


ISOLATION_KEYS = KEYS + """
  - {key_env: HOLDBACK_TEST_TENANT_A_KEY, tenant: tenant-a, objectives: [standard], defaultObjective: standard}
  - {key_env: HOLDBACK_TEST_TENANT_B_KEY, tenant: tenant-b, objectives: [standard], defaultObjective: standard}
"""
TENANT_KEYS = {"HOLDBACK_TEST_TENANT_A_KEY": "hb-real-tenant-a", "HOLDBACK_TEST_TENANT_B_KEY": "hb-real-tenant-b"}


def test_prefix_cache_is_not_shared_across_tenants(backend, tmp_path, vllm):
    """Tenant B sending tenant A's prompt finds nothing of it in vLLM's prefix cache; A again does."""
    keys = ISOLATION_KEYS.replace("anonymous: {enabled: false}\n", "") + "anonymous: {enabled: false}\n"
    s = RealStack(backend, tmp_path, [vllm.url], keys=keys, gateway_env=TENANT_KEYS)
    try:
        s.wait_identified()
        # Two full 128-token blocks of a prompt nobody sent before (the shared server may have cached others).
        prompt = " ".join(f"{PROMPT_WORDS} {i}" for i in range(14))
        assert CONTEXT - 8 > tokenize(vllm, {"prompt": prompt}) > 2 * 128

        def send(key: str) -> float:
            before = vllm.metrics()["vllm:prefix_cache_hits_total"]
            r = httpx.post(f"{s.gateway_url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            return vllm.metrics()["vllm:prefix_cache_hits_total"] - before

        send("hb-real-tenant-a")
        assert send("hb-real-tenant-b") == 0, "tenant B hit tenant A's cached blocks"
        assert send("hb-real-tenant-a") >= 2 * 128, "tenant A's own prompt is cached for tenant A"
    finally:
        s.close()


def test_with_a_stream_interval_vllm_joins_tokens_and_the_batch_answer_is_unchanged(backend, tmp_path, vllm):
    """vLLM sends a stream's tokens `stream_interval` at a time (the first at once); a worker that asks for it
    assembles the same answer vLLM gives a plain request."""
    body = {"model": "tiny", "prompt": PROMPT_WORDS, "max_tokens": 21, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_interval": 5, "return_token_ids": True}
    with httpx.stream("POST", f"{vllm.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    per_event = [len(e["choices"][0]["token_ids"] or []) for e in events if e.get("choices")]
    assert per_event[0] == 1 and sum(per_event) == 21 and max(per_event) == 5, per_event
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_interval", "return_token_ids")}
    direct = httpx.post(f"{vllm.url}/v1/completions", json=plain, timeout=60).json()["choices"][0]["text"]

    s = RealStack(backend, tmp_path, [vllm.url], worker_args=("--stream-interval", "5"))
    try:
        s.wait_identified()
        batch = s.wait(s.submit([completion("joined", PROMPT_WORDS, max_tokens=21, ignore_eos=True, temperature=0)],
                                endpoint="/v1/completions"))
        assert batch.status == "completed" and batch.request_counts.completed == 1, (batch, s.logs())
        (line,) = s.lines(batch.output_file_id).values()
        got = line["response"]["body"]
        assert got["choices"][0]["text"] == direct and got["usage"]["completion_tokens"] == 21
    finally:
        s.close()
