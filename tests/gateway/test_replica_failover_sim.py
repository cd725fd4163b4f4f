"""Replicas that fail before the first byte, behind a real `holdback gateway` in both modes (one process, and
`--workers 2`, where the relays report a failed replica to flow control over the channel): the request moves to
the healthy replica with its slot and KV reservation, and the failed ones are taken out.

The replicas answer as vLLM 0.32.0 does (FakeVllm of tests/gateway/test_vllm_replicas.py), each on its own thread.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.gateway.test_vllm_replicas import CHAT, FakeVllm


class ThreadedVllm:
    """A FakeVllm served from its own thread and event loop, for a gateway in another process."""

    def __init__(self, **options) -> None:
        self.vllm = FakeVllm(**options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.vllm.__aenter__(), self.loop).result(10)
        self.url = self.vllm.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.vllm.__aexit__(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def replicas():
    started: list[ThreadedVllm] = []

    def start(**options) -> ThreadedVllm:
        started.append(ThreadedVllm(**options))
        return started[-1]

    yield start
    for replica in started:
        replica.stop()


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_requests_leave_a_replica_that_dies_or_refuses_the_key_for_the_healthy_one(stack, replicas):
    dead, refusing, alive = replicas(dies=True), replicas(refuses=True), replicas()
    # No health check during the test: the failed replicas answer /health, so one would put them back.
    gw = stack.gateway([dead.url, refusing.url, alive.url], "health: {intervalSeconds: 60}\n")

    async def main():
        headers = {"x-llm-d-inference-objective": "realtime"}
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(gw.url + "/v1/chat/completions", headers=headers,
                                                      json={**CHAT, "stream": i % 2 == 0}) for i in range(12)))

    answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.status_code != 200]
    assert {a.headers["x-holdback-replica"] for a in answers} == {alive.url}
    assert dead.vllm.count("/v1/chat/completions") >= 1 and refusing.vllm.count("/v1/chat/completions") >= 1
    state = gw.state()
    health = {r["url"]: (r["healthy"], r["in_flight"]) for r in state["replicas"]}
    assert health == {dead.url: (False, 0), refusing.url: (False, 0), alive.url: (True, 0)}, health
    assert state["in_flight"] == 0
    held = {u: {k: v for k, v in kv.items() if k.startswith("reserved")} for u, kv in state["kv"]["replicas"].items()}
    assert not any(v for kv in held.values() for v in kv.values()), held
    log = gw.log()
    assert log.count('"event":"replica_unauthorized"') == 1 and refusing.url in log
    assert '"event":"upstream_moved"' in log


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_a_replica_started_with_api_key_is_served_with_the_key_from_the_environment(stack, replicas):
    keyed = replicas(api_key="vk")
    gw = stack.gateway([keyed.url], env={"HOLDBACK_GATEWAY_UPSTREAM_API_KEY": "vk"})
    answer = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    listed = httpx.get(gw.url + "/v1/models", timeout=30)
    assert answer.status_code == 200 and listed.json()["data"][0]["id"] == "tiny"
    [replica] = gw.state()["replicas"]
    assert replica["healthy"] and replica["model"] == "tiny"
    assert {auth for _path, auth in keyed.vllm.calls} == {"Bearer vk"}  # every call, from every process
    assert '"event":"replica_unauthorized"' not in gw.log()
