"""Stored responses through the gateway on real vLLM (the tier's engines run with VLLM_ENABLE_RESPONSES_API_STORE=1,
conftest.ENGINE_ENV): a conversation continued by `previous_response_id`, a streamed turn with vLLM's own events,
and GET /v1/responses/{id} relayed to the replica that stores it (vLLM's 404 for an id none stores)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.real_vllm.conftest import SERVED
from tests.support import in_process_gateway


def event_names(raw: str) -> list[str]:
    return [json.loads(line[6:])["type"] for line in raw.splitlines() if line.startswith("data: ")]


def test_a_conversation_continues_through_the_gateway_and_its_responses_are_found(vllm):
    async def main() -> None:
        async with in_process_gateway([vllm.url]) as (gw, url), httpx.AsyncClient(base_url=url, timeout=120) as c:
            deadline = time.monotonic() + 60
            while not gw.pool.healthy():
                assert time.monotonic() < deadline, "the gateway never identified the replica"
                await asyncio.sleep(0.05)
            first = await c.post("/v1/responses", json={"model": SERVED, "input": "Say hello", "max_output_tokens": 6,
                                                        "temperature": 0.0})
            assert first.status_code == 200, first.text
            first_id = first.json()["id"]
            turn = {"model": SERVED, "input": "And again", "max_output_tokens": 6, "temperature": 0.0}
            alone = (await c.post("/v1/responses", json={**turn, "store": False})).json()
            second = await c.post("/v1/responses", json={**turn, "previous_response_id": first_id})
            assert second.status_code == 200, second.text
            answer = second.json()
            assert answer["previous_response_id"] == first_id
            # vLLM rendered the stored first turn (its input and output) before the new input.
            assert answer["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + \
                first.json()["usage"]["output_tokens"]
            got = await c.get(f"/v1/responses/{answer['id']}")
            assert got.status_code == 200 and got.json()["id"] == answer["id"], got.text
            assert got.json()["output"] == answer["output"]
            missing = await c.get("/v1/responses/resp_nope")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id", missing.text
            # A streamed third turn: vLLM's events end with response.completed, and the response is stored.
            streamed = await c.post("/v1/responses", json={**turn, "previous_response_id": answer["id"],
                                                           "stream": True})
            assert streamed.status_code == 200, streamed.text
            names = event_names(streamed.text)
            assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
            done = json.loads(streamed.text.rstrip().splitlines()[-1][6:])["response"]
            assert (await c.get(f"/v1/responses/{done['id']}")).json()["previous_response_id"] == answer["id"]

    asyncio.run(main())
