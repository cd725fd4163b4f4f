"""The evictor: victim order, deficit-based sizing, strictly-lower priority, stop-and-wait pacing."""

from dataclasses import replace
import pytest

from gateway.flow.eviction import BandDemand, Evictor
from gateway.flow.request import Ask, FlowRequest, Lease
from gateway.replicas import Replica


def inflight(name, priority, dispatched_at):
    r = FlowRequest(Ask(request_id=name, objective="x", priority=priority, fairness_id="t", tenant="t", arrived=0.0))
    r.lease = Lease(Replica("http://replica"), dispatched_at)
    r.seq = int(dispatched_at * 100)
    return r


BANDS = [BandDemand(100, 1.0, 3), BandDemand(0, 0.75, 0), BandDemand(-10, 0.5, 5)]


def test_only_sheddable_requests_are_candidates():
    e = Evictor()
    e.track(inflight("std", 0, 1.0))
    e.track(inflight("rt", 100, 1.0))
    assert not e.candidates


def test_victims_lowest_priority_first_then_newest():
    e = Evictor(max_per_decision=2)
    old = inflight("old", -10, 1.0)
    new = inflight("new", -10, 2.0)
    lowest = inflight("lowest", -20, 0.5)
    for r in (old, new, lowest):
        e.track(r)
    d = e.decide(1.25, BANDS, blocked_priority=100, tracked_in_flight=16, now=5.0)
    assert [v.request_id for v in d.victims] == ["lowest", "new"]
    assert d.demand_priority == 100


def test_at_a_whole_pool_ceiling_sizing_follows_the_queue():
    # Realtime's ceiling is 1.0, so at a full pool its deficit is 0: one victim per queued request instead.
    e = Evictor(max_per_decision=2)
    for i in range(8):
        e.track(inflight(f"b{i}", -10, float(i)))
    one_queued = [BandDemand(100, 1.0, 1), *BANDS[1:]]
    d = e.decide(1.0, one_queued, 100, tracked_in_flight=8, now=10.0)
    assert len(d.victims) == 1 and d.deficit == pytest.approx(0.0)
    e = Evictor(max_per_decision=2)
    for i in range(8):
        e.track(inflight(f"b{i}", -10, float(i)))
    d = e.decide(1.0, BANDS, 100, tracked_in_flight=8, now=10.0)  # 3 queued: 3 wanted, capped at 2
    assert len(d.victims) == 2 and d.deficit == pytest.approx(0.0)


def test_deficit_sizing_capped_per_decision():
    e = Evictor(max_per_decision=2)
    for i in range(8):
        e.track(inflight(f"b{i}", -10, float(i)))
    # Saturation 1.5 with 12 tracked: credit 0.125, deficit 0.5 -> 4 wanted, capped at 2.
    d = e.decide(1.5, BANDS, 100, tracked_in_flight=12, now=10.0)
    assert len(d.victims) == 2
    assert d.credit == pytest.approx(0.125)


def test_capacity_on_loan_comes_back_in_one_decision():
    # A 48-slot pool: batch holds 40 against a floor of 0.5 (24 slots), so 16 are on loan.
    def evictor():
        e = Evictor(max_per_decision=2)
        for i in range(40):
            e.track(inflight(f"b{i:02d}", -10, float(i)))
        return e

    def bands(rt_queued, floor):
        return [BandDemand(100, 1.0, rt_queued, 8), BandDemand(0, 1.0, 0), BandDemand(-10, 0.9, 0, 40, floor)]

    d = evictor().decide(1.0, bands(20, 0.5), 100, tracked_in_flight=48, now=50.0)
    assert len(d.victims) == 16  # the whole loan, not maxPerDecision
    assert [v.request_id for v in d.victims[:2]] == ["b39", "b38"]  # still in the policy's order
    d = evictor().decide(1.0, bands(5, 0.5), 100, tracked_in_flight=48, now=50.0)
    assert len(d.victims) == 5  # no more than the queue asks for
    d = evictor().decide(1.0, bands(20, None), 100, tracked_in_flight=48, now=50.0)
    assert len(d.victims) == 2  # floor = ceiling 0.9 (43 slots): nothing on loan, the cap holds


def test_borrowed_requests_count_only_bands_below_the_demand():
    from gateway.flow.eviction import borrowed_requests

    bands = [BandDemand(100, 1.0, 0, 30, 0.0), BandDemand(0, 0.75, 0, 10, 0.1), BandDemand(-10, 0.5, 0, 30, 0.25)]
    # credit 1/48: band 0's floor allows 4 (holds 10: 6 borrowed), band -10's allows 12 (holds 30: 18).
    assert borrowed_requests(bands, 100, 1 / 48) == 24
    assert borrowed_requests(bands, 0, 1 / 48) == 18
    assert borrowed_requests(bands, -10, 1 / 48) == 0
    assert borrowed_requests(bands, 100, 0.0) == 0


def test_never_evicts_at_or_above_the_demand_priority():
    e = Evictor()
    e.track(inflight("b", -10, 1.0))
    bands = [BandDemand(-10, 0.5, 4)]
    assert e.decide(0.9, bands, blocked_priority=-10, tracked_in_flight=4, now=1.0) is None


