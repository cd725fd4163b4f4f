"""Cached-first dispatch (gateway/flow/cached_first.py): a batch request whose prefix runs (or just ran) on the
replica with room goes before the head of its flow, within the lookahead, never past the flow whose turn it is,
and never more than `lookahead` times past one request."""

import asyncio
import itertools
from dataclasses import replace

import httpx
import pytest

from gateway.flow.band import FlowQueue
from gateway.flow.cached_first import CachedPrefixes, wants_prefix
from gateway.flow.interface import Outcome
from gateway.flow.request import Ask, FlowRequest, Status
from gateway.settings import parse_config
from tests.gateway.test_flow_control import PRIO, controller
from tests.gateway.test_gateway_sim import body, obj, wait_until

# Two documents' prefixes, as gateway/bodies.py `prefix_blocks` would chain them: no block in common.
DOC_A, DOC_B = (11, 12, 13, 14), (21, 22, 23, 24)
STRICT = "usageLimit: {policy: static, threshold: 1.0}\neviction: {enabled: false}\n"
_ids = itertools.count(1)


def ask(clock, prefix=(), objective="batch", fid="t"):
    return FlowRequest(Ask(request_id=f"{objective}-{next(_ids)}", objective=objective, priority=PRIO[objective],
                           fairness_id=fid, tenant=fid, arrived=clock(), prefix=tuple(prefix)))


def run(coro):
    return asyncio.run(coro)


def test_what_runs_and_the_last_that_ended_count_as_cached_and_older_ones_do_not():
    cached = CachedPrefixes()
    cached.ran("r1", DOC_A)
    assert cached.held("r1", DOC_A) == 4 and cached.held("r2", DOC_A) == 0
    assert cached.held("r1", DOC_A[:2] + (99, 14)) == 2  # the first block missing ends the run
    cached.ended("r1", DOC_A, 600, keep=2)
    assert cached.held("r1", DOC_A) == 4  # just ended: vLLM keeps its blocks until the pool needs them
    cached.ran("r1", DOC_B)
    cached.ended("r1", DOC_B, 600, keep=2)
    cached.ran("r1", (31, 32))
    cached.ended("r1", (31, 32), 300, keep=2)
    assert cached.held("r1", DOC_A) == 0 and cached.held("r1", DOC_B) == 4  # two more ended since A
    cached.trim("r1", 900)  # B and (31, 32) still fit in the free KV
    assert cached.held("r1", DOC_B) == 4
    cached.trim("r1", 899)  # no longer: B, freed longest ago, is handed out first
    assert cached.held("r1", DOC_B) == 0 and cached.held("r1", (31, 32)) == 2
    cached.trim("r1", 0)
    assert not cached.knows("r1")
    cached.ran("r1", DOC_A)
    cached.moved("r1", "r2", DOC_A)  # its replica refused the connection: it runs on r2
    assert cached.held("r2", DOC_A) == 4 and cached.held("r1", DOC_A) == 0
    assert cached.held("r1", ()) == 0


def test_first_walks_a_flows_queue_in_order_without_taking_and_steps_over_what_left():
    queue = FlowQueue("t")
    reqs = [ask(lambda: 1000.0) for _ in range(20)]
    for i, r in enumerate(reversed(reqs)):  # pushed out of order: the keys decide
        r.status = Status.QUEUED
        queue.push((len(reqs) - 1 - i,), r)
    reqs[1].status = Status.FINISHED  # left (withdrawn, expired): still in the heap
    assert queue.first(5) == [reqs[0], reqs[2], reqs[3], reqs[4], reqs[5]]
    assert queue.count == 20 and queue.head()[1] is reqs[0]


def test_a_queued_request_whose_prefix_runs_on_the_replica_goes_before_the_head():
    async def main():
        fc, clock = controller(STRICT, max_concurrency=2)
        running = [ask(clock, DOC_A), ask(clock, DOC_B)]
        assert [fc.submit(r) for r in running] == [Outcome.DISPATCHED] * 2
        b1, b2, a1 = ask(clock, DOC_B), ask(clock, DOC_B), ask(clock, DOC_A)
        for r in (b1, b2, a1):
            assert fc.submit(r) is Outcome.QUEUED
        fc.finish(running[1])  # B ended; A still runs: both count as cached, the head (B) goes
        fc.cycle()
        assert b1.status is Status.DISPATCHED and fc.tally.cached_first == 0
        fc.finish(running[0])
        fc.finish(b1)
        fc.cycle()  # two slots: B's other question first (its turn), then A's, in order
        assert b2.status is Status.DISPATCHED and a1.status is Status.DISPATCHED
        assert fc.tally.cached_first == 0 and fc.snapshot()["totals"]["cached_first"] == 0
    run(main())


