"""The gateway over real HTTP in front of real simulator replicas, each started as a subprocess.

Nothing of ours is mocked: the gateway and `holdback sim` run as `holdback` children, and the tests read
both sides (the gateway's /admin/state and the simulator's /admin/state and /metrics).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import sim_metric, sim_state

PROMPT_LONG = "lorem ipsum dolor sit amet " * 400  # ~2000 tokens: ~125 KV blocks per request


def body(max_tokens: int, prompt: str = "hello there", stream: bool = False) -> dict:
    b = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if stream:
        b["stream"] = True
    return b


def obj(name: str, **extra: str) -> dict:
    return {"x-llm-d-inference-objective": name, **extra}


async def wait_until(predicate, timeout: float = 15.0, interval: float = 0.02, what=None):
    """`predicate`'s first true value, polled until `timeout`; on failure, `what()` (if given) says what was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(interval)
    seen = f"; seen: {await asyncio.to_thread(what)}" if what is not None else ""
    raise AssertionError(f"condition not met within {timeout}s: {predicate}{seen}")


def test_batch_in_flight_never_exceeds_its_ceiling(stack):
    sims = stack.sim(2)
    # 2 replicas x maxConcurrency 4 = 8 slots; priority-holdback gives batch a 0.5 ceiling: 4 in flight.
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 4}\nusageLimit: {policy: priority-holdback}\n")
    assert gw.band(-10)["ceiling"] == 0.5

    async def main():
        samples_gw, samples_sim = [], []
        done = asyncio.Event()

        def sample():
            s = gw.state()
            band = next(b for b in s["bands"] if b["priority"] == -10)
            samples_gw.append(band["in_flight"])
            samples_sim.append(sum(sim_state(u)["running"] for u in sims))

        async def sampler():
            while not done.is_set():
                await asyncio.to_thread(sample)
                await asyncio.sleep(0.01)

        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            task = asyncio.create_task(sampler())
            calls = asyncio.gather(*(client.post("/v1/completions", json=body(60), headers=obj("batch"))
                                     for _ in range(16)))
            # Wait for the ceiling to be reached with work queued behind it (a sampler may miss a short peak
            # on a loaded machine; this waits for the state instead).
            at_ceiling = await wait_until(lambda: (b := gw.band(-10))["in_flight"] == 4 and b["queued"] > 0 and b)
            results = await calls
            done.set()
            await task
        assert [r.status_code for r in results] == [200] * 16
        return samples_gw, samples_sim, at_ceiling

    samples_gw, samples_sim, at_ceiling = asyncio.run(main())
    assert at_ceiling["in_flight"] == 4 and at_ceiling["queued"] > 0  # reached the ceiling, the rest waited ...
    assert max(samples_gw) <= 4, samples_gw       # ... the gateway never sent more ...
    assert max(samples_sim) <= 4, samples_sim     # ... and the replicas never ran more batch than that
    assert gw.state()["totals"]["dispatched"] == 16


def test_queued_realtime_dispatches_ahead_of_queued_batch(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 1}\nusageLimit: {policy: static}\n"
                             "eviction: {enabled: false}\n")

    async def main():
        finished: list[str] = []

        async def call(client, name, objective, max_tokens):
            r = await client.post("/v1/completions", json=body(max_tokens), headers=obj(objective))
            assert r.status_code == 200, r.text
            finished.append(name)

        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            running = asyncio.create_task(call(client, "running-batch", "batch", 3000))
            await wait_until(lambda: gw.band(-10)["in_flight"] == 1)
            tasks = []
            for i in range(3):
                tasks.append(asyncio.create_task(call(client, f"queued-batch-{i}", "batch", 3)))
            await wait_until(lambda: gw.band(-10)["queued"] == 3)
            tasks.append(asyncio.create_task(call(client, "realtime", "realtime", 3)))
            await wait_until(lambda: gw.band(100)["queued"] == 1)
            running.cancel()  # its client leaves: the one slot frees up
            await asyncio.gather(running, return_exceptions=True)
            await asyncio.gather(*tasks)
        return finished

    finished = asyncio.run(main())
    # One slot: completion order is dispatch order. Realtime arrived last but goes first.
    assert finished[0] == "realtime", finished
    assert sorted(finished[1:]) == ["queued-batch-0", "queued-batch-1", "queued-batch-2"]