def test_no_decision_without_queued_demand_or_below_ceiling():
    e = Evictor()
    e.track(inflight("b", -10, 1.0))
    assert e.decide(1.0, [BandDemand(100, 1.0, 0)], 100, 4, 1.0) is None
    assert e.decide(0.9, [BandDemand(100, 1.0, 2)], 100, 4, 1.0) is None
    assert e.decide(1.0, [BandDemand(100, 0.0, 2)], 100, 4, 1.0) is None  # zero-ceiling band never demands


def test_lower_blocked_band_can_demand_when_above_victims():
    e = Evictor()
    e.track(inflight("b", -10, 1.0))
    bands = [BandDemand(100, 1.0, 0), BandDemand(0, 0.75, 2), BandDemand(-10, 0.5, 0)]
    d = e.decide(0.8, bands, blocked_priority=100, tracked_in_flight=4, now=1.0)
    assert d is not None and d.demand_priority == 0


def test_stop_and_wait_until_confirmed_plus_grace():
    e = Evictor(max_per_decision=1, grace=0.01)
    for i in range(3):
        e.track(inflight(f"b{i}", -10, float(i)))
    d1 = e.decide(1.0, BANDS, 100, 8, now=1.0)
    assert e.decide(1.0, BANDS, 100, 8, now=1.5) is None  # first victim not closed yet
    assert e.confirm(d1.victims[0], now=1.6) == pytest.approx(0.6)
    assert e.decide(1.0, BANDS, 100, 8, now=1.605) is None  # inside the grace
    d2 = e.decide(1.0, BANDS, 100, 8, now=1.62)
    assert d2 is not None and d2.victims[0] is not d1.victims[0]


def test_unconfirmed_victims_time_out_and_reopen_the_gate():
    e = Evictor(confirmation_timeout=10.0, grace=0.0)
    e.track(inflight("b", -10, 1.0))
    e.track(inflight("c", -10, 2.0))
    d = e.decide(1.0, BANDS, 100, 8, now=0.0)
    assert e.expire(now=5.0) == []
    assert e.expire(now=10.5) == d.victims
    assert e.gate_open(now=10.5)
    assert e.confirm(d.victims[0], now=11.0) is None  # late confirmation is not counted twice


def test_the_none_policy_never_evicts_and_policies_see_read_only_views():
    from gateway.policies.victims import NoEviction, VictimCandidate, victim_policy

    e = Evictor(policy=NoEviction())
    e.track(inflight("b", -10, 1.0))
    assert e.decide(1.25, BANDS, blocked_priority=100, tracked_in_flight=4, now=5.0) is None
    seen = []

    class Spy:
        name = "spy"

        def order(self, candidates, now):
            seen.extend(candidates)
            return list(candidates)

    e = Evictor(policy=Spy())
    e.track(inflight("b", -10, 1.0))
    e.decide(1.25, BANDS, blocked_priority=100, tracked_in_flight=4, now=5.0)
    assert [type(c) for c in seen] == [VictimCandidate]
    with pytest.raises(AttributeError):
        seen[0].priority = 100  # frozen: a policy cannot change the request
    with pytest.raises(ValueError, match="newest-first"):
        victim_policy("random")


def test_kv_excess_takes_victims_on_that_replica_until_their_reservations_cover_it():
    from gateway.flow.ledger import KvLedger

    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    here, there = Replica("http://here"), Replica("http://there")
    e = Evictor(max_per_decision=3)
    reqs = []
    for name, replica, blocks, at in (("a", here, 30, 1.0), ("b", here, 30, 2.0), ("c", there, 90, 3.0),
                                      ("d", here, 30, 0.5)):
        r = inflight(name, -10, at)
        r.lease = Lease(replica, at)
        r.lease.reservation = ledger.reserve(request_id=name, fairness_id="t", traffic_class="batch", priority=-10,
                                       replica="x", prompt_tokens=blocks * 16, max_new_tokens=0, now=0.0)
        e.track(r)
        reqs.append(r)
    victims = e.decide_kv(here, excess_blocks=45, grace=0.1, now=5.0)
    assert [v.request_id for v in victims] == ["b", "a"]  # newest first, 60 blocks >= 45; never "c" elsewhere
    assert e.decide_kv(here, excess_blocks=10, grace=0.1, now=5.0) == []  # stop-and-wait: victims pending


