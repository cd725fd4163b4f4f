"""The adaptive reserve: its demand forecast, its ceilings and the flow controller following it, on a set clock."""

import asyncio

import pytest

from gateway.flow.request import DropReason
from gateway.policies.reserve import AdaptiveReservePolicy, DemandForecast, ReserveSettings
from tests.gateway.test_flow_control import controller, req

ADAPTIVE = "usageLimit: {policy: adaptive-reserve, minCeiling: 0.25, adaptive: {margin: 0.1, halfLifeSeconds: 2, " \
           "peakWindowSeconds: 5}}\neviction: {enabled: false}"


def test_ewma_moves_half_way_to_the_held_reading_per_half_life():
    f = DemandForecast(half_life=2.0, peak_window=0.0)
    f.observe(0.8, 0.0)
    f.observe(0.0, 0.0)  # demand gone at t=0; the average still holds 0.8
    assert f.ewma == pytest.approx(0.8)
    f.observe(0.0, 2.0)
    assert f.ewma == pytest.approx(0.4)
    f.observe(0.0, 6.0)
    assert f.ewma == pytest.approx(0.1)


def test_peak_holds_for_the_window_then_gives_way_to_later_readings():
    f = DemandForecast(half_life=1000.0, peak_window=5.0)
    f.observe(0.2, 0.0)
    f.observe(0.7, 1.0)
    f.observe(0.3, 2.0)
    f.observe(0.1, 3.0)
    assert f.peak(5.9) == 0.7
    assert f.peak(6.5) == 0.3  # 0.7 left the window; 0.3 (t=2) is the largest left
    assert f.peak(100.0) == 0.1  # the reading still in force stays however old


def test_sheddable_ceiling_is_one_minus_forecast_minus_margin_within_bounds():
    p = AdaptiveReservePolicy(ReserveSettings(protected_priority=0, margin=0.1, half_life=2.0, peak_window=5.0,
                                              min_ceiling=0.25, max_ceiling=0.95))
    prios = [100, 0, -10]
    # Idle realtime: 1 − margin (0.9), under maxCeiling (0.95), which it started at.
    assert p.observe([(100, 0), (0, 0), (-10, 40)], capacity=48, now=0.0)
    assert p.ceilings(prios) == {100: 1.0, 0: 1.0, -10: 0.9}
    # 12 realtime requests (queued count too) and 0 standard of 48 slots: forecast 0.25, ceiling 0.65.
    assert p.observe([(100, 12), (0, 0), (-10, 40)], capacity=48, now=1.0)
    assert p.ceilings(prios)[-10] == pytest.approx(0.65)
    # A burst beyond the margin: the ceiling falls to its floor at once.
    p.observe([(100, 44), (0, 0), (-10, 40)], capacity=48, now=1.5)
    assert p.ceilings(prios)[-10] == 0.25
    assert p.state()["forecast"] == pytest.approx(44 / 48, abs=1e-4)


def test_ceiling_rises_only_after_the_peak_window_and_then_with_the_average():
    p = AdaptiveReservePolicy(ReserveSettings(margin=0.1, half_life=1.0, peak_window=5.0, min_ceiling=0.2))
    p.observe([(100, 24), (-10, 10)], capacity=48, now=0.0)  # half the pool
    assert p.sheddable_ceiling == pytest.approx(0.4)
    p.observe([(100, 0), (-10, 10)], capacity=48, now=0.1)  # realtime finished
    assert p.sheddable_ceiling == pytest.approx(0.4)  # the peak still holds
    assert not p.observe([(100, 0), (-10, 10)], capacity=48, now=4.9)
    p.observe([(100, 0), (-10, 10)], capacity=48, now=5.2)
    # Past the window: the average (0.5 held 0.1 s, then 0 for 5.1 s at a 1 s half-life) is all that is left.
    assert 0.88 < p.sheddable_ceiling < 0.9
    p.observe([(100, 0), (-10, 10)], capacity=48, now=20.0)
    assert p.sheddable_ceiling == 0.9  # 1 − margin


def test_no_healthy_replica_does_not_divide_by_zero():
    p = AdaptiveReservePolicy(ReserveSettings(min_ceiling=0.3))
    p.observe([(100, 2), (-10, 1)], capacity=0, now=0.0)
    assert p.sheddable_ceiling == 0.3


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="minCeiling"):
        AdaptiveReservePolicy(ReserveSettings(min_ceiling=0.8, max_ceiling=0.5))