def test_the_one_sharing_a_prefix_goes_first_and_with_a_lookahead_of_0_the_order_is_kept():
    async def main():
        for lookahead, first in ((32, "a"), (0, "c")):
            fc, clock = controller(STRICT + f"flowControl: {{cachedFirstLookahead: {lookahead}}}\n",
                                   max_concurrency=1)
            running = ask(clock, DOC_A)
            assert fc.submit(running) is Outcome.DISPATCHED
            queued = {"c": ask(clock, (41, 42)), "d": ask(clock, ()), "a": ask(clock, DOC_A[:3] + (15,))}
            for r in queued.values():
                assert fc.submit(r) is Outcome.QUEUED
            fc.finish(running)  # it ended a moment ago: its blocks are still cached
            fc.cycle()
            assert [k for k, r in queued.items() if r.status is Status.DISPATCHED] == [first], lookahead
            assert fc.tally.cached_first == (1 if lookahead else 0)
            assert queued["c"].passed_over == (1 if lookahead else 0)
            assert fc.bands[-10].queued == 2 and fc.total_queued == 2
            fc.finish(queued[first])
            fc.cycle()  # nothing else shares a block: the band's own order again
            assert queued["c" if first == "a" else "d"].status is Status.DISPATCHED
    run(main())


def test_a_request_passed_over_lookahead_times_goes_next_whatever_is_cached():
    async def main():
        fc, clock = controller(STRICT + "flowControl: {cachedFirstLookahead: 2}\n", max_concurrency=1)
        running = ask(clock, DOC_A)
        assert fc.submit(running) is Outcome.DISPATCHED
        head = ask(clock, DOC_B)
        sharing = [ask(clock, DOC_A) for _ in range(3)]
        for r in (head, *sharing):
            assert fc.submit(r) is Outcome.QUEUED
        order = []
        current = running
        for _ in range(4):
            fc.finish(current)
            fc.cycle()
            (current,) = [r for r in (head, *sharing) if r.status is Status.DISPATCHED]
            order.append(current)
        assert order == [sharing[0], sharing[1], head, sharing[2]]
        assert head.passed_over == 2 and fc.tally.cached_first == 2
    run(main())


def test_what_ended_counts_while_the_replicas_free_kv_holds_it():
    # 100 KV blocks of 16 tokens (tests/gateway/test_kv_wait_eviction.py's pool).
    kv = ("admission: {enabled: true, kvPoolBlocks: 100, tenantMaxShare: 1.0, tenantSoftShare: 1.0}\n" + STRICT)

    def sized(clock, objective, blocks, prefix=()):
        r = ask(clock, prefix, objective=objective, fid=objective)
        r.ask = replace(r.ask, prompt_tokens=blocks * 16 - 16, max_new_tokens=16)
        return r

    async def main(realtime_blocks: int) -> str:
        fc, clock = controller(kv, max_concurrency=2)
        doc, other = sized(clock, "batch", 32, DOC_A), sized(clock, "batch", 5)
        assert [fc.submit(r) for r in (doc, other)] == [Outcome.DISPATCHED] * 2
        fc.finish(doc)  # its 31 blocks of prompt are cached, free
        assert fc.submit(sized(clock, "realtime", realtime_blocks)) is Outcome.DISPATCHED
        head, sharing = sized(clock, "batch", 5, DOC_B), sized(clock, "batch", 5, DOC_A)
        assert [fc.submit(r) for r in (head, sharing)] == [Outcome.QUEUED] * 2
        fc.finish(other)
        fc.cycle()
        return "sharing" if sharing.status is Status.DISPATCHED else "head"

    # Realtime took 40 blocks: 60 free hold the document's 31. It took 70: 30 free, the document's blocks were
    # handed out again (vLLM gives the ones freed longest ago first), so nothing is cached and the head goes.
    assert asyncio.run(main(40)) == "sharing"
    assert asyncio.run(main(70)) == "head"


def test_an_evicted_requests_retry_and_a_prompt_of_unknown_blocks_are_not_passed_over():
    async def main(head_kind: str) -> bool:
        fc, clock = controller(STRICT, max_concurrency=1)
        running = ask(clock, DOC_A)
        assert fc.submit(running) is Outcome.DISPATCHED
        head = ask(clock, () if head_kind == "token ids" else DOC_B)
        sharing = ask(clock, DOC_A)
        assert [fc.submit(r) for r in (head, sharing)] == [Outcome.QUEUED] * 2
        if head_kind == "evicted retry":
            head.evictions = 1  # what submit's restore_place sets for the retry of an evicted request
        fc.finish(running)
        fc.cycle()
        return head.status is Status.DISPATCHED

    # The workers resume an evicted request from its token ids (no text, so no blocks known): passed over up to
    # the lookahead, it waited while the blocks it had just computed were handed out again.
    assert asyncio.run(main("token ids"))
    assert asyncio.run(main("evicted retry"))
    assert not asyncio.run(main("new"))


