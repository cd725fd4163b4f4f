"""The gateway against the bytes real vLLM 0.32.0 sends (tests/fixtures/vllm/): its /metrics, its model list,
its errors, and what it does when a replica needs a key or dies.

The replicas here are small aiohttp apps in this process that answer with those bytes, so every test is fast
and unit; the real-engine tier (`make test-vllm`) checks the same behaviours against a live vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from gateway.replicas import Replica
from gateway.settings import ConfigError, parse_config
from gateway.vllm_metrics import parse_vllm_metrics
from holdback.contract import DROP_REASON_HEADER, DropReason
from tests.support import in_process_gateway as gateway

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
METRICS = (FIXTURES / "metrics.prom").read_text()


def data_parallel(text: str, usages: list[float]) -> str:
    """`text` as vLLM 0.32 writes it with one engine per entry of `usages`: one series per engine, and every
    cache_config_info series from the front end's one CacheConfig, whose num_gpu_blocks it summed over the
    engines (vLLM's engine client, `_apply_ready_response`) and whose kv_cache_size_tokens is one
    engine's."""
    out = []
    for line in text.splitlines():
        if 'engine="0"' not in line:
            out.append(line)
            continue
        for engine, usage in enumerate(usages):
            series = line.replace('engine="0"', f'engine="{engine}"')
            if series.startswith("vllm:kv_cache_usage_perc{"):
                series = series.rsplit(" ", 1)[0] + f" {usage}"
            elif series.startswith("vllm:cache_config_info{"):
                series = series.replace('num_gpu_blocks="16384"', f'num_gpu_blocks="{16384 * len(usages)}"')
            out.append(series)
    return "\n".join(out) + "\n"


# -- item: the KV pool and usage of /metrics ----------------------------------------------------------------
def test_real_vllm_metrics_give_the_block_size_blocks_and_kv_tokens():
    values = parse_vllm_metrics(METRICS)
    assert values["block_size"] == 128  # not effective_attention_block_size, mamba_block_size, ...
    assert values["num_gpu_blocks"] == 16384
    assert values["kv_cache_size_tokens"] == 2_097_152
    assert values["vllm:kv_cache_usage_perc"] == 0.0 and values["kv_cache_usage_max"] == 0.0


def test_data_parallel_engines_add_their_kv_tokens_once_and_usage_is_averaged_and_maxed():
    values = parse_vllm_metrics(data_parallel(METRICS, [0.2, 0.6]))
    assert values["num_gpu_blocks"] == 32768  # the replica's total, carried by each engine's series
    assert values["kv_cache_size_tokens"] == 2 * 2_097_152 == values["num_gpu_blocks"] * values["block_size"]
    assert values["vllm:kv_cache_usage_perc"] == 0.4
    assert values["kv_cache_usage_max"] == 0.6
    assert values["vllm:num_requests_running"] == 0.0


def test_the_simulators_cache_info_without_kv_tokens_gives_blocks_times_block_size():
    text = 'vllm:cache_config_info{model_name="sim",block_size="16",num_gpu_blocks="1000"} 1.0\n' \
           'vllm:kv_cache_usage_perc{model_name="sim"} 0.25\n'
    values = parse_vllm_metrics(text)
    assert (values["num_gpu_blocks"], values["block_size"], values["kv_cache_size_tokens"]) == (1000, 16, 16000)


def test_a_replica_knows_no_pool_until_it_reports_one():
    r = Replica("http://r")
    assert (r.num_gpu_blocks, r.kv_cache_size_tokens, r.kv_block_size, r.kv_usage_max) == (None,) * 4


# -- a replica that answers as vLLM 0.32.0 does, and the gateway in this process ---------------------------------
CHAT_SSE = (FIXTURES / "chat_stream.sse").read_bytes()
COMPLETION_SSE = (FIXTURES / "completion_stream.sse").read_bytes()
ERRORS = json.loads((FIXTURES / "errors.json").read_text())
MODELS = {"object": "list", "data": [{
    "id": "tiny", "object": "model", "created": 1796192300, "owned_by": "vllm", "root": "/tmp/tiny", "parent": None,
    "max_model_len": 512, "permission": [{"id": "modelperm-1", "object": "model_permission", "allow_view": True}]}]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class FakeVllm:
    """vLLM's answers from tests/fixtures/vllm on a port of this process. With `api_key`, /v1/* wants
    `Authorization: Bearer <key>` (vLLM's AuthenticationMiddleware); `dies`: an inference request's connection
    is closed before any byte of an answer, as when the replica is killed with the request; `refuses`: inference
    answers 401 (the replica was restarted with another key after it was identified); `embeds`: it serves
    /v1/embeddings (an embedding model, `--runner pooling`), else FastAPI's 404 answers it."""

    def __init__(self, api_key: str | None = None, dies: bool = False, refuses: bool = False,
                 metrics: str = METRICS, full: bool = False, mount: bool = True, embeds: bool = False,
                 prefix: str = ""):
        self.api_key, self.dies, self.refuses, self.metrics = api_key, dies, refuses, metrics
        self.embeds = embeds
        self.prefix = prefix  # every route under this path (a replica behind a reverse proxy's route)
        self.mount = mount  # /metrics/ answers `name[]=` (vLLM's prometheus_client mount); else it is a 404
        self.full = full  # inference answers vLLM's 503 for a full queue (--max-num-queued-reqs)
        self.calls: list[tuple[str, str | None]] = []  # (path, Authorization) of every request
        self.bodies: list[dict] = []  # inference bodies
        self.headers: list[dict[str, str]] = []  # and their headers
        self.url = ""
        self._runner: web.AppRunner | None = None

    def count(self, path: str) -> int:
        return sum(1 for p, _auth in self.calls if p == path)

    async def __aenter__(self) -> "FakeVllm":
        app = web.Application(middlewares=[self._authenticate])
        p = self.prefix
        app.router.add_get(p + "/health", self._answer(lambda: web.Response()))
        app.router.add_get(p + "/metrics", self._answer(lambda: web.Response(text=self.metrics)))
        if self.mount:
            app.router.add_get(p + "/metrics/", self._filtered_metrics)
        app.router.add_get(p + "/version", self._answer(lambda: web.json_response({"version": "0.32.0"})))
        app.router.add_post(p + "/tokenize", self._answer(lambda: web.json_response(
            {"count": 9, "max_model_len": 512, "tokens": list(range(9))})))
        app.router.add_get(p + "/v1/models", self._answer(lambda: web.json_response(MODELS)))
        app.router.add_post(p + "/v1/chat/completions", self._chat)
        app.router.add_post(p + "/v1/embeddings", self._embeddings)  # answered 404 without `embeds` (_authenticate)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}{self.prefix}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):  # noqa: ANN001
        auth = request.headers.get("Authorization")
        path = request.path.removeprefix(self.prefix)
        self.calls.append((path, auth))
        if self.api_key and path.startswith("/v1") and auth != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if path == "/v1/embeddings" and not self.embeds:
            return web.json_response(ERRORS["embeddings_on_generation_server_404"], status=404)
        return await handler(request)

    async def _filtered_metrics(self, request: web.Request) -> web.Response:
        names = set(request.query.getall("name[]", []))
        kept = [line for line in self.metrics.splitlines()
                if (line.split(" ")[2] if line.startswith("# ") else re.split(r"[{ ]", line, 1)[0]) in names]
        return web.Response(text="\n".join(kept) + "\n")

    @staticmethod
    def _answer(make):  # noqa: ANN001, ANN205
        async def handler(request: web.Request) -> web.Response:
            return make()
        return handler

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        return web.json_response({"object": "list", "model": "tiny", "data": [
            {"index": 0, "object": "embedding", "embedding": [0.5, 0.5]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.refuses:
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.full:
            return web.json_response({"error": {"message": "The engine is currently busy and cannot accept new "
                                                "requests. Please try again later or on a different instance.",
                                                "type": "ServiceUnavailableError", "param": None, "code": 503}},
                                     status=503)
        if self.dies:
            request.transport.close()  # type: ignore[union-attr]
            await asyncio.sleep(3600)  # cancelled with the connection
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(CHAT_SSE)
            await stream.write_eof()
            return stream
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ps{"},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}})


def events(caplog, name: str) -> list[dict]:
    return [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == name]


def test_a_scrape_sets_the_replicas_kv_pool_and_usage_of_every_engine():
    async def main():
        async with FakeVllm(metrics=data_parallel(METRICS, [0.1, 0.3])) as vllm, gateway([vllm.url]) as (gw, _url):
            return gw.pool.replicas[0]

    replica = asyncio.run(main())
    assert (replica.num_gpu_blocks, replica.kv_block_size, replica.kv_cache_size_tokens) == (32768, 128, 4_194_304)
    assert round(replica.kv_usage, 6) == 0.2 and replica.kv_usage_max == 0.3


def test_the_scrape_asks_vllms_metrics_mount_for_the_gateways_series_alone():
    """vLLM's GET /metrics answers ~50 KB of histograms built by its API server at every scrape; its /metrics/
    mount (prometheus_client's app) answers `name[]=` with those series alone: the gateway asks there."""
    async def main():
        async with FakeVllm(metrics=data_parallel(METRICS, [0.1, 0.3])) as vllm, \
                gateway([vllm.url], "metrics: {scrapeIntervalSeconds: 0.05}\n") as (gw, _url):
            await wait_for(lambda: vllm.count("/metrics/") >= 3)
            return gw.pool.replicas[0], vllm

    replica, vllm = asyncio.run(main())
    assert vllm.count("/metrics") == 0 and replica.metrics_filtered is True
    assert (replica.num_gpu_blocks, replica.kv_block_size, replica.kv_cache_size_tokens) == (32768, 128, 4_194_304)
    assert round(replica.kv_usage, 6) == 0.2 and replica.kv_usage_max == 0.3


def test_a_replica_without_the_metrics_mount_is_scraped_at_metrics_after_one_404():
    async def main():
        async with FakeVllm(mount=False) as vllm, \
                gateway([vllm.url], "metrics: {scrapeIntervalSeconds: 0.05}\n") as (gw, _url):
            await wait_for(lambda: vllm.count("/metrics") >= 3)
            return gw.pool.replicas[0], vllm

    replica, vllm = asyncio.run(main())
    assert vllm.count("/metrics/") == 1 and replica.metrics_filtered is False
    assert (replica.num_gpu_blocks, replica.kv_block_size) == (16384, 128)


async def wait_for(check, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# -- item: /admin/state names the served model ------------------------------------------------------------------
def test_a_replica_is_known_by_its_served_name_and_its_root_is_kept_for_the_tokenizer():
    async def main():
        async with FakeVllm() as vllm, gateway([vllm.url]) as (gw, url):
            async with httpx.AsyncClient() as client:
                state = (await client.get(url + "/admin/state")).json()
            return gw.pool.replicas[0], state

    replica, state = asyncio.run(main())
    assert state["replicas"][0]["model"] == "tiny"  # vLLM's `id`, what callers put in `model`; not /tmp/tiny
    assert (replica.model, replica.model_root, replica.max_model_len, replica.runtime_version) == (
        "tiny", "/tmp/tiny", 512, "0.32.0")


def test_a_calibration_profile_of_the_root_path_still_matches_and_a_new_one_records_the_served_name():
    from gateway.calibration import Profile

    replica = Replica("http://r", model="tiny", model_root="/tmp/tiny", runtime_version="0.32.0")
    old = Profile("/tmp/tiny", "0.32.0", "cpu", 16384, 128, 512, 0.0)  # written before: the root
    assert old.mismatch(replica) is None
    assert Profile("tiny", "0.32.0", "cpu", 16384, 128, 512, 0.0, model_root="/tmp/tiny").mismatch(replica) is None
    assert "differs" in Profile("other", "0.32.0", "cpu", 1, 16, None, 0.0, model_root="/x").mismatch(replica)


# -- item: replicas started with --api-key ----------------------------------------------------------------------
def test_a_replica_that_wants_a_key_the_gateway_lacks_is_out_with_one_log_line_saying_how_to_set_it(caplog):
    caplog.set_level(logging.INFO, logger="gateway")

    async def main():
        async with FakeVllm(api_key="vk") as vllm, gateway([vllm.url], "health: {intervalSeconds: 0.05}\n") as (
                gw, url):
            for _ in range(3):
                await gw.pool.check_all()
                await gw.pool.scrape_all()
            async with httpx.AsyncClient() as client:
                ready = await client.get(url + "/readyz")
                answer = await client.post(url + "/v1/chat/completions", json=CHAT)
            return vllm, gw.pool.replicas[0], ready, answer

    vllm, replica, ready, answer = asyncio.run(main())
    assert not replica.healthy and replica.model is None
    assert ready.status_code == 503
    assert answer.status_code == 503  # no replica can take it: no 401 relayed to the caller
    assert vllm.count("/v1/chat/completions") == 0
    logged = events(caplog, "replica_unauthorized")
    assert len(logged) == 1, logged
    assert logged[0]["replica"] == vllm.url and logged[0]["status"] == 401
    assert "sends none" in logged[0]["reason"] and "upstream.apiKey" in logged[0]["hint"]
    assert "HOLDBACK_GATEWAY_UPSTREAM_API_KEY" in logged[0]["hint"]


def test_the_configured_key_goes_on_every_call_and_the_replica_is_identified_once():
    async def main():
        async with FakeVllm(api_key="vk") as vllm, gateway([vllm.url], "upstream: {apiKey: vk}\n") as (gw, url):
            for _ in range(4):
                await gw.pool.scrape_all()
            async with httpx.AsyncClient() as client:
                streamed = await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
                listed = await client.get(url + "/v1/models")
            return vllm, gw.pool.replicas[0], streamed, listed

    vllm, replica, streamed, listed = asyncio.run(main())
    assert replica.healthy and replica.model == "tiny" and replica.max_model_len == 512
    assert streamed.status_code == 200 and streamed.content == CHAT_SSE
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "tiny"
    paths = {path for path, _auth in vllm.calls}
    assert {"/health", "/metrics/", "/v1/models", "/version", "/tokenize", "/v1/chat/completions"} <= paths
    assert {auth for _path, auth in vllm.calls} == {"Bearer vk"}
    # Identified at the first health check; the scrapes after it do not ask again (the passthrough list is one).
    assert vllm.count("/v1/models") == 2 and vllm.count("/version") == 1


def test_a_replicas_own_key_the_environment_key_and_a_rejected_key_named_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="gateway")

    async def main():
        async with FakeVllm(api_key="a-key") as a, FakeVllm(api_key="b-key") as b, FakeVllm(api_key="c-key") as c:
            config = (f"upstream:\n  replicaKeys:\n    {a.url}/: {{key_env: A_KEY}}\n"
                      f"    {c.url}: {{key: wrong}}\n")
            env = {"A_KEY": "a-key", "HOLDBACK_GATEWAY_UPSTREAM_API_KEY": "b-key"}
            async with gateway([a.url, b.url, c.url], config, env) as (gw, url):
                return [(r.healthy, r.model, r.unauthorized) for r in gw.pool.replicas], c.url

    states, c_url = asyncio.run(main())
    assert states[0] == (True, "tiny", None)  # its own key, from A_KEY
    assert states[1] == (True, "tiny", None)  # the one for all, from the environment
    assert states[2][0] is False and "rejects the key from upstream.replicaKeys" in states[2][2]
    logged = events(caplog, "replica_unauthorized")
    assert [e["replica"] for e in logged] == [c_url]
    assert logged[0]["hint"].startswith(f"set upstream.replicaKeys[{c_url!r}] (key)")


def test_a_reload_with_the_key_puts_the_refused_replica_back():
    async def main():
        async with FakeVllm(api_key="vk") as vllm, gateway([vllm.url]) as (gw, url):
            assert not gw.pool.replicas[0].healthy
            gw.pools.configure(parse_config(f"replicas: [{vllm.url}]\nupstream: {{apiKey: vk}}\n", "t", {}))
            await gw.pool.check_all()
            replica = gw.pool.replicas[0]
            async with httpx.AsyncClient() as client:
                answer = await client.post(url + "/v1/chat/completions", json=CHAT)
            return replica, answer

    replica, answer = asyncio.run(main())
    assert replica.healthy and replica.unauthorized is None and replica.model == "tiny"
    assert answer.status_code == 200


def test_the_upstream_key_settings_are_validated_and_resolved():
    loaded = parse_config("upstream: {apiKey: file-key, replicaKeys: {'http://a:8000/': {keyEnv: K}}}\n", "t",
                          {"K": "own"})
    assert loaded.replica_key("http://a:8000") == "own" == loaded.replica_key("http://a:8000/v1/models")
    assert loaded.replica_key("http://b:8000") == "file-key"
    assert loaded.replica_key_source("http://b:8000") == "upstream.apiKey"
    env = parse_config("upstream: {apiKey: file-key}\n", "t", {"HOLDBACK_GATEWAY_UPSTREAM_API_KEY": "env-key"})
    assert env.replica_key("http://b") == "env-key" and env.upstream_key_source == "$HOLDBACK_GATEWAY_UPSTREAM_API_KEY"
    unset = parse_config("upstream: {replicaKeys: {'http://a': {key_env: UNSET}}}\n", "t", {})
    assert unset.replica_key("http://a") is None and "UNSET" in unset.skipped_key_envs
    with pytest.raises(ConfigError, match="exactly one of `key` or `key_env`"):
        parse_config("upstream: {replicaKeys: {'http://a': {}}}\n", "t", {})
    with pytest.raises(ConfigError, match="must be a replica's http"):
        parse_config("upstream: {replicaKeys: {'a:8000': {key: k}}}\n", "t", {})


def test_calibration_sends_the_key_and_says_so_when_it_is_missing():
    from gateway.calibration import measure

    async def main():
        async with FakeVllm(api_key="vk") as vllm:
            refused = None
            try:
                await asyncio.to_thread(measure, vllm.url, "cpu", 0)
            except RuntimeError as exc:
                refused = str(exc)
            profile = await asyncio.to_thread(measure, vllm.url, "cpu", 0, 10.0, "vk")
            return refused, profile

    refused, profile = asyncio.run(main())
    assert refused is not None and "wants an API key" in refused and "--api-key" in refused
    assert (profile.model, profile.model_root, profile.num_gpu_blocks, profile.block_size) == (
        "tiny", "/tmp/tiny", 16384, 128)


# -- item: a replica that dies before the first byte -----------------------------------------------------------
def test_realtime_requests_whose_replica_dies_before_answering_go_to_the_healthy_one(caplog):
    caplog.set_level(logging.INFO, logger="gateway")

    async def main():
        async with FakeVllm(dies=True) as dead, FakeVllm() as alive, gateway(
                [dead.url, alive.url], "health: {intervalSeconds: 30}\n") as (gw, url):
            headers = {"x-llm-d-inference-objective": "realtime"}
            async with httpx.AsyncClient(timeout=30) as client:
                answers = await asyncio.gather(*(client.post(url + "/v1/chat/completions", headers=headers,
                                                             json={**CHAT, "stream": i % 2 == 0})
                                                 for i in range(12)))
            fc = gw.controller
            held = {u: t.reserved_tokens if hasattr(t, "reserved_tokens") else t.reserved_blocks
                    for u, t in fc.ledger.by_replica.items()}
            return dead, alive, answers, gw.pool.replicas, fc.in_flight, held, len(fc.ledger.active)

    dead, alive, answers, replicas, in_flight, held, active = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.status_code != 200]
    assert {a.headers["x-holdback-replica"] for a in answers} == {alive.url}
    assert dead.count("/v1/chat/completions") >= 1  # some went there first ...
    assert not replicas[0].healthy  # ... and it was taken out at once
    assert [r.in_flight for r in replicas] == [0, 0] and in_flight == 0  # every slot came back
    assert active == 0 and not any(held.values()), held  # and every KV reservation, wherever it moved
    assert events(caplog, "upstream_moved")


def test_with_no_replica_left_the_request_that_reached_a_dying_one_gets_502_and_releases_its_slot():
    async def main():
        async with FakeVllm(dies=True) as a, FakeVllm(dies=True) as b, gateway(
                [a.url, b.url], "health: {intervalSeconds: 30}\n") as (gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(url + "/v1/chat/completions", json=CHAT)
            return answer, a.count("/v1/chat/completions") + b.count("/v1/chat/completions"), gw.controller

    answer, sent, fc = asyncio.run(main())
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_error"
    assert sent == 2  # the first replica, then once more to the other
    assert fc.in_flight == 0 and not fc.ledger.active


# -- item: embeddings where no replica serves them ---------------------------------------------------------------
def test_a_callers_priority_never_reaches_the_replica():
    """Under vLLM's priority scheduling a caller's priority would outrank realtime: the gateway owns the order."""
    async def main():
        async with FakeVllm() as replica, gateway([replica.url]) as (_gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(url + "/v1/chat/completions", json={**CHAT, "priority": -100},
                                      headers={"X-Vllm-Priority": "-100"})
            return r, replica.bodies, replica.headers

    answer, bodies, headers = asyncio.run(main())
    assert answer.status_code == 200, answer.text
    assert "priority" not in bodies[0] and bodies[0]["messages"] == CHAT["messages"]
    assert "x-vllm-priority" not in {k.lower() for k in headers[0]}


def test_a_priority_replica_gets_the_gateways_priority_in_vllms_order_and_an_fcfs_one_none():
    async def main():
        async with FakeVllm() as prio, FakeVllm() as fcfs, gateway(
                [prio.url, fcfs.url], f"engine: {{replicas: {{{prio.url}: {{schedulingPolicy: priority}}}}}}\n"
                "anonymous: {enabled: true, objectives: [realtime, batch]}\n") as (_gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                for objective in ("realtime", "batch") * 4:
                    r = await client.post(url + "/v1/chat/completions", json={**CHAT, "priority": -100},
                                          headers={"x-llm-d-inference-objective": objective,
                                                   "X-Vllm-Priority": "-1000"})
                    assert r.status_code == 200, r.text
            return prio.headers, fcfs.headers, prio.bodies + fcfs.bodies

    prio, fcfs, bodies = asyncio.run(main())
    lower = [{k.lower(): v for k, v in h.items()} for h in prio]
    sent = {(h["x-llm-d-inference-objective"], h.get("x-vllm-priority")) for h in lower}
    assert prio and sent <= {("realtime", "-100"), ("batch", "10")}, sent  # vLLM runs lower values first
    assert fcfs and all("x-vllm-priority" not in {k.lower() for k in h} for h in fcfs)
    assert all("priority" not in b for b in bodies)


def test_an_embedding_on_a_priority_replica_carries_the_gateways_priority_in_its_body():
    """vLLM's pooling endpoints read a request's priority from its body only (never `X-Vllm-Priority`), so an
    embedding sent with the header alone ran at priority 0 in the replica's queue: ahead of batch, behind
    nothing. The caller's own `priority` is still never sent; an fcfs replica gets none (vLLM refuses one)."""
    async def main():
        async with FakeVllm(embeds=True) as prio, FakeVllm(embeds=True) as fcfs, gateway(
                [prio.url, fcfs.url], f"engine: {{replicas: {{{prio.url}: {{schedulingPolicy: priority}}}}}}\n"
                "anonymous: {enabled: true, objectives: [realtime, batch]}\n") as (_gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                for objective in ("realtime", "batch") * 4:
                    r = await client.post(url + "/v1/embeddings", json={"model": "tiny", "input": "hi",
                                                                          "priority": -1000},
                                          headers={"x-llm-d-inference-objective": objective})
                    assert r.status_code == 200, r.text
            return (list(zip(prio.bodies, prio.headers)), list(zip(fcfs.bodies, fcfs.headers)))

    prio, fcfs = asyncio.run(main())
    sent = {(h["x-llm-d-inference-objective"], b.get("priority")) for b, h in prio}
    assert prio and sent <= {("realtime", -100), ("batch", 10)}, sent  # vLLM runs lower values first
    assert fcfs and all("priority" not in b for b, _h in fcfs)
    assert all(b["input"] == "hi" for b, _h in prio + fcfs)


def test_a_replica_behind_a_path_is_asked_under_that_path():
    """`http://host/vllm-a` (a replica behind a reverse proxy's route): health checks and scrapes went under the
    path while inference went to the host's root, and every request answered 404."""
    async def main():
        async with FakeVllm(prefix="/vllm-a") as replica, gateway([replica.url]) as (_gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                answers = [await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream})
                           for stream in (False, True)]
            return answers, replica

    answers, replica = asyncio.run(main())
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert replica.count("/v1/chat/completions") == 2 and replica.count("/health") >= 1


def test_a_replica_whose_own_queue_is_full_is_passed_over_and_a_full_pool_answers_429_saturated(caplog):
    caplog.set_level(logging.INFO, logger="gateway")

    async def main():
        async with FakeVllm(full=True) as full, FakeVllm() as free, gateway(
                [full.url, free.url], "health: {intervalSeconds: 30}\n") as (gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                moved = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=CHAT)
                                               for _ in range(6)))
                free.full = True
                refused = await client.post(url + "/v1/chat/completions", json=CHAT)
            return full.count("/v1/chat/completions"), moved, refused, gw.pool.replicas, gw.controller.in_flight

    tried_full, moved, refused, replicas, in_flight = asyncio.run(main())
    assert [a.status_code for a in moved] == [200] * 6 and tried_full >= 1
    assert {a.headers["x-holdback-replica"] for a in moved} == {replicas[1].url}
    assert refused.status_code == 429 and refused.headers[DROP_REASON_HEADER] == DropReason.SATURATED.value
    assert refused.headers["Retry-After"] and "own queue is full" in refused.json()["error"]["message"]
    assert all(r.healthy for r in replicas) and in_flight == 0  # a full queue is not a failed replica
    assert events(caplog, "replica_full")


def test_embeddings_on_a_generation_pool_answer_an_openai_error_saying_what_to_change():
    async def main():
        async with FakeVllm() as vllm, gateway([vllm.url]) as (gw, url):
            async with httpx.AsyncClient(timeout=30) as client:
                first = await client.post(url + "/v1/embeddings", json={"model": "tiny", "input": "hello"})
                second = await client.post(url + "/v1/embeddings", json={"model": "tiny", "input": "again"})
            return vllm.count("/v1/embeddings"), first, second, gw.controller.in_flight

    sent, first, second, in_flight = asyncio.run(main())
    for answer in (first, second):
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "embeddings_not_served")
        assert "serve no embeddings model" in error["message"] and "embedding model" in error["message"]
        assert "'tiny'" in error["message"]
    assert sent == 1  # learnt from the replica's 404 once, then answered by the gateway
    assert in_flight == 0


def test_only_fastapis_own_404_means_no_embeddings_route():
    from gateway.bodies import route_not_found

    assert route_not_found(json.dumps(ERRORS["embeddings_on_generation_server_404"]).encode())
    assert not route_not_found(json.dumps(ERRORS["unknown_model_404"]).encode())  # the caller's model name
    assert not route_not_found(b"not json")


# -- item: cache salts vLLM accepts -----------------------------------------------------------------------------
def test_every_salt_sent_is_at_most_128_characters_and_embeddings_are_salted_too():
    from gateway.cache_salt import MAX_SALT_LENGTH, PUBLIC_PREFIX, private_salt, salted_body

    def salt(own: str | None, path: str = "/v1/chat/completions", scope: str | None = None) -> str | None:
        doc = {"messages": []} if own is None else {"messages": [], "cache_salt": own}
        return json.loads(salted_body(json.dumps(doc).encode(), path, scope, doc)).get("cache_salt")

    longest = "s" * 128  # what vLLM itself accepts from a caller
    hashed = salt(longest)
    assert len(hashed) <= MAX_SALT_LENGTH and hashed.startswith(PUBLIC_PREFIX)
    assert hashed == salt(longest) != salt("s" * 127 + "t"), "deterministic, and distinct salts stay distinct"
    assert salt("x" * 121) == PUBLIC_PREFIX + "x" * 121  # fits: kept as it is
    assert len(salt("x" * 122)) <= MAX_SALT_LENGTH
    assert not set(salt("a/b@c")) & set("@/\\\x00"), "vLLM refuses these characters"
    assert len(private_salt("t" * 500, 7)) <= MAX_SALT_LENGTH
    assert salt(None, "/v1/embeddings", private_salt("tenant-a", 1)) == private_salt("tenant-a", 1)
    assert salt("mine", "/v1/embeddings") == PUBLIC_PREFIX + "mine"


# -- item: streamed tokens as vLLM counts them -----------------------------------------------------------------
class _Ledger:
    def revision_due(self, res) -> int:  # noqa: ANN001
        return 10**9


class _Controller:
    def __init__(self) -> None:
        self.ledger = _Ledger()
        self.revisions: list[tuple[int, bool]] = []

    def revise(self, req, tokens: int, done: bool = False) -> None:  # noqa: ANN001
        self.revisions.append((tokens, done))


def stream_count(data: bytes, chunks: list[bytes] | None = None) -> tuple[int, list[tuple[int, bool]]]:
    from gateway.stream_tokens import StreamTokenCount

    from types import SimpleNamespace

    from gateway.flow.request import Lease
    from gateway.replicas import Replica

    controller = _Controller()
    req = SimpleNamespace(lease=Lease(Replica("http://replica"), 0.0))
    counter = StreamTokenCount(controller, req, None)  # type: ignore[arg-type]
    for chunk in chunks if chunks is not None else [e + b"\n\n" for e in data.split(b"\n\n") if e]:
        counter.count(chunk)
        # The lease follows every chunk (a victim policy reads it), not only the revisions.
        assert req.lease.tokens_relayed == counter.tokens
    return counter.tokens, controller.revisions


def test_streamed_tokens_are_vllms_usage_count_not_the_events():
    tokens, revisions = stream_count(CHAT_SSE)
    assert CHAT_SSE.count(b"data: {") == 6  # a head event with no token, four tokens, the usage event
    assert tokens == 4 and revisions[-1] == (4, True)
    # Several tokens in one event, and an empty one: the count follows usage.completion_tokens.
    many = (b'data: {"choices":[{"delta":{"content":"abc"}}],"usage":{"completion_tokens":3}}\n\n'
            b'data: {"choices":[{"delta":{"content":""}}],"usage":{"completion_tokens": 4}}\n\n')
    assert stream_count(b"", [many])[0] == 4
    # One relayed chunk may end inside the number: it is read from the next one.
    cut = [b'data: {"usage":{"completion_tokens":1', b'2}}\n\ndata: {"usage":{"completion_tokens":13}}\n\n']
    assert stream_count(b"", cut)[0] == 13


def test_without_usage_in_the_stream_each_event_is_a_token_until_the_final_usage():
    events_ = [e + b"\n\n" for e in COMPLETION_SSE.split(b"\n\n") if e]
    tokens, revisions = stream_count(b"", events_[:3])  # three text events, no usage (include_usage only)
    assert tokens == 3 and revisions[-1] == (3, True)
    assert stream_count(COMPLETION_SSE)[0] == 3  # the final usage event is no token


def test_a_replica_refused_after_a_vllm_upgrade_is_told_how_to_measure_it_again(caplog):
    """A profile measured on 0.32 refuses an upgraded replica; the log line says what to run, against which
    replica, and the way back without a profile, and a replica that matches again is taken back."""
    from gateway.calibration import Profile
    from gateway.flow.replica_checks import refuse_unmeasured

    caplog.set_level(logging.INFO, logger="gateway")
    profile = Profile("tiny", "0.32.0", "cpu", 16384, 128, 512, 0.0)
    replica = Replica("http://gpu-box:8000", model="tiny", runtime_version="0.34.0")
    assert refuse_unmeasured(profile, replica, "profile.json") is True
    assert replica.refused == "runtime '0.34.0' differs from the profile's '0.32.0'"
    [refused] = [r for r in caplog.records if r.getMessage() == "calibration_refused"]
    hint = refused.fields["hint"]
    for words in ("holdback gateway calibrate --replica http://gpu-box:8000", "admission.calibrationProfile",
                  "SIGHUP", "admission.safetyFactor"):
        assert words in hint, hint
    assert refuse_unmeasured(profile, replica, "profile.json") is False, "one line per change, not per check"
    replica.runtime_version = "0.32.0"
    assert refuse_unmeasured(profile, replica, "profile.json") is True and replica.refused is None
