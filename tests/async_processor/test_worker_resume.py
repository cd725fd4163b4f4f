"""Resume instead of restart, on the simulator: `holdback worker` streams resumable requests, assembles the
non-streamed body, and continues an evicted stream from its partial output.

Between worker and simulator sits an evicting gateway: it relays the simulator's stream and, on the attempts
a test names, cuts it after N tokens with the real gateway's eviction event (or answers 429 `evicted` before
any byte for requests that do not stream), so every case is exact, never a race.
"""

from __future__ import annotations

import json

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway.flow.request import DropReason
from gateway.responses import drop_response, evicted_sse_event
from model_sim.generation import output_text, output_token_id
from holdback.results import output_line
from tests.async_processor.test_worker_integration import CHAT, ScriptedGateway, stack  # noqa: F401 - the fixture

COMPLETION = {"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 12}
LONG_CHAT = {**CHAT, "max_tokens": 12}
SIM_ARGS = ("--decode-base-ms", "1", "--step-overhead-ms", "0.5")
# The tests that cut a stream after so many of its events and count the tokens kept ask for every token in its own
# event (the workers send 8 a time by default: test_with_a_stream_interval_... covers that).
EVERY_TOKEN = ("--stream-interval", "1")


class EvictingGateway(ScriptedGateway):
    """Relays to the simulator; `cuts[call_number] = tokens` cuts that call after so many output tokens."""

    paths = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, upstream: str, cuts: dict[int, int]):
        self.upstream = upstream
        self.cuts = cuts
        super().__init__(script=None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        body = await request.read()
        self.calls[rid].append({"headers": {k.lower(): v for k, v in request.headers.items()},
                                "body": json.loads(body), "path": request.path})
        cut = self.cuts.get(len(self.calls[rid]))
        streamed = bool(json.loads(body).get("stream"))
        if cut is not None and not streamed:
            return drop_response(DropReason.EVICTED, rid)  # evicted before any byte: a plain 429
        async with aiohttp.ClientSession() as http, http.post(
                self.upstream + request.path, data=body, headers={"content-type": "application/json"}) as up:
            if not streamed:
                return web.Response(status=up.status, body=await up.read(), content_type="application/json",
                                    headers={"x-sim-replica": up.headers.get("x-sim-replica", "")})
            out = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            tokens = 0
            async for line in up.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if cut is not None and tokens >= cut:
                    await out.write(evicted_sse_event())  # exactly what the gateway sends mid-stream
                    return out
                await out.write(b"data: " + payload + b"\n\n")
                if payload != b"[DONE]":
                    for choice in json.loads(payload).get("choices") or ():
                        tokens += bool((choice.get("delta") or {}).get("content") or choice.get("text"))
            await out.write_eof()
            return out


@pytest.fixture
def evicting():
    made = []

    def make(upstream: str, cuts: dict[int, int] | None = None) -> EvictingGateway:
        g = EvictingGateway(upstream, cuts or {})
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def direct(sim: str, url: str, body: dict) -> dict:
    """The same request, uninterrupted and not streamed, straight to the simulator."""
    r = httpx.post(sim + url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def without_identity(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def carried(got, expected) -> bool:
    """Every field the assembly wrote has the plain answer's value. vLLM's plain body also has null fields its
    stream never sends (service_tier, prompt_logprobs, message.refusal, ...), which the assembly does not add."""
    if isinstance(got, dict) and isinstance(expected, dict):
        return all(k in expected and carried(v, expected[k]) for k, v in got.items())
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(carried(a, b) for a, b in zip(got, expected))
    return got == expected


@pytest.mark.parametrize("url, body", [("/v1/chat/completions", LONG_CHAT), ("/v1/completions", COMPLETION)])
def test_the_streamed_and_assembled_body_equals_the_non_streamed_body(stack, evicting, url, body):
    sim = stack.sim(*SIM_ARGS)
    gw = evicting(sim)
    _, _, row_ids = stack.batch(2, body, url=url)
    stack.worker(gw.url)
    rows = stack.wait_final(row_ids)
    expected = direct(sim, url, body)
    for row in rows:
        assert row.status == "succeeded"
        (call,) = gw.calls[row.id]
        assert call["body"]["stream"] is True and call["headers"]["x-holdback-resumable"] == "1"
        got = output_line(row)["response"]["body"]
        assert carried(without_identity(got), without_identity(expected)), (got, expected)
        assert got["id"].startswith("chatcmpl-" if "chat" in url else "cmpl-")
        (attempt,) = stack.attempts(row.id)
        assert (attempt.input_tokens, attempt.output_tokens, attempt.tokens_kept, attempt.tokens_recomputed) == (
            expected["usage"]["prompt_tokens"], 12, 0, 0)


@pytest.mark.parametrize("url, body", [("/v1/chat/completions", LONG_CHAT), ("/v1/completions", COMPLETION)])
def test_an_evicted_request_resumes_and_ends_with_the_uninterrupted_text(stack, evicting, url, body):
    sim = stack.sim(*SIM_ARGS)
    gw = evicting(sim, cuts={1: 5, 2: 3})  # evicted twice: after 5 tokens, then after 3 more
    _, _, row_ids = stack.batch(1, body, url=url)
    stack.worker(gw.url, *EVERY_TOKEN)
    (row,) = stack.wait_final(row_ids)
    assert (row.status, row.attempts, row.evictions) == ("succeeded", 3, 2)
    expected = direct(sim, url, body)
    got = output_line(row)["response"]["body"]
    assert text_of(got) == text_of(expected) == output_text(0, 12)
    assert got["choices"][0]["finish_reason"] == "length"

    first, second, third = (c["body"] for c in gw.calls[row.id])
    streaming = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    # Both ask for vLLM's token ids, and resume from them (the prompt's ids and the output's so far) when they come.
    assert first == {**body, **streaming, "return_token_ids": True}
    assert second["max_tokens"] == 12 - 5 and third["max_tokens"] == 12 - 8
    # A chat goes on from its ids too, as a completion of them: the prompt as its template rendered it.
    prompt = {"messages": body["messages"]} if "chat" in url else {"prompt": body["prompt"]}
    prompt_ids = httpx.post(f"{sim}/tokenize", json=prompt).json()["tokens"]
    assert [c["path"] for c in gw.calls[row.id]] == [url, "/v1/completions", "/v1/completions"]
    assert second["prompt"] == prompt_ids + [output_token_id(i) for i in range(5)]
    assert third["prompt"] == prompt_ids + [output_token_id(i) for i in range(8)]

    a1, a2, a3 = stack.attempts(row.id)
    assert (a1.outcome, a1.drop_reason, a1.partial_output, a1.output_tokens) == ("evicted", "evicted",
                                                                                  output_text(0, 5), 5)
    assert (a2.outcome, a2.partial_output, a2.tokens_kept, a2.output_tokens) == ("evicted", output_text(0, 8), 5, 3)
    assert (a3.outcome, a3.partial_output, a3.tokens_kept, a3.output_tokens) == ("success", None, 8, 4)
    # No prefix caching: a resumed attempt prefills all the earlier work (prompt + kept text) again.
    assert a2.tokens_recomputed == a2.input_tokens == a1.input_tokens + 5
    assert a3.tokens_recomputed == a3.input_tokens
    usage = got["usage"]
    assert usage["completion_tokens"] == 12, "usage is summed across attempts"
    assert usage["prompt_tokens"] == a1.input_tokens + a2.input_tokens + a3.input_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


@pytest.mark.parametrize("url, body", [("/v1/chat/completions", LONG_CHAT), ("/v1/completions", COMPLETION)])
def test_with_a_stream_interval_events_carry_several_tokens_and_a_resume_still_ends_exact(stack, evicting, url,
                                                                                          body):
    sim = stack.sim(*SIM_ARGS)
    gw = evicting(sim, cuts={1: 2})  # evicted after two events: the first token, then one interval or more
    _, _, row_ids = stack.batch(1, body, url=url)
    stack.worker(gw.url, "--stream-interval", "4")
    (row,) = stack.wait_final(row_ids)
    assert (row.status, row.attempts, row.evictions) == ("succeeded", 2, 1)
    got = output_line(row)["response"]["body"]
    assert text_of(got) == text_of(direct(sim, url, body)) == output_text(0, 12)
    first, second = (c["body"] for c in gw.calls[row.id])
    assert first["stream_interval"] == second["stream_interval"] == 4
    a1, a2 = stack.attempts(row.id)
    assert a1.outcome == "evicted" and a1.output_tokens >= 5, "two events: 1 token, then at least 4 at once"
    assert second["max_tokens"] == 12 - a1.output_tokens and a2.tokens_kept == a1.output_tokens
    assert a1.output_tokens + a2.output_tokens == 12 and got["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("url, body", [
    ("/v1/completions", {"model": "sim-model", "prompt": " ".join(["w"] * 60), "max_tokens": 80}),
    ("/v1/chat/completions", {"model": "sim-model", "messages": [{"role": "user", "content": " ".join(["w"] * 60)}],
                              "max_tokens": 80}),
])
def test_with_prefix_caching_a_resumed_attempt_finds_its_prompt_and_partial_output_cached(stack, evicting, url, body):
    sim = stack.sim(*SIM_ARGS, "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", "16")
    gw = evicting(sim, cuts={1: 40})
    _, _, row_ids = stack.batch(1, body, url=url)
    stack.worker(gw.url, *EVERY_TOKEN)
    (row,) = stack.wait_final(row_ids)
    assert text_of(output_line(row)["response"]["body"]) == output_text(0, 80)
    a1, a2 = stack.attempts(row.id)
    assert a2.tokens_kept == 40 and a2.input_tokens == a1.input_tokens + 40
    # Every full block of prompt + kept output was registered by the evicted attempt and is hit now.
    assert a2.cached_tokens == (a2.input_tokens - 1) // 16 * 16
    assert a2.tokens_recomputed == a2.input_tokens - a2.cached_tokens < 16


def test_a_request_that_cannot_resume_restarts_unstreamed(stack, evicting):
    sim = stack.sim(*SIM_ARGS)
    gw = evicting(sim, cuts={1: 5})
    body = {**COMPLETION, "logprobs": 1}  # token logprobs cannot be continued: restart as today
    _, _, row_ids = stack.batch(1, body, url="/v1/completions")
    stack.worker(gw.url)
    (row,) = stack.wait_final(row_ids)
    assert (row.status, row.attempts, row.evictions) == ("succeeded", 2, 1)
    for call in gw.calls[row.id]:
        assert call["body"] == body and "x-holdback-resumable" not in call["headers"]
    assert text_of(output_line(row)["response"]["body"]) == output_text(0, 12)
    a1, a2 = stack.attempts(row.id)
    assert (a1.outcome, a1.partial_output, a2.tokens_kept) == ("evicted", None, 0)


def test_with_resume_off_an_evicted_stream_restarts_and_counts_the_decode_it_repeats(stack, evicting):
    sim = stack.sim(*SIM_ARGS)
    gw = evicting(sim, cuts={1: 5})
    _, _, row_ids = stack.batch(1, LONG_CHAT)
    stack.worker(gw.url, "--no-resume", *EVERY_TOKEN)
    (row,) = stack.wait_final(row_ids)
    first, second = (c["body"] for c in gw.calls[row.id])
    assert first == second, "the retry sends the original request again"
    assert "x-holdback-resumable" not in gw.calls[row.id][1]["headers"]
    got = output_line(row)["response"]["body"]
    assert text_of(got) == output_text(0, 12)
    a1, a2 = stack.attempts(row.id)
    assert (a2.tokens_kept, a2.output_tokens) == (0, 12)
    assert a2.tokens_recomputed == a1.input_tokens + 5, "the prompt prefilled again and 5 tokens decoded again"
    assert got["usage"]["completion_tokens"] == 5 + 12
