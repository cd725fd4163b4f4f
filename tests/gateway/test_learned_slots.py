"""A replica's engine slots learned from its metrics (engine.learnMaxNumSeqs) while maxNumSeqs is unset: vLLM
does not report --max-num-seqs, so a replica keeping requests waiting while its KV is mostly free is read as
running all it may. Units on the scrape sequence, then the gateway against a simulator with 4 slots over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.config import parse_config
from gateway.replicas import LEARN_SIGHTINGS, Replica
from tests.gateway.test_gateway_sim import wait_until

A = "http://127.0.0.1:9100"


def replica(engine: str = "{}") -> Replica:
    r = Replica(A)
    r.take_engine(parse_config(f"replicas: [{A}]\nengine: {engine}\n", "t").config.engine.of(A))
    return r


def scrape(r: Replica, running: float, waiting: float, kv: float = 0.1) -> bool:
    r.running, r.waiting, r.kv_usage, r.kv_usage_max = running, waiting, kv, kv
    return r.see_slots()


def test_slots_are_learned_from_three_full_scrapes_in_a_row():
    r = replica()
    assert r.capacity is None and r.max_num_seqs is None
    for _ in range(LEARN_SIGHTINGS - 1):
        assert not scrape(r, 8, 5)
        assert r.capacity is None
    assert scrape(r, 8, 5)
    assert (r.learned_slots, r.max_num_seqs, r.capacity) == (8, 8, 8)
    assert not scrape(r, 8, 5)  # seen again: nothing changes


def test_a_scrape_without_waiting_or_with_kv_half_used_breaks_the_run():
    r = replica()
    scrape(r, 8, 5)
    scrape(r, 8, 5)
    scrape(r, 8, 0)  # nothing waits: the replica may have room
    scrape(r, 8, 5)
    scrape(r, 8, 5)
    assert r.learned_slots is None
    scrape(r, 6, 5, kv=0.9)  # waiting for KV, not for a slot
    scrape(r, 8, 5)
    scrape(r, 8, 5)
    assert r.learned_slots is None
    assert scrape(r, 8, 5)
    assert r.learned_slots == 8


def test_the_most_running_in_the_run_is_learned_and_a_larger_running_count_raises_it():
    r = replica()
    scrape(r, 6, 3)
    scrape(r, 7, 3)
    assert scrape(r, 5, 3)  # a step's token budget spent: fewer run for a moment
    assert r.capacity == 7  # vLLM never runs more than its slots: 7 ran
    assert not scrape(r, 5, 0)  # fewer running, nothing waiting: learned slots never shrink
    assert scrape(r, 8, 0)  # 8 running is a floor whatever waits
    assert r.capacity == 8


def test_running_alone_teaches_nothing_until_slots_were_learned():
    r = replica()
    for _ in range(5):
        assert not scrape(r, 8, 0)
    assert r.learned_slots is None and r.capacity is None


def test_maxnumseqs_set_wins_and_learning_can_be_turned_off():
    r = replica("{maxNumSeqs: 4, queueAllowance: 1}")
    for _ in range(LEARN_SIGHTINGS):
        scrape(r, 8, 5)
    assert (r.max_num_seqs, r.capacity) == (4, 5)
    r = replica("{learnMaxNumSeqs: false}")
    for _ in range(LEARN_SIGHTINGS):
        scrape(r, 8, 5)
    assert (r.max_num_seqs, r.capacity) == (None, None)
    per_replica = replica(f"{{replicas: {{{A}: {{learnMaxNumSeqs: false}}}}}}")
    for _ in range(LEARN_SIGHTINGS):
        scrape(per_replica, 8, 5)
    assert per_replica.capacity is None


def test_a_replica_that_went_down_is_learned_again():
    r = replica()
    for _ in range(LEARN_SIGHTINGS):
        scrape(r, 8, 5)
    r.forget_slots()
    assert (r.learned_slots, r.capacity) == (None, None)
    for _ in range(LEARN_SIGHTINGS):
        scrape(r, 4, 5)
    assert r.capacity == 4


def test_the_gateway_learns_a_simulators_slots_and_queues_the_rest_itself(stack):
    """A simulator running 4 at once; the gateway at maxConcurrency 12 sends it 12 long requests, sees 8 wait
    inside it, learns 4 slots and keeps every later request in its own queue."""
    sim, = stack.sim(1, "--max-num-seqs", "4", "--decode-base-ms", "20")
    gw = stack.gateway([sim], "saturation: {maxConcurrency: 12}\nusageLimit: {policy: static, threshold: 1.0}\n"
                       "metrics: {scrapeIntervalSeconds: 0.1}\nadmission: {enabled: false}\n")
    body = {"model": "sim-model", "prompt": "a a a", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            async def hold() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
            tasks = [asyncio.create_task(hold()) for _ in range(12)]
            try:
                state = await wait_until(lambda: gw.state()["replicas"][0]["slots_learned"] and gw.state(),
                                         timeout=30)
                rep = state["replicas"][0]
                assert rep["max_num_seqs"] == 4 and rep["limit"] == 4
                more = [asyncio.create_task(hold()) for _ in range(3)]
                tasks += more
                # The three new requests wait in the gateway: its capacity there is the learned 4.
                await wait_until(lambda: gw.state()["queued"] == 3, timeout=30)
                assert "replica_slots_learned" in gw.log()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
