"""Model pools over real HTTP: two `holdback sim --model model-a` replicas and one `--model model-b` behind one
gateway, as one process and with relays (`--workers 2`).

Each model's traffic reaches only its pool's replicas, a model no pool serves is answered by the gateway, and one
pool's holdback and eviction never touch the other pool's requests.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import sim_metric, sim_state
from tests.gateway.test_gateway_sim import PROMPT_LONG, obj, wait_until


def body(model: str, max_tokens: int, prompt: str = "hello there", stream: bool = False) -> dict:
    b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if stream:
        b["stream"] = True
    return b


def two_pools(stack, pool_b: str = "") -> tuple[list[str], str, object]:
    sims_a = stack.sim(2, "--model", "model-a")
    [sim_b] = stack.sim(1, "--model", "model-b")
    config = ("pools:\n"
              f"  - {{name: pool-a, models: [model-a], replicas: [{sims_a[0]}, {sims_a[1]}]}}\n"
              f"  - {{name: pool-b, models: [model-b], replicas: [{sim_b}]{pool_b}}}\n")
    gw = stack.gateway([], config)
    wait_until_sync(lambda: all(r["healthy"] for p in gw.state()["pools"].values() for r in p["replicas"]))
    return sims_a, sim_b, gw


def wait_until_sync(predicate, timeout: float = 30.0):
    return asyncio.run(wait_until(predicate, timeout))


def dispatched(gw) -> dict[str, int]:
    return {name: p["totals"]["dispatched"] for name, p in gw.state()["pools"].items()}


def test_each_models_traffic_reaches_only_its_pool_and_an_unknown_model_is_answered_by_the_gateway(stack):
    sims_a, sim_b, gw = two_pools(stack)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        served = {}
        for i in range(6):
            model = "model-a" if i % 3 else "model-b"
            r = c.post("/v1/completions", json=body(model, 2), headers={"x-request-id": f"r-{i}"})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
            served.setdefault(model, set()).add(r.headers["x-holdback-replica"])
        chat = c.post("/v1/chat/completions", json={"model": "model-b", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.headers["x-holdback-replica"] == sim_b
        # No `model`: the first pool's, as vLLM answers with its first served name.
        bare = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert bare.status_code == 200 and bare.headers["x-holdback-replica"] in sims_a

        before = dispatched(gw)
        unknown = c.post("/v1/completions", json=body("model-c", 2))
        models = c.get("/v1/models")
        state = gw.state()
        metrics = c.get("/metrics").text

    assert served["model-a"] <= set(sims_a) and served["model-b"] == {sim_b}
    # Each replica ran only its own model's requests (a wrong model would have been the simulator's 404).
    assert sum(sim_metric(u, "vllm:request_success_total") for u in sims_a) == 5
    assert sim_metric(sim_b, "vllm:request_success_total") == 3

    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error", error
    assert "`model-c`" in error["message"] and "model-a, model-b" in error["message"], error
    assert dispatched(gw) == before  # the gateway answered it: no replica was asked

    assert models.status_code == 200
    assert sorted(card["id"] for card in models.json()["data"]) == ["model-a", "model-b"]

    assert list(state["pools"]) == ["pool-a", "pool-b"]
    a, b = state["pools"]["pool-a"], state["pools"]["pool-b"]
    assert a["models"] == ["model-a"] and b["models"] == ["model-b"]
    assert sorted(r["url"] for r in a["replicas"]) == sorted(sims_a) and [r["url"] for r in b["replicas"]] == [sim_b]
    assert (a["totals"]["dispatched"], b["totals"]["dispatched"]) == (5, 3)
    # The default pool's document stays at the top level, as with one pool.
    assert state["bands"] == a["bands"] and state["replicas"] == a["replicas"]
    counted = {(s.labels["pool"], s.labels["path"]): s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples if s.name == "holdback_gateway_dispatches_total"}
    assert counted == {("pool-a", "inline"): 5.0, ("pool-b", "inline"): 3.0}, counted
    healthy = {(s.labels["pool"], s.labels["replica"]): s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples if s.name == "holdback_gateway_replica_healthy"}
    assert healthy == {**{("pool-a", u): 1.0 for u in sims_a}, ("pool-b", sim_b): 1.0}, healthy


def test_holdback_and_eviction_in_one_pool_never_touch_the_other_pools_requests(stack):
    # pool-b: 2 slots, batch held at half of them (1, the fixed reserve); pool-a: 2 x 48 slots.
    sims_a, sim_b, gw = two_pools(stack, ", saturation: {maxConcurrency: 2}, usageLimit: {policy: priority-holdback}")

    def band(pool: str, priority: int) -> dict:
        return next(b for b in gw.state()["pools"][pool]["bands"] if b["priority"] == priority)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            def send(model: str, objective: str, tokens: int, rid: str):
                return asyncio.create_task(client.post(
                    "/v1/completions", json=body(model, tokens, PROMPT_LONG),
                    headers=obj(objective, **{"x-request-id": rid})))

            batch_b = [send("model-b", "batch", 3000, f"batch-b-{i}") for i in range(2)]
            await wait_until(lambda: (b := band("pool-b", -10))["in_flight"] == 1 and b["queued"] == 1)
            # pool-b holds its batch back; pool-a's batch all runs.
            batch_a = [send("model-a", "batch", 3000, f"batch-a-{i}") for i in range(3)]
            await wait_until(lambda: band("pool-a", -10)["in_flight"] == 3)
            assert band("pool-a", -10)["queued"] == 0 and band("pool-b", -10)["queued"] == 1
            # Realtime fills pool-b: the second one finds it full and evicts pool-b's running batch request.
            long_rt = send("model-b", "realtime", 3000, "rt-long")
            await wait_until(lambda: band("pool-b", 100)["in_flight"] == 1)
            rt = await send("model-b", "realtime", 4, "rt-short")
            done, queued = await asyncio.wait(batch_b, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "pool-b's running batch request should have been evicted"
            evicted = done.pop().result()
            pools = (await client.get("/admin/state")).json()["pools"]
            running_a = sum(sim_state(u)["running"] for u in sims_a)
            for task in [*batch_a, *queued, long_rt]:
                task.cancel()
            await asyncio.gather(*batch_a, *queued, long_rt, return_exceptions=True)
            return rt, evicted, pools, running_a

    rt, evicted, pools, running_a = asyncio.run(main())
    assert rt.status_code == 200, rt.text
    assert evicted.status_code == 429 and evicted.headers["x-llm-d-request-dropped-reason"] == "evicted"
    assert evicted.headers["x-request-id"].startswith("batch-b-")
    a, b = pools["pool-a"], pools["pool-b"]
    assert b["totals"]["evictions"]["issued"] == 1
    assert a["totals"]["evictions"] == {} and a["totals"]["rejections"] == {}
    # pool-a's batch requests were all still running, on its replicas, after pool-b evicted.
    assert next(x for x in a["bands"] if x["priority"] == -10)["in_flight"] == 3 and running_a == 3
    assert a["saturation"] < 0.1 <= b["saturation"]


def test_replicas_without_pools_are_grouped_by_the_model_they_report(stack):
    sims_a = stack.sim(2, "--model", "model-a")
    [sim_b] = stack.sim(1, "--model", "model-b")
    gw = stack.gateway([*sims_a, sim_b], "")  # --replicas A1,A2,B and no pools

    def grouped():
        pools = gw.state()["pools"]
        return len(pools) == 2 and {tuple(p["models"]): sorted(r["url"] for r in p["replicas"] if r["healthy"])
                                    for p in pools.values()}

    assert wait_until_sync(grouped) == {("model-a",): sorted(sims_a), ("model-b",): [sim_b]}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for model, replicas in (("model-a", sims_a), ("model-b", [sim_b])):
            for _ in range(3):
                r = c.post("/v1/completions", json=body(model, 2))
                assert r.status_code == 200 and r.headers["x-holdback-replica"] in replicas, r.text
        unknown = c.post("/v1/completions", json=body("model-c", 2))
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "model-a" in unknown.json()["error"]["message"] and "model-b" in unknown.json()["error"]["message"]
    assert sim_metric(sim_b, "vllm:request_success_total") == 3
    assert sum(sim_metric(u, "vllm:request_success_total") for u in sims_a) == 3
