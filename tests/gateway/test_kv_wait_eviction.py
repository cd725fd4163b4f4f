"""A request above batch that KV admission keeps waiting evicts batch work for it (trigger `kv-wait`), as one
waiting for a request slot does: on the replica where the least must be freed, victims whose reservations
cover the shortfall, paced until the freed blocks show."""

from dataclasses import replace
import asyncio

from gateway.flow.interface import Outcome
from gateway.flow.request import DropReason, Status
from tests.gateway.test_flow_control import controller, req

# 100 KV blocks of 16 tokens; batch reserves at most 75 of them, realtime up to the hard watermark (92).
KV = ("admission: {enabled: true, kvPoolBlocks: 100, tenantMaxShare: 1.0, tenantSoftShare: 1.0}\n"
      "usageLimit: {policy: static}\neviction: {policy: newest-first, maxPerDecision: 2}\n")


def sized(fc, clock, objective, blocks):
    r = req(fc, clock, objective, fid=objective)  # each its own tenant: no share binds
    r.ask = replace(r.ask, prompt_tokens=blocks * 16 - 16, max_new_tokens=16)
    r.task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    clock.t += 0.01
    return r


def test_realtime_waiting_for_kv_evicts_the_batch_work_that_covers_it_and_no_more():
    async def main():
        fc, clock = controller(KV, max_concurrency=8)
        old, new, small = (sized(fc, clock, "batch", n) for n in (40, 25, 5))
        assert [fc.submit(r) for r in (old, new, small)] == [Outcome.DISPATCHED] * 3  # 70 of 75
        rt = sized(fc, clock, "realtime", 40)
        assert fc.submit(rt) is Outcome.QUEUED  # 70 + 40 > 92
        fc.cycle()
        # 18 blocks short: newest first, the 5-block request is not enough, the 25-block one covers the rest.
        assert small.drop_reason is DropReason.EVICTED and new.drop_reason is DropReason.EVICTED
        assert old.drop_reason is None and rt.status is Status.QUEUED
        assert fc.snapshot()["totals"]["evictions"]["issued"] == 2
        fc.cycle()  # nothing more while the victims' reservations are held
        assert old.drop_reason is None
        fc.finish(small)
        fc.finish(new)
        clock.t += 1.0  # past the grace in which the freed blocks show in a scrape
        fc.cycle()
        assert rt.status is Status.DISPATCHED and old.status is Status.DISPATCHED
        for r in (old, new, small, rt):
            r.task.cancel()
    asyncio.run(main())


def test_a_burst_waiting_for_kv_is_covered_in_one_decision_beyond_max_per_decision():
    async def main():
        fc, clock = controller(KV, max_concurrency=8)
        batch = [sized(fc, clock, "batch", 14) for _ in range(5)]
        assert [fc.submit(r) for r in batch] == [Outcome.DISPATCHED] * 5  # 70 of 75
        burst = [sized(fc, clock, "realtime", 30) for _ in range(2)]
        assert [fc.submit(r) for r in burst] == [Outcome.QUEUED] * 2  # 70 + 30 > 92
        fc.cycle()
        # Both need 70 + 60 - 92 = 38 blocks: three 14-block victims at once (maxPerDecision is 2), newest first.
        assert [r.drop_reason is DropReason.EVICTED for r in batch] == [False, False, True, True, True]
        for victim in batch[2:]:
            fc.finish(victim)
        clock.t += 1.0
        fc.cycle()
        assert [r.status for r in burst] == [Status.DISPATCHED] * 2
        for r in (*batch, *burst):
            r.task.cancel()
    asyncio.run(main())


def test_batch_waiting_for_kv_evicts_nothing_and_neither_does_realtime_that_no_batch_could_make_room_for():
    async def main():
        fc, clock = controller(KV, max_concurrency=8)
        held = sized(fc, clock, "batch", 70)
        assert fc.submit(held) is Outcome.DISPATCHED
        more = sized(fc, clock, "batch", 10)
        assert fc.submit(more) is Outcome.QUEUED  # 80 > 75: batch waits for batch
        fc.cycle()
        assert held.drop_reason is None
        rt = sized(fc, clock, "realtime", 20)
        assert fc.submit(rt) is Outcome.DISPATCHED  # 90 <= 92
        big = sized(fc, clock, "standard", 80)
        assert fc.submit(big) is Outcome.QUEUED  # 90 + 80 - 92 = 78 short, batch holds 70: evicting it would not do
        fc.cycle()
        assert held.drop_reason is None and fc.snapshot()["totals"]["evictions"].get("issued", 0) == 0
        for r in (held, more, rt, big):
            r.task.cancel()
    asyncio.run(main())


