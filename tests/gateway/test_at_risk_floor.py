"""The at-risk floor (gateway/flow/floor.py): under realtime saturation, requests of batches at risk of missing
their window take a freed slot before queued realtime, up to the floor, earliest deadline first, and are no
eviction victims there; with nothing at risk the floor costs realtime nothing. The header that marks a request
at risk counts only from a trusted relay's key."""

import asyncio

from gateway.flow.interface import Outcome
from gateway.flow.request import Ask, DropReason, FlowRequest, Status
from tests.gateway.test_classification import classify
from tests.gateway.test_flow_control import PRIO, controller, run

STATIC = "usageLimit: {policy: static, threshold: 1.0}\n"


def request(clock, name, objective, at_risk=False, deadline=float("inf")):
    r = FlowRequest(Ask(request_id=name, objective=objective, priority=PRIO[objective], fairness_id="t", tenant="t",
                        arrived=clock(), deadline=deadline, at_risk=at_risk))
    r.task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    return r


def saturated(fc, clock, n):
    """`n` realtime requests dispatched (the whole pool), and one more queued behind them."""
    running = [request(clock, f"rt-{i}", "realtime") for i in range(n)]
    assert all(fc.submit(r) is Outcome.DISPATCHED for r in running)
    waiting = request(clock, "rt-waiting", "realtime")
    assert fc.submit(waiting) is Outcome.QUEUED
    return running, waiting


def cancel(*groups):
    for group in groups:
        for r in group:
            r.task.cancel()


def test_a_freed_slot_goes_to_an_at_risk_batch_before_queued_realtime_and_it_is_not_evicted():
    async def main():
        fc, clock = controller(STATIC + "flowControl: {atRiskFloor: 0.1}", max_concurrency=10)  # floor: 1 slot
        running, waiting = saturated(fc, clock, 10)
        plain = request(clock, "batch-plain", "batch")
        risky = request(clock, "batch-at-risk", "batch", at_risk=True)
        assert fc.submit(plain) is Outcome.QUEUED and fc.submit(risky) is Outcome.QUEUED
        fc.finish(running[0])
        fc.cycle()
        assert risky.status is Status.DISPATCHED and risky.in_floor and fc.floor.in_flight == 1
        assert waiting.status is Status.QUEUED and plain.status is Status.QUEUED
        # Realtime blocked on a full pool finds no victim: the only batch request running is in the floor.
        blocked = request(clock, "rt-blocked", "realtime")
        assert fc.submit(blocked) is Outcome.QUEUED
        fc.cycle()
        assert risky.drop_reason is None and fc.tally.evictions.get("issued", 0) == 0
        # The floor is full: the next freed slot goes to realtime again, not to the plain batch request.
        fc.finish(running[1])
        fc.cycle()
        assert waiting.status is Status.DISPATCHED and plain.status is Status.QUEUED
        assert fc.snapshot()["at_risk_floor"] == {"share": 0.1, "in_flight": 1, "waiting": 0}
        fc.finish(risky)
        assert fc.floor.in_flight == 0 and not risky.in_floor
        cancel(running, [waiting, blocked, plain, risky])
    run(main())


def test_with_nothing_at_risk_a_freed_slot_goes_to_realtime():
    async def main():
        fc, clock = controller(STATIC + "flowControl: {atRiskFloor: 0.1}", max_concurrency=10)
        running, waiting = saturated(fc, clock, 10)
        plain = request(clock, "batch-plain", "batch")
        assert fc.submit(plain) is Outcome.QUEUED
        fc.finish(running[0])
        fc.cycle()
        assert waiting.status is Status.DISPATCHED and plain.status is Status.QUEUED and fc.floor.in_flight == 0
        cancel(running, [waiting, plain])
    run(main())


def test_at_risk_batches_go_earliest_deadline_first_and_the_floor_can_be_turned_off():
    async def main():
        fc, clock = controller(STATIC + "flowControl: {atRiskFloor: 0.1}", max_concurrency=10)
        running, waiting = saturated(fc, clock, 10)
        later = request(clock, "batch-later", "batch", at_risk=True, deadline=clock() + 600)
        sooner = request(clock, "batch-sooner", "batch", at_risk=True, deadline=clock() + 300)
        assert fc.submit(later) is Outcome.QUEUED and fc.submit(sooner) is Outcome.QUEUED
        fc.finish(running[0])
        fc.cycle()
        assert sooner.status is Status.DISPATCHED and later.status is Status.QUEUED
        cancel(running, [waiting, later, sooner])

        fc, clock = controller(STATIC + "flowControl: {atRiskFloor: 0}", max_concurrency=10)
        running, waiting = saturated(fc, clock, 10)
        risky = request(clock, "batch-at-risk", "batch", at_risk=True)
        assert fc.submit(risky) is Outcome.QUEUED
        fc.finish(running[0])
        fc.cycle()
        assert waiting.status is Status.DISPATCHED and risky.status is Status.QUEUED
        cancel(running, [waiting, risky])
    run(main())


def test_an_at_risk_request_dispatched_into_free_room_is_an_ordinary_victim():
    async def main():
        fc, clock = controller(STATIC + "flowControl: {atRiskFloor: 0.1}", max_concurrency=2)
        risky = request(clock, "batch-at-risk", "batch", at_risk=True)
        other = request(clock, "batch-other", "batch")
        assert fc.submit(risky) is Outcome.DISPATCHED and fc.submit(other) is Outcome.DISPATCHED
        assert not risky.in_floor and fc.floor.in_flight == 0
        rt = request(clock, "rt", "realtime")
        assert fc.submit(rt) is Outcome.QUEUED and rt.status is Status.DISPATCHED
        assert DropReason.EVICTED in (risky.drop_reason, other.drop_reason)
        cancel([risky, other, rt])
    run(main())


def test_the_at_risk_header_counts_only_from_a_trusted_relay():
    assert classify(Authorization="Bearer batch-key", x_holdback_at_risk="1").at_risk
    assert not classify(Authorization="Bearer batch-key").at_risk
    assert not classify(Authorization="Bearer other-key", x_holdback_at_risk="1").at_risk
    assert not classify(x_holdback_at_risk="1").at_risk  # anonymous