def test_blocked_realtime_evicts_batch_and_frees_the_replica(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 4}\nusageLimit: {policy: static}\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            batch = [asyncio.create_task(client.post("/v1/completions", json=body(3000, PROMPT_LONG),
                                                     headers=obj("batch", **{"x-request-id": f"batch-{i}"})))
                     for i in range(4)]
            # Four ~2000-token prompts tokenized, admitted and prefilled: on a loaded two-core machine (the suite's
            # other workers, two relay processes starting) that once took more than the default 15 s.
            await wait_until(lambda: sim_state(sims[0])["running"] == 4, timeout=60)
            await asyncio.sleep(0.3)  # let the batch requests grow their KV
            kv_before = sim_metric(sims[0], "vllm:kv_cache_usage_perc")
            running_before = sim_metric(sims[0], "vllm:num_requests_running")
            rt = await client.post("/v1/completions", json=body(5), headers=obj("realtime"))
            assert rt.status_code == 200, rt.text
            assert rt.headers["x-holdback-queue-ms"]  # it had to wait for the eviction
            done, pending = await asyncio.wait(batch, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "exactly one batch request should have been evicted"
            evicted = done.pop().result()
            # Realtime is done and no batch is queued: the replica now runs only the 3 surviving batch requests.
            running_after = await wait_until(
                lambda: (n := sim_metric(sims[0], "vllm:num_requests_running")) <= 3 and n)
            kv_after = sim_metric(sims[0], "vllm:kv_cache_usage_perc")
            survivors = {r["external_id"] for r in sim_state(sims[0])["running_requests"]}
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return evicted, kv_before, kv_after, running_before, running_after, survivors

    evicted, kv_before, kv_after, running_before, running_after, survivors = asyncio.run(main())
    assert evicted.status_code == 429
    assert evicted.headers["x-llm-d-request-dropped-reason"] == "evicted"
    assert evicted.headers["retry-after"] == "0"  # come back at once: the retry keeps its place in line
    err = evicted.json()["error"]
    assert err["code"] == "evicted" and set(err) == {"message", "type", "param", "code"}
    victim = evicted.headers["x-request-id"]
    assert victim.startswith("batch-") and victim not in survivors and len(survivors) == 3
    assert running_before == 4 and running_after == 3
    assert kv_after < kv_before, (kv_before, kv_after)
    totals = gw.state()["totals"]["evictions"]
    assert totals["issued"] == 1 and totals["confirmed"] == 1


def test_eviction_after_streaming_began_ends_the_stream_with_an_error_event(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 2}\nusageLimit: {policy: static}\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]

            async def stream(i):
                chunks = []
                async with client.stream("POST", "/v1/completions", json=body(3000, stream=True),
                                         headers=obj("batch")) as r:
                    async for chunk in r.aiter_text():
                        chunks.append(chunk)
                        started[i].set()
                return r.status_code, "".join(chunks)

            first = asyncio.create_task(stream(0))
            await started[0].wait()
            second = asyncio.create_task(stream(1))
            await started[1].wait()
            rt = await client.post("/v1/completions", json=body(3), headers=obj("realtime"))
            assert rt.status_code == 200
            status, text = await asyncio.wait_for(second, 10)  # the newest batch stream is the victim
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            return status, text

    status, text = asyncio.run(main())
    assert status == 200  # headers had gone out already
    events = [e for e in text.split("\n\n") if e.strip()]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "evicted"
    assert "[DONE]" not in text
    assert gw.state()["totals"]["evictions"]["mid_stream"] == 1


def test_ttl_expiry_queue_limit_and_client_disconnects(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 1}\neviction: {enabled: false}\n"
                             "usageLimit: {policy: static}\nflowControl: {bands: [{priority: -10, maxRequests: 1}]}\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            # A long request the client will walk away from while it runs.
            running = asyncio.create_task(client.post("/v1/completions", json=body(3000), headers=obj("batch")))
            await wait_until(lambda: sim_state(sims[0])["running"] == 1)

            expired = await client.post("/v1/completions", json=body(3),
                                        headers=obj("batch", **{"x-llm-d-inference-ttl": "0.3"}))

            queued = asyncio.create_task(client.post("/v1/completions", json=body(3), headers=obj("batch")))
            await wait_until(lambda: gw.band(-10)["queued"] == 1)
            full = await client.post("/v1/completions", json=body(3), headers=obj("batch"))
            queued.cancel()  # closes the connection while the request is queued
            await asyncio.gather(queued, return_exceptions=True)
            await wait_until(lambda: gw.band(-10)["queued"] == 0)

            running.cancel()  # closes the connection while the request is in flight
            await asyncio.gather(running, return_exceptions=True)
            await wait_until(lambda: sim_state(sims[0])["running"] == 0)
            await wait_until(lambda: gw.state()["in_flight"] == 0)
            return expired, full

    expired, full = asyncio.run(main())
    assert full.status_code == 429  # the band's queue holds one request
    assert full.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert expired.status_code == 429
    assert expired.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert expired.json()["error"]["code"] == "rejected-ttl-expired"
    rejections = gw.state()["totals"]["rejections"]
    assert rejections == {"rejected-ttl-expired": 1, "rejected-context-cancelled": 1, "rejected-saturated": 1}