def test_with_eviction_off_realtime_waits_for_kv():
    async def main():
        fc, clock = controller(KV.replace("newest-first", "none"), max_concurrency=8)
        batch = sized(fc, clock, "batch", 70)
        assert fc.submit(batch) is Outcome.DISPATCHED
        rt = sized(fc, clock, "realtime", 40)
        assert fc.submit(rt) is Outcome.QUEUED
        fc.cycle()
        assert batch.drop_reason is None and rt.status is Status.QUEUED
        for r in (batch, rt):
            r.task.cancel()
    asyncio.run(main())


def test_realtime_runs_on_the_blocks_its_victims_held_before_a_scrape_shows_them_free():
    """The replica's reported KV usage says the batch holds the pool. The kv-wait trigger evicts for realtime; once
    the victims' reservations are released, realtime is dispatched at the next cycle, on what the victims held, and
    not a scrape later (the scraped usage still shows their blocks). The next scrape's figure counts again whole."""
    async def main():
        fc, clock = controller(KV, max_concurrency=8)
        [replica] = fc.pool.replicas
        old, new = (sized(fc, clock, "batch", n) for n in (40, 30))
        assert [fc.submit(r) for r in (old, new)] == [Outcome.DISPATCHED] * 2
        replica.kv_usage, replica.metrics_from = 0.85, clock.t  # a scrape: 85 of 100 blocks in use
        rt = sized(fc, clock, "realtime", 20)
        assert fc.submit(rt) is Outcome.QUEUED  # 85 + 20 > 92
        fc.cycle()
        assert new.drop_reason is DropReason.EVICTED and old.drop_reason is None
        fc.finish(new)  # its 30 blocks (29 of prompt) are released; no scrape since
        fc.cycle()
        assert rt.status is Status.DISPATCHED, "realtime waited for a scrape to show what its victim freed"
        assert fc.admission.freed_since_scrape(replica) == 29 * 16  # the victim's prompt, in whole blocks
        replica.metrics_from = clock.t + 0.1  # a scrape begun too soon after: it may not show them freed
        assert fc.admission.freed_since_scrape(replica) == 29 * 16
        replica.metrics_from = clock.t + 0.3  # one begun 0.25 s after: its figure is taken whole
        assert fc.admission.freed_since_scrape(replica) == 0
        for r in (old, new, rt):
            r.task.cancel()
    asyncio.run(main())


def test_the_next_realtime_waiting_for_kv_is_served_a_victim_as_soon_as_the_last_victims_closed():
    """No scrape-long pause between two kv-wait decisions: the first decision's victims closed and what they held is
    off the scraped usage, so a second realtime request arriving 50 ms later gets its own victim at once."""
    async def main():
        fc, clock = controller(KV, max_concurrency=8)
        [replica] = fc.pool.replicas
        batch = [sized(fc, clock, "batch", n) for n in (30, 20, 20)]
        assert [fc.submit(r) for r in batch] == [Outcome.DISPATCHED] * 3
        replica.kv_usage, replica.metrics_from = 0.72, clock.t  # a scrape: what the three hold
        first = sized(fc, clock, "realtime", 25)
        assert fc.submit(first) is Outcome.QUEUED  # 72 + 25 > 92
        fc.cycle()
        evicted = [r for r in batch if r.drop_reason is DropReason.EVICTED]
        assert len(evicted) == 1
        fc.finish(evicted[0])
        fc.cycle()
        assert first.status is Status.DISPATCHED
        clock.t += 0.05  # well inside a scrape interval, no scrape since
        second = sized(fc, clock, "realtime", 25)
        assert fc.submit(second) is Outcome.QUEUED
        fc.cycle()
        assert sum(r.drop_reason is DropReason.EVICTED for r in batch) == 2, "the second waited for a scrape"
        for r in (*batch, first, second):
            r.task.cancel()
    asyncio.run(main())