def test_only_the_flow_whose_turn_it_is_is_looked_at_and_realtime_keeps_its_order():
    async def main():
        fc, clock = controller(STRICT + "flowControl: {bands: [{priority: -10, fairness: round-robin}]}\n",
                               max_concurrency=2)  # two slots: the last two that ended count as cached
        running = ask(clock, DOC_A, fid="acme")
        assert fc.submit(running) is Outcome.DISPATCHED
        assert fc.submit(ask(clock, fid="other")) is Outcome.DISPATCHED  # holds the other slot throughout
        acme = [ask(clock, DOC_B, fid="acme"), ask(clock, (61, 62), fid="acme")]
        globex = [ask(clock, (51, 52), fid="globex"), ask(clock, DOC_A, fid="globex")]  # blocks alike, by design
        for r in (*acme, *globex):
            assert fc.submit(r) is Outcome.QUEUED
        fc.finish(running)
        fc.cycle()
        # acme's turn (round-robin from the first id): globex's cached request does not take it.
        assert acme[0].status is Status.DISPATCHED and all(r.status is Status.QUEUED for r in globex)
        fc.finish(acme[0])
        fc.cycle()
        # globex's turn: within globex, the request whose prefix is cached goes first.
        assert globex[1].status is Status.DISPATCHED and globex[0].status is Status.QUEUED
        assert fc.tally.cached_first == 1

        fc, clock = controller(STRICT, max_concurrency=1)
        running = ask(clock, DOC_A, objective="realtime")
        assert fc.submit(running) is Outcome.DISPATCHED
        first, sharing = ask(clock, DOC_B, objective="realtime"), ask(clock, DOC_A, objective="realtime")
        for r in (first, sharing):
            assert fc.submit(r) is Outcome.QUEUED
        fc.finish(running)
        fc.cycle()
        assert first.status is Status.DISPATCHED and fc.tally.cached_first == 0
    run(main())


def test_prefixes_are_computed_for_batch_requests_and_for_every_request_under_prefix_affinity_or_admission():
    shipped = parse_config("replicas: []\n", "test").config  # KV admission on: every request's prefix
    assert wants_prefix(shipped, -10) and wants_prefix(shipped, 100)
    cached_first = parse_config("replicas: []\nadmission: {enabled: false}\n", "test").config
    assert wants_prefix(cached_first, -10) and not wants_prefix(cached_first, 100)
    off = parse_config("replicas: []\nadmission: {enabled: false}\nflowControl: {cachedFirstLookahead: 0}\n",
                       "test").config
    assert not wants_prefix(off, -10)
    affinity = parse_config("replicas: []\nadmission: {enabled: false}\nflowControl: {cachedFirstLookahead: 0}\n"
                            "picker: {policy: prefix-affinity}\n", "test").config
    assert wants_prefix(affinity, 100) and wants_prefix(affinity, -10)


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_through_the_gateway_the_question_about_the_document_just_run_goes_first(stack):
    """Over HTTP, one slot: a batch request about document A runs; two about B, then one about A, wait. When A's
    ends, the one about A goes first (its blocks were just computed), then B's in order; with
    `cachedFirstLookahead: 0`, the order of arrival. The relays of `--workers 2` send the blocks with the request."""
    documents = {d: f"Document {d}: " + " ".join(f"word{d}x{i}" for i in range(300)) for d in "AB"}

    async def order(gw) -> list[str]:
        finished: list[str] = []

        async def call(client, name: str, max_tokens: int) -> None:
            r = await client.post("/v1/completions", json=body(max_tokens, f"{documents[name[0]]}\n{name}?"),
                                  headers=obj("batch"))
            assert r.status_code == 200, r.text
            finished.append(name)

        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            running = asyncio.create_task(call(client, "A0", 7000))  # cancelled long before its end
            await wait_until(lambda: gw.band(-10)["in_flight"] == 1, 60, what=gw.state)
            waiting = []
            for i, name in enumerate(("B1", "B2", "A1")):  # one at a time: their order in the queue is this
                waiting.append(asyncio.create_task(call(client, name, 2)))
                await wait_until(lambda: gw.band(-10)["queued"] == i + 1, 60, what=gw.state)
            running.cancel()  # its client leaves: the slot frees, A's blocks were just computed
            await asyncio.gather(running, return_exceptions=True)
            await asyncio.gather(*waiting)
        return finished

    # 30 ms a decode step: A0's 7,000 tokens take 3.5 minutes, far longer than queueing three requests takes.
    sims = stack.sim(1, "--enable-prefix-caching", "--decode-base-ms", "30")
    settings = "saturation: {maxConcurrency: 1}\nusageLimit: {policy: static}\neviction: {enabled: false}\n"
    gw = stack.gateway(sims, settings)
    assert asyncio.run(order(gw)) == ["A1", "B1", "B2"]  # one slot: completion order is dispatch order
    assert gw.state()["totals"]["cached_first"] == 1
    off = stack.gateway(sims, settings + "flowControl: {cachedFirstLookahead: 0}\n")
    assert asyncio.run(order(off)) == ["B1", "B2", "A1"]
    assert off.state()["totals"]["cached_first"] == 0
