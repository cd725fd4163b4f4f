"""KV admission against a real vLLM whose KV pool runs out before its slots do (issue #47): 40 blocks of 128
tokens under a 2,048-token context, 8 slots. One engine for the module. Through the gateway with admission on,
the three outcomes of the KV policy are vLLM's own: a request that cannot fit now waits at most
`queueDeadlineMs` and is refused with its drop reason, one that can never fit is refused at once saying why, and
a load that makes vLLM alone preempt (its own `vllm:num_preemptions_total`) runs without a preemption.

Prompts are token ids (vLLM's completions accept them), so each request's KV need is exact: a request of P prompt
and O output tokens holds ceil((P + O) / 128) blocks at its end. Each request is a tenant of its own and eviction
is off: what is under test is the pool, not the quotas.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from typing import AsyncIterator

import httpx
import pytest

from bench.lib.engines import KV_BOUND_BLOCKS, KV_BOUND_CONTEXT
from holdback.contract import FAIRNESS_HEADER, OBJECTIVE_HEADER
from tests.real_vllm.conftest import SECOND_CPU, VllmServer
from tests.support import in_process_gateway, poll

pytestmark = pytest.mark.e2e

BLOCK = 128  # the CPU backend's KV block
SLOTS = 8
# Admission as shipped but its queue deadline; no eviction. Each request names a tenant of its own (the fairness
# header): one tenant's requests are held to its share of the pool (tenantMaxShare) and refused as its quota at
# once, which is not what is under test.
CONFIG = """anonymous: {enabled: true, objectives: [realtime, batch], defaultObjective: batch, relaysTenants: true}
saturation: {detector: concurrency, maxConcurrency: %(slots)d}
engine: {maxNumSeqs: %(slots)d}
eviction: {enabled: false}
admission: {enabled: true, queueDeadlineMs: %(deadline_ms)d}
"""


TENANTS = itertools.count()


def config(deadline_ms: int) -> str:
    return CONFIG % {"slots": SLOTS, "deadline_ms": deadline_ms}


@pytest.fixture(scope="module")
def kv_bound(tmp_path_factory) -> VllmServer:
    logs = tmp_path_factory.mktemp("vllm-kv-bound")
    server = VllmServer(logs / "kv-bound.log", cpu=SECOND_CPU, context=KV_BOUND_CONTEXT,
                        args=("--max-num-seqs", str(SLOTS), "--num-gpu-blocks-override", str(KV_BOUND_BLOCKS)))
    try:
        yield server.start().wait_ready()
    finally:
        server.stop()


def body(seed: int, prompt: int, output: int, **extra) -> dict:
    rng = random.Random(seed)
    return {"model": "tiny", "prompt": [rng.randrange(10, 400) for _ in range(prompt)], "max_tokens": output,
            "ignore_eos": True, **extra}


def idle(server: VllmServer) -> None:
    def empty() -> bool:
        m = server.metrics()
        return m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
    poll(empty, 120, "the engine to run nothing", server.log_tail)


async def send(client: httpx.AsyncClient, url: str, request: dict, objective: str = "batch") -> tuple[httpx.Response, float, float]:
    """The answer, when it was sent and when it came (monotonic)."""
    sent = time.monotonic()
    headers = {OBJECTIVE_HEADER: objective, FAIRNESS_HEADER: f"tenant-{next(TENANTS)}"}
    r = await client.post(f"{url}/v1/completions", json=request, headers=headers)
    return r, sent, time.monotonic()


def ledger(url: str, replica: str) -> dict:
    """The gateway's KV ledger on `replica` (/admin/state), {} before the gateway has scraped its pool."""
    state = httpx.get(f"{url}/admin/state", timeout=10).json()
    return ((state.get("kv") or {}).get("replicas") or {}).get(replica) or {}


@contextlib.asynccontextmanager
async def gateway(server: VllmServer, deadline_ms: int) -> AsyncIterator[str]:
    """A gateway in front of `server` (in this process), once its ledger knows the replica's pool."""
    async with in_process_gateway([server.url], config(deadline_ms)) as (_, url):
        await asyncio.to_thread(poll, lambda: ledger(url, server.url).get("total_blocks"), 60,
                                "the ledger to know the replica's pool")
        yield url


