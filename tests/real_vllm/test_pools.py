"""Model pools in front of real vLLM: two servers of the tiny model with different `--served-model-name` (one with
an alias) behind one gateway. Listed without pools they are grouped by what each reports in /v1/models; listed
in pools, by the config. Either way each model's requests (an alias's too) reach only its server, a model
neither serves is answered by the gateway, and GET /v1/models lists every name served.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.real_vllm.conftest import FIRST_CPU, SECOND_CPU, VllmServer
from tests.support import in_process_gateway, poll

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-pools")
    # The later --served-model-name wins: model-b is served under two names. Each on a CPU of its own, so they
    # start side by side (unpinned, two engines starting at once took longer than one start's deadline).
    a = VllmServer(logs / "a.log", served="model-a", cpu=SECOND_CPU)
    b = VllmServer(logs / "b.log", served="model-b", args=("--served-model-name", "model-b", "model-b-alias"),
                   cpu=FIRST_CPU)
    try:
        a.start()
        b.start()
        yield a.wait_ready(), b.wait_ready()
    finally:
        a.stop()
        b.stop()


def succeeded(server: VllmServer) -> float:
    return server.metrics().get("vllm:request_success_total", 0.0)


async def route_each_model(replicas: list[str], config: str, a: VllmServer, b: VllmServer) -> dict:
    async with in_process_gateway(replicas, config) as (gw, url), httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.to_thread(poll, lambda: len([p for p in gw.pools.pools.values() if p.replicas.healthy()]) == 2,
                                60, "a healthy replica in each model's pool")
        before = (succeeded(a), succeeded(b))
        replicas: dict[str, set[str]] = {}
        for model in ("model-a", "model-b", "model-b-alias") * 2:
            r = await client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text
            replicas.setdefault(model, set()).add(r.headers["x-holdback-replica"])
        after = (succeeded(a), succeeded(b))
        dispatched = {name: p.controller.tally.dispatched for name, p in gw.pools.pools.items()}
        unknown = await client.post("/v1/completions", json={"model": "model-c", "prompt": "hi", "max_tokens": 2})
        assert {name: p.controller.tally.dispatched for name, p in gw.pools.pools.items()} == dispatched
        models = (await client.get("/v1/models")).json()
        state = (await client.get("/admin/state")).json()
    return {"replicas": replicas, "served": (after[0] - before[0], after[1] - before[1]), "unknown": unknown,
            "models": sorted(card["id"] for card in models["data"]),
            "pools": {name: (p["models"], [r["url"] for r in p["replicas"]]) for name, p in state["pools"].items()}}


def check(seen: dict, a: VllmServer, b: VllmServer) -> None:
    assert seen["replicas"] == {"model-a": {a.url}, "model-b": {b.url}, "model-b-alias": {b.url}}
    assert seen["served"] == (2, 4)  # each server ran its own model's requests, none of the other's
    assert seen["unknown"].status_code == 404
    error = seen["unknown"].json()["error"]
    assert error["code"] == "model_not_found" and "model-a" in error["message"] and "model-b-alias" in error["message"]
    assert seen["models"] == ["model-a", "model-b", "model-b-alias"]


def test_replicas_without_pools_are_grouped_by_their_served_names(two_models):
    a, b = two_models
    seen = asyncio.run(route_each_model([a.url, b.url], "admission: {enabled: false}\n", a, b))
    check(seen, a, b)
    assert sorted(seen["pools"].values()) == [(["model-a"], [a.url]), (["model-b", "model-b-alias"], [b.url])]


def test_configured_pools_route_each_model_to_its_own_server(two_models):
    a, b = two_models
    config = (f"pools:\n  - {{name: small, models: [model-a], replicas: [{a.url}]}}\n"
              f"  - {{name: aliased, models: [model-b, model-b-alias], replicas: [{b.url}],"
              f" saturation: {{maxConcurrency: 4}}}}\n")
    seen = asyncio.run(route_each_model([], config, a, b))
    check(seen, a, b)
    assert seen["pools"] == {"small": (["model-a"], [a.url]), "aliased": (["model-b", "model-b-alias"], [b.url])}