def test_flow_controller_gates_batch_on_the_followed_ceiling():
    async def main():
        fc, clock = controller(ADAPTIVE, max_concurrency=10)
        batch = [req(fc, clock, "batch") for _ in range(12)]
        fc.submit(batch[0])
        # Realtime idle: the batch ceiling is 1 − margin, so batch fills 9 of 10 slots.
        for r in batch[1:]:
            fc.submit(r)
        fc.cycle()
        assert fc.bands.ceilings[-10] == pytest.approx(0.9)
        assert fc.bands[-10].in_flight == 9 and fc.bands[-10].queued == 3
        assert fc.snapshot()["holdback"]["ceilings"]["-10"] == pytest.approx(0.9)
        # Realtime arrives: four requests, one slot free; three queue behind the batch in flight.
        rts = [req(fc, clock, "realtime") for _ in range(4)]
        for r in rts:
            fc.submit(r)
        fc.cycle()
        # Demand 4 of 10 (in flight + queued) + margin: the batch ceiling falls to 0.5.
        assert fc.bands.ceilings[-10] == pytest.approx(0.5)
        state = fc.snapshot()["holdback"]
        assert state["policy"] == "adaptive-reserve" and state["forecast"]["forecast"] == pytest.approx(0.4)
        # Batch finishing frees slots for realtime, never for more batch while batch is above its ceiling.
        for r in batch[:6]:
            fc.finish(r)
        fc.cycle()
        assert fc.bands[100].in_flight == 4 and fc.bands[100].queued == 0
        assert fc.bands[-10].in_flight == 3
        assert fc.bands[-10].queued == 3  # saturation 0.7 is above the 0.5 ceiling
        for r in rts:
            fc.finish(r)
        # Realtime gone: the peak holds for the window (5 s), then the ceiling climbs back.
        clock.t += 1.0
        fc.cycle()
        assert fc.bands.ceilings[-10] == pytest.approx(0.5)
        clock.t += 30.0
        fc.cycle()
        assert fc.bands.ceilings[-10] == pytest.approx(0.9)
        assert fc.bands[-10].in_flight == 6 and fc.bands[-10].queued == 0
    asyncio.run(main())


def test_a_burst_takes_back_what_batch_borrowed_above_the_floor_at_once():
    # Eviction on: batch fills 9 of 10 slots while realtime is idle (floor 0.25: 2 slots are its own,
    # 7 are on loan). Six realtime requests arrive: one takes the free slot, each of the other five evicts
    # a borrowed batch request as it arrives and, the detector being the gateway's own count, takes its
    # slot at once; the victims' closing later releases nothing twice. (One decision for a queue of
    # borrowers: test_eviction.py's test_capacity_on_loan_comes_back_in_one_decision.)
    async def main():
        fc, clock = controller(ADAPTIVE.replace("eviction: {enabled: false}",
                                                "eviction: {policy: newest-first, maxPerDecision: 2}"),
                               max_concurrency=10)
        batch = [req(fc, clock, "batch") for _ in range(9)]
        for r in batch:
            fc.submit(r)
        fc.cycle()
        assert fc.bands[-10].in_flight == 9 and fc.bands.floors[-10] == pytest.approx(0.25)
        rts = [req(fc, clock, "realtime") for _ in range(6)]
        for r in rts:
            fc.submit(r)
        fc.cycle()
        evicted = [r for r in batch if r.drop_reason is DropReason.EVICTED]
        assert len(evicted) == 5 and fc.tally.evictions["issued"] == 5
        assert evicted == batch[-5:]  # newest first
        assert fc.bands[100].in_flight == 6 and fc.bands[100].queued == 0
        assert fc.bands[-10].in_flight == 4 and fc.in_flight == fc.pool.replicas[0].in_flight == 10
        for r in evicted:
            fc.finish(r)
        fc.cycle()
        assert fc.bands[100].in_flight == 6 and fc.bands[-10].in_flight == 4
        assert fc.in_flight == fc.pool.replicas[0].in_flight == 10
        assert fc.tally.evictions["confirmed"] == 5
    asyncio.run(main())


def test_fixed_policies_show_their_ceilings_and_no_forecast():
    async def main():
        fc, _clock = controller()
        state = fc.snapshot()["holdback"]
        assert state == {"policy": "priority-holdback", "forecast": None,
                         "ceilings": {"100": 1.0, "0": 0.75, "-10": 0.5}}
    asyncio.run(main())
