"""A replica's engine slots learned from its metrics (engine.learnMaxNumSeqs) while maxNumSeqs is unset: vLLM
does not report --max-num-seqs, so a replica keeping requests waiting while its KV is mostly free is read as
running all it may. Units on the scrape sequence, then the gateway against a simulator with 4 slots over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.replicas import Replica
from gateway.slot_learning import LEARN_SECONDS
from gateway.settings import parse_config
from tests.gateway.test_gateway_sim import wait_until

A = "http://127.0.0.1:9100"


def replica(engine: str = "{}") -> Replica:
    r = Replica(A)
    r.take_engine(parse_config(f"replicas: [{A}]\nengine: {engine}\n", "t").config.engine.of(A))
    return r


class Scrapes:
    """Scrapes of one replica a quarter second apart."""

    def __init__(self, r: Replica):
        self.r, self.t = r, 100.0

    def __call__(self, running: float, waiting: float, kv: float = 0.1) -> bool:
        self.t += 0.25
        r = self.r
        r.running, r.waiting, r.kv_usage, r.kv_usage_max = running, waiting, kv, kv
        return r.see_slots(self.t)

    def full_for(self, seconds: float, running: float, waiting: float = 2, kv: float = 0.1) -> list[bool]:
        return [self(running, waiting, kv) for _ in range(round(seconds / 0.25))]


def test_slots_are_learned_when_the_same_number_runs_while_requests_wait_for_two_seconds():
    r = replica()
    scrape = Scrapes(r)
    assert r.capacity is None and r.max_num_seqs is None
    seen = scrape.full_for(LEARN_SECONDS + 0.25, 8)
    assert seen[:-1] == [False] * (len(seen) - 1) and seen[-1]  # learned at the first scrape 2 s on
    assert (r.learned_slots, r.max_num_seqs, r.capacity) == (8, 8, 8)
    assert not scrape(8, 5)  # seen again: nothing changes


def test_the_queue_allowance_counts_beyond_learned_slots():
    r = replica("{queueAllowance: 2}")
    assert r.capacity is None  # saturation.maxConcurrency until the slots are known
    Scrapes(r).full_for(LEARN_SECONDS + 0.25, 8)
    assert (r.learned_slots, r.max_num_seqs, r.capacity) == (8, 8, 10)
    r.forget_slots()  # down: it may come back with other flags
    assert (r.max_num_seqs, r.capacity) == (None, None)


def test_a_moment_with_nothing_waiting_neither_starts_nor_ends_a_run():
    # Ten requests on eight slots: whenever two end before their clients send the next, none waits for a moment.
    r = replica()
    scrape = Scrapes(r)
    assert not any([scrape(8, 0), scrape(8, 0)])  # nothing waited yet: no run starts
    scrape.full_for(1.0, 8)
    scrape(8, 0)
    scrape(8, 1)
    scrape(8, 0)
    assert r.learned_slots is None
    assert any(scrape.full_for(0.75, 8))  # 2 s after the first scrape at which requests waited
    assert r.learned_slots == 8
    r = replica()
    scrape = Scrapes(r)
    scrape.full_for(1.0, 8)
    assert not any(scrape.full_for(3.0, 8, waiting=0))  # a run needs requests waiting at its end too
    assert r.learned_slots is None


def test_kv_half_used_or_another_running_count_starts_again():
    r = replica()
    scrape = Scrapes(r)
    scrape.full_for(1.5, 8)
    scrape(8, 3, kv=0.9)  # waiting for KV, not for a slot
    scrape.full_for(1.5, 8)
    scrape(7, 3)  # one ended and its slot is not refilled at the next scrape either: no slot limit pins the count
    scrape(7, 3)
    scrape.full_for(1.75, 8)
    assert r.learned_slots is None
    assert any(scrape.full_for(0.5, 8))
    assert r.learned_slots == 8


def test_one_scrape_between_a_steps_finishes_and_the_next_refill_does_not_end_a_run():
    """vLLM takes its numbers after a step's finished requests left its slots and before the next step gives them
    to the waiting ones: a scrape may show fewer running while requests wait for that moment."""
    r = replica()
    scrape = Scrapes(r)
    scrape.full_for(1.0, 8)
    scrape(7, 3)
    scrape.full_for(0.5, 8)
    scrape(5, 4)  # another such moment, not the scrape after the last one
    assert r.learned_slots is None
    assert any(scrape.full_for(0.5, 8))  # 2 s after the run began
    assert r.learned_slots == 8


def test_a_moment_with_nothing_running_or_waiting_neither_starts_nor_ends_a_run():
    """A fast engine finishes what it runs before the clients' next requests reach it: for a moment it runs
    nothing, with ten requests in flight on the way to it and back."""
    r = replica()
    scrape = Scrapes(r)
    scrape.full_for(1.0, 8)
    assert not scrape(0, 0, kv=0.0)
    assert not scrape(3, 0)
    assert r.learned_slots is None
    assert any(scrape.full_for(0.75, 8))
    assert r.learned_slots == 8
    r = replica()
    scrape = Scrapes(r)
    assert not any(scrape.full_for(3.0, 0, waiting=0))  # nothing ever waited: nothing is learned
    assert r.learned_slots is None


def test_requests_waiting_while_fewer_run_than_once_did_teach_nothing():
    """A replica read between steps (the simulator) shows arrivals as waiting, and a step's token budget
    queues prefills: neither pins the running count at the most the replica has run."""
    r = replica()
    scrape = Scrapes(r)
    scrape(32, 0)  # a burst ran 32 at once
    assert not any(scrape.full_for(10, 6, waiting=1))
    assert r.learned_slots is None and r.capacity is None


def test_a_larger_running_count_raises_learned_slots_and_they_never_shrink():
    r = replica()
    scrape = Scrapes(r)
    scrape.full_for(2.25, 7)
    assert r.capacity == 7
    assert not scrape(5, 0)
    assert scrape(8, 0)  # vLLM never runs more than its slots: 8 ran
    assert r.capacity == 8


def test_running_alone_teaches_nothing():
    r = replica()
    scrape = Scrapes(r)
    assert not any(scrape.full_for(5, 8, waiting=0))
    assert r.learned_slots is None and r.capacity is None


def test_maxnumseqs_set_wins_and_learning_can_be_turned_off():
    r = replica("{maxNumSeqs: 4, queueAllowance: 1}")
    Scrapes(r).full_for(3, 8)
    assert (r.max_num_seqs, r.capacity) == (4, 5)
    r = replica("{learnMaxNumSeqs: false}")
    Scrapes(r).full_for(3, 8)
    assert (r.max_num_seqs, r.capacity) == (None, None)
    per_replica = replica(f"{{replicas: {{{A}: {{learnMaxNumSeqs: false}}}}}}")
    Scrapes(per_replica).full_for(3, 8)
    assert per_replica.capacity is None


def test_a_replica_that_went_down_is_learned_again():
    r = replica()
    Scrapes(r).full_for(3, 8)
    r.forget_slots()
    assert (r.learned_slots, r.capacity) == (None, None)
    Scrapes(r).full_for(3, 4)  # restarted with fewer slots: the most it ran is forgotten too
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