def test_keys_objectives_models_and_sse_passthrough(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "keys:\n  - {key: rt-key, tenant: app, objectives: [realtime, batch]}\n"
                             "  - {key_env: TEST_BATCH_KEY, tenant: workers, objectives: [batch]}\n"
                             "anonymous: {enabled: false}\n", env={"TEST_BATCH_KEY": "batch-key"})
    batch_auth = {"Authorization": "Bearer batch-key"}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body(2), headers={**batch_auth, **obj("realtime")})
        assert r.status_code == 403
        assert "realtime" in r.json()["error"]["message"] and r.json()["error"]["type"] == "permission_error"
        assert c.post("/v1/completions", json=body(2), headers={**batch_auth, **obj("batch")}).status_code == 200
        r = c.post("/v1/completions", json=body(2))
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert c.post("/v1/completions", json=body(2), headers={"Authorization": "Bearer nope"}).status_code == 401
        r = c.get("/v1/models", headers=batch_auth)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "sim-model"

        # A model no replica serves is answered by the gateway, 404 as vLLM answers it, naming what is served.
        bad = {**body(2), "model": "no-such-model"}
        direct_bad = httpx.post(sims[0] + "/v1/completions", json=bad, timeout=30)
        via_bad = c.post("/v1/completions", json=bad, headers=batch_auth)
        assert via_bad.status_code == direct_bad.status_code == 404
        error = via_bad.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model", error
        assert "`no-such-model`" in error["message"] and "sim-model" in error["message"], error

        # SSE passes through byte for byte, apart from the ids and timestamps the simulator makes up.
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
        direct = httpx.post(sims[0] + "/v1/chat/completions", json=chat, timeout=30)
        via = c.post("/v1/chat/completions", json=chat, headers={**batch_auth, "x-request-id": "sse-1"})
        assert via.status_code == 200 and via.headers["x-request-id"] == "sse-1"
        assert via.headers["x-holdback-replica"] == sims[0]  # the worker records it as the attempt's replica
        assert via.headers["content-type"].startswith("text/event-stream")

    def normalise(raw: bytes) -> bytes:
        raw = re.sub(rb'"id": ?"[^"]*"', b'"id":"X"', raw)
        return re.sub(rb'"created": ?\d+', b'"created":0', raw)

    assert direct.content.count(b"data: ") == 15  # role + 12 tokens + usage + [DONE]
    assert normalise(via.content) == normalise(direct.content)

    # The TTFT histogram tells the event stream (its first token) from the answers read whole (end to end).
    ttft: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text):
        if family.name == "holdback_gateway_ttft_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    ttft[sample.labels["stream"]] = ttft.get(sample.labels["stream"], 0.0) + sample.value
    # (The unknown model's 404 is the gateway's own: no replica answered it, so it has no TTFT.)
    assert ttft["true"] == 1 and ttft["false"] >= 1, ttft