def test_a_request_that_cannot_fit_now_waits_its_queue_deadline_and_is_refused_with_its_reason(kv_bound):
    """Two realtime requests of 2,000 tokens (16 blocks each) hold 32 of the 36 blocks any request may fill (0.92
    of 40); a third waits for KV room for queueDeadlineMs (1.5 s) and is answered 429 rejected-kv-capacity while
    the two still run. Without admission vLLM runs the third at once (its prompt fits the 8 free blocks)."""
    idle(kv_bound)
    deadline_ms = 1500

    async def run():
        async with gateway(kv_bound, deadline_ms) as url, httpx.AsyncClient(timeout=300) as client:
            fillers = [asyncio.create_task(send(client, url, body(i, 900, 1100), "realtime")) for i in range(2)]
            await asyncio.to_thread(poll, lambda: kv_bound.metrics().get("vllm:num_requests_running", 0) >= 2,
                                    60, "both fillers to run in vLLM")
            third = await send(client, url, body(2, 900, 1100), "realtime")
            return third, await asyncio.gather(*fillers)

    (third, sent, answered), fillers = asyncio.run(run())
    assert third.status_code == 429, third.text
    assert third.headers["x-llm-d-request-dropped-reason"] == "rejected-kv-capacity", third.text
    error = third.json()["error"]
    assert error["code"] == "rejected-kv-capacity" and "queueDeadlineMs" in error["message"], error
    waited = answered - sent
    # It waited its deadline, not less (it was queued, not refused) and not unbounded (a loaded machine's slack).
    assert deadline_ms / 1000 - 0.1 <= waited <= deadline_ms / 1000 + 5.0, waited
    assert all(r.status_code == 200 for r, _, _ in fillers), [r.text[:200] for r, _, _ in fillers]
    # The KV it waited for was still held when it was refused: the fillers ended after.
    assert min(done for _, _, done in fillers) > answered, "a filler ended before the refusal: the pool had room"


def test_a_request_that_can_never_fit_is_refused_at_once_saying_why(kv_bound):
    """On an empty pool: three sequences of 1,000 output tokens on a 1,000-token prompt need 32 blocks, more than
    the 30 a batch request may hold; four of 1,048 need 41, more than realtime's 36 (0.92 of 40). Both are refused
    at once with the blocks asked and allowed, which vLLM alone would run. The figures are the replica's own (its
vllm:cache_config_info: 40 blocks of 128 tokens), not the configured default (16-token blocks, 52 GiB)."""
    idle(kv_bound)
    deadline_ms = 20000

    async def run():
        async with gateway(kv_bound, deadline_ms) as url, httpx.AsyncClient(timeout=300) as client:
            return (await send(client, url, body(3, 1000, 1000, n=3)),
                    await send(client, url, body(4, 1000, 1048, n=4), objective="realtime"))

    for (r, sent, answered), asked, allowed in zip(asyncio.run(run()), (32, 41), (30, 36)):
        assert r.status_code == 400, r.text[:300]  # retrying cannot help
        assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-kv-capacity-never-fits"
        message = r.json()["error"]["message"]
        assert f"needs {asked} KV blocks of {BLOCK} tokens" in message, message
        assert f"at most {allowed} of a replica's {KV_BOUND_BLOCKS} blocks" in message, message
        assert "lower max_tokens or shorten the prompt" in message, message
        assert answered - sent < deadline_ms / 1000 / 4, "refused at once, not after queueing"


def test_no_preemption_through_admission_where_vllm_alone_preempts(kv_bound):
    """Six requests of 700 prompt and 500 output tokens (10 blocks each at their end): sent straight to vLLM,
    their prompts all fit (36 of 40 blocks) and vLLM runs all six, then preempts as they grow. Through the
    gateway three run at a time (batch's 30 blocks) and the engine never preempts; all six are served."""
    idle(kv_bound)

    def preemptions() -> float:
        return kv_bound.metrics().get("vllm:num_preemptions_total", 0.0)

    async def load(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            answers = await asyncio.gather(*(send(client, url, body(10 + i, 700, 500)) for i in range(6)))
        return [r for r, _, _ in answers]

    before = preemptions()
    alone = asyncio.run(load(kv_bound.url))
    assert all(r.status_code == 200 for r in alone)
    preempted_alone = preemptions() - before
    assert preempted_alone > 0, "the load must make vLLM alone preempt, or the test shows nothing"
    idle(kv_bound)

    async def through_gateway() -> list[httpx.Response]:
        async with gateway(kv_bound, 60000) as url:
            return await load(url)

    before = preemptions()
    answers = asyncio.run(through_gateway())
    assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
    assert preemptions() - before == 0, f"vLLM preempted through admission (alone: {preempted_alone:.0f})"
