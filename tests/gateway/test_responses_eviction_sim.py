"""An evicted /v1/responses stream ends with the Responses API's own events (gateway/responses_stream.py): `error`
with the drop reason, then `response.failed` carrying the response, its error and the output so far, numbered after
the last event relayed; read by OpenAI's own types. Against the simulator, which streams as vLLM 0.32 does."""

from __future__ import annotations

import asyncio
import json

import httpx
from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

from gateway.responses_stream import RelayedResponseEvents

BATCH, REALTIME = {"x-llm-d-inference-objective": "batch"}, {"x-llm-d-inference-objective": "realtime"}


def events(raw: str) -> list[tuple[str, dict]]:
    out = []
    for block in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if line)
        if lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_an_evicted_responses_stream_ends_with_error_and_response_failed(stack):
    sims = stack.sim(1, "--enable-responses-store")
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 2}\nusageLimit: {policy: static}\n")
    long = {"model": "sim-model", "input": "Tell me everything", "max_output_tokens": 3000, "ignore_eos": True,
            "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            deltas = [asyncio.Event(), asyncio.Event()]

            async def stream(i):
                text = ""
                async with client.stream("POST", "/v1/responses", json=long, headers=BATCH) as r:
                    async for chunk in r.aiter_text():
                        text += chunk
                        if "response.output_text.delta" in text:
                            deltas[i].set()
                return r.status_code, text

            first = asyncio.create_task(stream(0))
            await asyncio.wait_for(deltas[0].wait(), 30)
            second = asyncio.create_task(stream(1))
            await asyncio.wait_for(deltas[1].wait(), 30)
            rt = await client.post("/v1/completions", headers=REALTIME,
                                   json={"model": "sim-model", "prompt": "hi", "max_tokens": 3})
            assert rt.status_code == 200, rt.text
            answer = await asyncio.wait_for(second, 30)  # the newest batch stream is the victim
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            return answer

    status, text = asyncio.run(main())
    assert status == 200  # the head had gone out
    got = events(text)
    (error_name, error), (failed_name, failed) = got[-2:]
    assert (error_name, failed_name) == ("error", "response.failed"), got[-3:]
    assert error == {"code": "evicted", "message": error["message"], "param": None,
                     "sequence_number": got[-3][1]["sequence_number"] + 1, "type": "error"}
    assert "retry it now" in error["message"]
    assert failed["sequence_number"] == error["sequence_number"] + 1
    response = failed["response"]
    created = got[0][1]["response"]
    assert response["id"] == created["id"] and response["status"] == "failed"
    assert response["error"] == {"code": "rate_limit_exceeded", "message": error["message"]}
    # The output so far: the message with every delta the caller got, marked incomplete.
    (message,) = response["output"]
    text_so_far = "".join(d["delta"] for name, d in got if name == "response.output_text.delta")
    assert text_so_far and message["status"] == "incomplete" and message["content"][0]["text"] == text_so_far
    ResponseErrorEvent.model_validate(error)
    assert ResponseFailedEvent.model_validate(failed).response.output[0].content[0].text == text_so_far
    assert "[DONE]" not in text and '"error":{"message"' not in text  # no chat-style event
    assert gw.state()["totals"]["evictions"]["mid_stream"] == 1


def test_events_split_across_chunks_are_read_and_a_cut_event_is_ended_first():
    seen = RelayedResponseEvents("resp_x")
    stream = (b'event: response.created\ndata: {"response":{"id":"resp_x","status":"in_progress","output":[]},'
              b'"sequence_number":0,"type":"response.created"}\n\n'
              b'event: response.output_item.added\ndata: {"item":{"id":"msg_1","content":[],"status":"in_progress",'
              b'"type":"message","role":"assistant"},"output_index":0,"sequence_number":1,'
              b'"type":"response.output_item.added"}\n\n'
              b'event: response.content_part.added\ndata: {"content_index":0,"item_id":"msg_1","output_index":0,'
              b'"part":{"annotations":[],"text":"","type":"output_text"},"sequence_number":2,'
              b'"type":"response.content_part.added"}\n\n'
              b'event: response.output_text.delta\ndata: {"content_index":0,"delta":" a\\n\\nb","item_id":"msg_1",'
              b'"output_index":0,"sequence_number":3,"type":"response.output_text.delta"}\n\n'
              b'event: response.output_text.delta\ndata: {"content_index":0,"delta":" cut')
    for i in range(0, len(stream), 7):
        seen.see(stream[i:i + 7])
    raw = seen.failed("evicted", "why").decode()
    assert raw.startswith("\n\nevent: error\n")  # the cut delta is ended before the gateway's own events
    (_, error), (_, failed) = events(raw.lstrip("\n"))
    assert error["sequence_number"] == 4 and failed["sequence_number"] == 5
    assert failed["response"]["output"][0]["content"][0]["text"] == " a\n\nb"
    # Nothing read (not even response.created): the response is named by the id the gateway gave it.
    assert events(RelayedResponseEvents("resp_y").failed("evicted", "why").decode())[1][1]["response"]["id"] == \
        "resp_y"