def test_each_named_policy_orders_the_same_pool_its_own_way():
    from gateway.policies.victims import POLICIES, VictimCandidate, victim_policy

    def cand(name, priority, started_at, *, streaming, resumable, output):
        return VictimCandidate(
            request_id=name, fairness_id="t", priority=priority, objective="x", replica="r", started_at=started_at,
            enqueued_at=started_at, deadline=None, prompt_tokens=100, max_new_tokens=256, output_tokens=output,
            streaming_started=streaming, resumable=resumable, cached_prefix_tokens=0, tenant_over_soft_quota=0.0,
            reserved_blocks=20, seq=int(started_at))

    pool = [cand("low", -20, 10.0, streaming=True, resumable=False, output=50),
            cand("old_quiet", -10, 20.0, streaming=False, resumable=True, output=0),
            cand("new_streaming", -10, 90.0, streaming=True, resumable=False, output=200),
            cand("interactive", 0, 95.0, streaming=False, resumable=False, output=0)]
    expected = {
        "none": [],
        # Lowest priority, then the most recently dispatched; any priority (the evictor filters by demand).
        "newest-first": ["low", "new_streaming", "old_quiet", "interactive"],
        # Refill unknown here (0 for all): as newest-first.
        "least-refill": ["low", "new_streaming", "old_quiet", "interactive"],
        # Lowest priority, then the cheapest loss: quiet resumable work before a stream that decoded 200
        # tokens it cannot resume; interactive work only above the hard watermark.
        "cost-ranked": ["low", "old_quiet", "new_streaming"],
    }
    assert set(expected) == set(POLICIES), "a new named policy needs its order here"
    for name, order in expected.items():
        assert [c.request_id for c in victim_policy(name).order(pool, 100.0)] == order, name


@pytest.mark.parametrize("name, victim", [("newest-first", "batch-new"), ("least-refill", "batch-new"),
                                          ("cost-ranked", "batch-quiet")])
def test_the_configured_policy_picks_the_controllers_victim(name, victim):
    import asyncio

    from gateway.flow.request import DropReason
    from tests.gateway.test_flow_control import controller, req

    async def main():
        fc, clock = controller(f"usageLimit: {{policy: static, threshold: 1.0}}\n"
                               f"eviction: {{policy: {name}, maxPerDecision: 1}}", max_concurrency=2)
        quiet, new = req(fc, clock, "batch"), req(fc, clock, "batch")
        quiet.ask, new.ask = replace(quiet.ask, request_id="batch-quiet"), replace(new.ask, request_id="batch-new")
        fc.submit(quiet)
        clock.t += 1.0
        fc.submit(new)
        new.leased().streaming_started = True  # the newer one has begun to stream; the older one has not
        fc.submit(req(fc, clock, "realtime"))
        fc.cycle()
        assert [r.request_id for r in (quiet, new) if r.drop_reason is DropReason.EVICTED] == [victim]
    asyncio.run(main())



def test_least_refill_evicts_the_request_with_the_fewest_tokens_past_a_whole_block_first():
    """vLLM's prefix cache keeps a resumed request's whole blocks: its eviction costs the tokens past them."""
    from gateway.flow.eviction import refill_tokens
    from gateway.flow.ledger import KvLedger
    from gateway.policies.victims import victim_policy

    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    here = Replica("http://here")
    e = Evictor(policy=victim_policy("least-refill"), max_per_decision=1)
    # (name, prompt, output relayed, resumable, dispatched at): 100 + 30 = 130 is 2 past 128 (8 blocks of 16);
    # 100 + 40 = 140 is 12 past; 100 + 28 = 128 is 0 past, but it cannot resume: all 128 are computed again.
    for name, prompt, relayed, resumable, at in (("twelve-past", 100, 40, True, 3.0), ("two-past", 100, 30, True, 1.0),
                                                 ("restart", 100, 28, False, 4.0)):
        r = inflight(name, -10, at)
        r.ask = replace(r.ask, resumable=resumable)
        r.lease = Lease(here, at)
        r.lease.reservation = ledger.reserve(request_id=name, fairness_id="t", traffic_class="batch", priority=-10,
                                             replica=here.url, prompt_tokens=prompt, max_new_tokens=200, now=at)
        r.lease.tokens_relayed = relayed
        e.track(r)
    assert sorted(refill_tokens(r) for r in e.candidates) == [2, 12, 128]
    decision = e.decide(1.25, BANDS, blocked_priority=100, tracked_in_flight=4, now=5.0)
    assert [v.request_id for v in decision.victims] == ["two-past"]  # not the newest: it refills 12 more tokens


def test_least_refill_without_the_relays_count_prefers_the_request_that_reached_a_block_last():
    """A relay in another process revises only at a block boundary: the latest to reach one is fewest past it."""
    from gateway.policies.victims import VictimCandidate, victim_policy

    def cand(name, started_at, reached_at):
        return VictimCandidate(
            request_id=name, fairness_id="t", priority=-10, objective="x", replica="r", started_at=started_at,
            enqueued_at=started_at, deadline=None, prompt_tokens=127, max_new_tokens=256, output_tokens=1,
            streaming_started=True, resumable=True, cached_prefix_tokens=0, tenant_over_soft_quota=0.0,
            reserved_blocks=3, seq=int(started_at), refill_tokens=0, block_reached_at=reached_at)

    pool = [cand("reached-early", 5.0, 6.0), cand("reached-late", 1.0, 9.0), cand("evicted-before", 0.5, 9.5)]
    pool[2] = replace(pool[2], evictions=1)
    assert [c.request_id for c in victim_policy("least-refill").order(pool, 10.0)] == [
        "reached-late", "reached-early", "evicted-before"]
