"""The evictor: victim order, deficit-based sizing, strictly-lower priority, stop-and-wait pacing."""

import pytest

from gateway.eviction import BandDemand, Evictor
from gateway.request import FlowRequest


def inflight(name, priority, dispatched_at):
    r = FlowRequest(name, "x", priority, "t", "t", arrived=0.0)
    r.dispatched_at = dispatched_at
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


def test_deficit_sizing_one_when_exactly_at_the_ceiling():
    e = Evictor(max_per_decision=2)
    for i in range(8):
        e.track(inflight(f"b{i}", -10, float(i)))
    d = e.decide(1.0, BANDS, 100, tracked_in_flight=8, now=10.0)
    assert len(d.victims) == 1 and d.deficit == pytest.approx(0.0)


def test_deficit_sizing_capped_per_decision():
    e = Evictor(max_per_decision=2)
    for i in range(8):
        e.track(inflight(f"b{i}", -10, float(i)))
    # Saturation 1.5 with 12 tracked: credit 0.125, deficit 0.5 -> 4 wanted, capped at 2.
    d = e.decide(1.5, BANDS, 100, tracked_in_flight=12, now=10.0)
    assert len(d.victims) == 2
    assert d.credit == pytest.approx(0.125)


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