def test_dead_replica_is_taken_out_and_back_in(stack):
    a = stack.sim(1)[0]
    port_b = int(stack.sim(1)[0].rsplit(":", 1)[1])
    b = f"http://127.0.0.1:{port_b}"
    gw = stack.gateway([a, b], "health: {intervalSeconds: 0.2, timeoutSeconds: 1.0}\n")
    sim_b = stack.procs.children[1][0]
    stack.procs.stop(sim_b, signal.SIGKILL)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        codes = [c.post("/v1/completions", json=body(2)).status_code for _ in range(10)]
        assert codes == [200] * 10
        healthy = {r["url"]: r["healthy"] for r in gw.state()["replicas"]}
        assert healthy == {a: True, b: False}
        ready = c.get("/readyz")  # one healthy replica is enough to serve
        assert ready.status_code == 200 and ready.json()["healthy_replicas"] == 1
        # Bring B back on the same port: it rejoins on a health check and receives traffic again.
        proc = stack.procs.start("sim", "--port", str(port_b), "--replicas", "1", "--log-level", "WARNING",
                                 name="sim")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(r["healthy"] for r in gw.state()["replicas"]):
            assert proc.poll() is None
            time.sleep(0.1)
        assert all(r["healthy"] for r in gw.state()["replicas"])
        before = sim_metric(b, "vllm:request_success_total")
        for _ in range(6):
            assert c.post("/v1/completions", json=body(2)).status_code == 200
        assert sim_metric(b, "vllm:request_success_total") > before
    # With every replica gone the gateway answers 503 rejected-no-endpoints.
    stack.procs.stop(stack.procs.children[0][0], signal.SIGKILL)
    stack.procs.stop(proc, signal.SIGKILL)
    deadline = time.monotonic() + 10
    r = None
    while time.monotonic() < deadline:
        r = httpx.post(gw.url + "/v1/completions", json=body(2), timeout=10)
        if r.status_code == 503:
            break
        time.sleep(0.1)
    assert r is not None and r.status_code == 503
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    # Alive, but not ready: no replica could serve a request.
    assert httpx.get(gw.url + "/healthz", timeout=10).status_code == 200
    not_ready = httpx.get(gw.url + "/readyz", timeout=10)
    assert not_ready.status_code == 503 and not_ready.json() == {"status": "failing", "healthy_replicas": 0,
                                                                 "replicas": 2}


def test_sighup_rejects_a_bad_config_and_applies_a_good_one(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, "saturation: {maxConcurrency: 8}\n")
    first = gw.state()["config"]["digest"]
    gw.config_path.write_text("saturation: {maxConcurrency: -3}\n")
    gw.reload()
    deadline = time.monotonic() + 10
    while "config_rejected" not in gw.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "config_rejected" in gw.log() and "maxConcurrency" in gw.log()
    assert gw.state()["config"]["digest"] == first
    assert gw.proc.poll() is None
    assert httpx.post(gw.url + "/v1/completions", json=body(2), timeout=10).status_code == 200

    gw.config_path.write_text("saturation: {maxConcurrency: 8}\n"
                              "usageLimit: {policy: priority-holdback, minCeiling: 0.25}\n")
    gw.reload()
    deadline = time.monotonic() + 10
    while gw.state()["config"]["digest"] == first and time.monotonic() < deadline:
        time.sleep(0.05)
    state = gw.state()
    assert state["config"]["digest"] != first
    assert next(b for b in state["bands"] if b["priority"] == -10)["ceiling"] == 0.25


def test_utilization_detector_reads_the_replicas_metrics(stack):
    # About a second per request: the replica stays saturated (three or more waiting) for about three seconds after
    # the gateway first sees it, long enough on a loaded machine for the two late requests to arrive while it is.
    sims = stack.sim(1, "--max-num-seqs", "1", "--decode-base-ms", "30")
    # With one sequence at a time the replica queues the rest: waiting / queueDepthThreshold drives saturation.
    gw = stack.gateway(sims, "saturation: {detector: utilization, queueDepthThreshold: 2}\n"
                             "metrics: {scrapeIntervalSeconds: 0.05}\nusageLimit: {policy: static}\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            calls = [asyncio.create_task(client.post("/v1/completions", json=body(30))) for _ in range(6)]
            state = await wait_until(lambda: (s := gw.state())["saturation"] >= 1.0 and s)
            calls += [asyncio.create_task(client.post("/v1/completions", json=body(5))) for _ in range(2)]
            held = await wait_until(lambda: (s := gw.state())["queued"] and s)
            results = await asyncio.gather(*calls)
        return state, held, results

    state, held, results = asyncio.run(main())
    assert [r.status_code for r in results] == [200] * 8
    assert state["detector"] == "utilization" and state["stale_replicas"] == 0
    assert state["replicas"][0]["waiting"] >= 2  # the scraped vllm:num_requests_waiting, 2 = the threshold
    assert held["queued"] >= 1 and held["saturation"] >= 1.0  # saturated: the gateway holds new work
    assert all(r.headers.get("x-holdback-queue-ms") for r in results[6:])
