"""Engine slots learned while the replica's KV is over half used (issue #47): flow control tells each replica the
prompts it sent there that have not answered yet, and a running count pinned while requests wait is read as a slot
limit when the free blocks hold the largest of them. Units on the scrape sequence and the flow side, then the
gateway against simulators: one whose slots bind with its KV over half used, one whose KV binds first."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx

from gateway.flow.interface import Outcome
from gateway.replicas import Replica
from gateway.slot_learning import LEARN_SECONDS
from tests.gateway.conftest import sim_metric
from tests.gateway.test_flow_control import controller, req
from tests.gateway.test_gateway_sim import obj, wait_until
from tests.gateway.test_learned_slots import Scrapes, replica


def pooled(prompts: list[int], blocks: int = 64) -> tuple[Replica, Scrapes]:
    """A replica of `blocks` 16-token KV blocks, sent requests of these prompt sizes that have not answered."""
    r = replica()
    r.num_gpu_blocks, r.kv_block_size = blocks, 16
    for prompt in prompts:
        r.sent(prompt)
    return r, Scrapes(r)


def scrape(r: Replica, scrapes: Scrapes, seconds: float, running: int, waiting: int, kv: float) -> list[bool]:
    out = []
    for _ in range(round(seconds / 0.25)):
        r.scrape_began()
        out.append(scrapes(running, waiting, kv))
    return out


# -- units --------------------------------------------------------------------------------------------------------
def test_slots_are_learned_with_kv_over_half_used_when_the_free_blocks_hold_the_waiting_prompts():
    # 60% of 64 blocks used: 25 free. Ten 200-token prompts sent (13 blocks each): 13 + 1 + a block for each of
    # the 8 running is 22, so the two waiting wait for a slot.
    r, scrapes = pooled([200] * 10)
    seen = scrape(r, scrapes, LEARN_SECONDS + 0.25, running=8, waiting=2, kv=0.6)
    assert seen[:-1] == [False] * (len(seen) - 1) and seen[-1]
    assert (r.learned_slots, r.max_num_seqs, r.capacity) == (8, 8, 8)


def test_slots_are_not_learned_when_the_free_blocks_do_not_hold_a_waiting_prompt():
    # 25 free blocks; a 400-token prompt needs 25 + 1 + 8.
    r, scrapes = pooled([200] * 9 + [400])
    assert not any(scrape(r, scrapes, 5, running=8, waiting=2, kv=0.6))
    assert r.learned_slots is None and r.capacity is None
    # Under half used too: 35 free blocks, and a 500-token prompt needs 32 + 1 + 8. Half the pool free said
    # nothing of a prompt needing more than that.
    r, scrapes = pooled([200] * 9 + [500])
    assert not any(scrape(r, scrapes, 5, running=8, waiting=2, kv=0.45))
    assert r.learned_slots is None


def test_a_moment_with_nothing_waiting_does_not_end_a_run_whatever_the_kv():
    r, scrapes = pooled([200] * 10)
    scrape(r, scrapes, 1.0, running=8, waiting=2, kv=0.6)
    scrape(r, scrapes, 0.25, running=8, waiting=0, kv=0.7)
    assert any(scrape(r, scrapes, 1.0, running=8, waiting=2, kv=0.6))
    assert r.learned_slots == 8


def test_the_half_used_rule_holds_when_the_waiting_requests_are_not_all_the_gateways():
    """More waiting than the gateway sent (another client's requests, preempted ones), a prompt only estimated, or
    nothing sent: their sizes are unknown, and only a KV at most half used says nothing waits for it."""
    for r, scrapes in (pooled([200]), pooled([200] * 9 + [0]), pooled([])):
        assert not any(scrape(r, scrapes, 5, running=8, waiting=2, kv=0.6))
        assert r.learned_slots is None
        assert any(scrape(r, scrapes, LEARN_SECONDS + 0.25, running=8, waiting=2, kv=0.4))
        assert r.learned_slots == 8


def test_a_request_that_answered_during_a_scrape_still_counts_for_it():
    # The scrape's numbers may be older than the answer: the largest prompt since the scrape began counts.
    r, _ = pooled([200] * 9 + [500])
    r.scrape_began()
    r.answered(500)
    r.running, r.waiting, r.kv_usage_max = 8, 2, 0.45
    assert not r.waits_for_no_kv(0.45, 8)
    r.scrape_began()
    assert r.waits_for_no_kv(0.45, 8) and r.awaited == {200: 9}


def test_flow_control_tells_the_replica_what_it_sent_until_each_answers_or_ends():
    async def main():
        fc, clock = controller("admission: {enabled: true, kvPoolBlocks: 1000, tenantMaxShare: 1.0}\n"
                               "usageLimit: {policy: static, threshold: 1.0}\n", max_concurrency=8)
        rep = fc.pool.replicas[0]
        sent = []
        for objective, prompt, exact in (("batch", 100, True), ("batch", 300, True), ("realtime", 50, False)):
            r = req(fc, clock, objective)
            r.ask = replace(r.ask, prompt_tokens=prompt, max_new_tokens=16, prompt_exact=exact)
            r.task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
            assert fc.submit(r) is Outcome.DISPATCHED
            sent.append(r)
        assert rep.awaited == {100: 1, 300: 1, 0: 1}  # an estimated prompt is told as unknown
        fc.started_streaming(sent[1])
        assert rep.awaited == {100: 1, 0: 1}
        fc.finish(sent[2])
        fc.finish(sent[1])  # answered already: told once
        assert rep.awaited == {100: 1}
        fc.finish(sent[0])
        assert not rep.awaited
        adopted = sent[1]  # as a new leader adopts a request that already streams (gateway/relays/takeover.py)
        adopted.lease.streaming_started = True
        fc.eviction.dispatched(adopted)
        assert not rep.awaited
        for r in sent:
            r.task.cancel()
    asyncio.run(main())


def test_without_kv_admission_no_prompt_is_told():
    async def main():
        fc, clock = controller("admission: {enabled: false}\n")
        r = req(fc, clock, "realtime")
        r.task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        assert fc.submit(r) is Outcome.DISPATCHED
        assert not fc.pool.replicas[0].awaited
        r.task.cancel()
    asyncio.run(main())


# -- against simulators -------------------------------------------------------------------------------------------
def words(n: int) -> str:
    """A prompt of `n` tokens in the simulator's tokenizer."""
    return " ".join(["a"] * n)


async def stream(client: httpx.AsyncClient, objective: str, prompt: int, max_tokens: int) -> None:
    body = {"model": "sim-model", "prompt": words(prompt), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers=obj(objective)) as resp:
        async for _ in resp.aiter_bytes():
            pass


def test_a_replica_whose_kv_is_over_half_used_has_its_slots_learned_and_realtime_waiting_there_evicts(stack):
    """8 slots and 64 blocks of 16 tokens, a 400 ms step. Nine batch requests of 66 prompt tokens and 14 output
    tokens hold 5 blocks each: 8 run (40 blocks, 62% used) for about 6 s and one waits for a slot. The gateway
    learns the 8 slots; a realtime request sent into the queue allowance waits inside the replica and gets a
    running batch request evicted (trigger waiting-in-replica)."""
    sim, = stack.sim(1, "--max-num-seqs", "8", "--num-blocks", "64", "--decode-base-ms", "400")
    gw = stack.gateway([sim], "saturation: {maxConcurrency: 12}\nusageLimit: {policy: static, threshold: 1.0}\n"
                       "metrics: {scrapeIntervalSeconds: 0.1}\nengine: {queueAllowance: 4}\n"
                       "admission: {tenantMaxShare: 1.0, tenantSoftShare: 1.0, interactiveReserve: 0.1}\n")

    def replica_state() -> dict:
        return gw.state()["replicas"][0]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            tasks = [asyncio.create_task(stream(client, "batch", 66, 14)) for _ in range(9)]
            try:
                await wait_until(lambda: sim_metric(sim, "vllm:num_requests_waiting") >= 1, timeout=30)
                state = await wait_until(lambda: (s := replica_state())["slots_learned"] and s, timeout=30,
                                         what=replica_state)
                assert state["max_num_seqs"] == 8 and state["kv_usage"] > 0.5, state
                tasks.append(asyncio.create_task(stream(client, "realtime", 5, 2)))
                await wait_until(lambda: gw.state()["totals"]["evictions"].get("issued", 0) >= 1, timeout=30,
                                 what=lambda: gw.state()["totals"])
                await asyncio.gather(tasks[-1])  # the realtime stream got its slot and ended
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        log = gw.log()
        assert "replica_slots_learned" in log
        assert "waiting-in-replica" in log, [line for line in log.splitlines() if '"evict"' in line]

    asyncio.run(scenario())


def test_a_replica_whose_kv_binds_first_never_learns_fewer_slots_than_it_runs(stack):
    """16 slots and 64 blocks. Another client's request holds 30 blocks (47% used) and runs; the gateway's
    560-token request (35 blocks) waits inside the replica for KV behind it, with one running and its KV under
    half used for seconds. That one running is no slot limit: nothing is learned."""
    sim, = stack.sim(1, "--max-num-seqs", "16", "--num-blocks", "64", "--decode-base-ms", "200")
    gw = stack.gateway([sim], "usageLimit: {policy: static, threshold: 1.0}\nmetrics: {scrapeIntervalSeconds: 0.5}\n"
                       "admission: {tenantMaxShare: 1.0, tenantSoftShare: 1.0, interactiveReserve: 0.1}\n")
    # Both reach the replica 300 ms after they were sent, the gateway's while its KV still looked empty.
    httpx.post(sim + "/admin/faults", json={"delay_ms": 300}).raise_for_status()

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=sim, timeout=60) as direct, \
                httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            tasks = [asyncio.create_task(stream(direct, "batch", 470, 60))]
            await asyncio.sleep(0)
            tasks.append(asyncio.create_task(stream(client, "standard", 560, 8)))
            try:
                await wait_until(lambda: sim_metric(sim, "vllm:num_requests_waiting") >= 1, timeout=30)
                await wait_until(lambda: gw.state()["replicas"][0]["waiting"], timeout=30)
                since = time.monotonic()  # a scrape before this showed the gateway's request waiting

                def scraped_later() -> dict | None:
                    # A scrape more than LEARN_SECONDS after that one: the half-used rule would have learned 1.
                    rep = gw.state()["replicas"][0]
                    at = time.monotonic() - rep["metrics_age_s"]
                    return rep if at > since + LEARN_SECONDS + 0.5 else None

                last = await wait_until(scraped_later, timeout=30)
                assert last["waiting"] == 1 and last["running"] == 1 and last["kv_usage"] <= 0.5, last
                assert not last["slots_learned"] and last["max_num_seqs"] is None, last
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        assert "replica_slots_learned" not in gw.log()

    asyncio.run(scenario())
