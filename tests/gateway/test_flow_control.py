"""The flow controller with real policies and a real (not network-checked) replica pool.

Strict band order, head-of-line blocking, holdback ceilings, queue limits, TTL expiry, withdrawal and
eviction decisions, driven one cycle at a time with a controllable clock.
"""

from dataclasses import replace
import asyncio

import pytest

from gateway.flow.controller import FlowController
from gateway.flow.interface import Outcome
from gateway.flow.request import Ask, DropReason, FlowRequest, Status
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool
from gateway.settings import parse_config

PRIO = {"realtime": 100, "standard": 0, "batch": -10}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


HOLDBACK = "usageLimit: {policy: priority-holdback}\n"


def controller(extra="", replicas=1, max_concurrency=4):
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    # The fixed 50% reserve these tests count in (the shipped default's reserve follows realtime demand).
    usage = "" if "usageLimit" in extra else HOLDBACK
    saturation = "" if "saturation" in extra else f"saturation: {{maxConcurrency: {max_concurrency}}}\n"
    text = f"replicas: {urls}\n{saturation}{usage}{extra}"
    pool = ReplicaPool(urls)
    for r in pool.replicas:
        r.healthy = True
    clock = Clock()
    return FlowController(parse_config(text, "test"), pool, GatewayMetrics(), clock=clock), clock


def req(fc, clock, objective, n=[0], fid="t", ttl=None):
    n[0] += 1
    r = FlowRequest(Ask(request_id=f"{objective}-{n[0]}", objective=objective, priority=PRIO[objective],
                        fairness_id=fid, tenant=fid, arrived=clock()))
    if ttl is not None:
        r.expires_at = clock() + ttl
    return r


def run(coro):
    return asyncio.run(coro)


def test_inline_dispatch_until_the_batch_ceiling_then_queue():
    async def main():
        fc, clock = controller()  # default holdback: batch ceiling 0.5 of 4 slots
        batch = [req(fc, clock, "batch") for _ in range(4)]
        outcomes = [fc.submit(r) for r in batch]
        assert outcomes == [Outcome.DISPATCHED] * 2 + [Outcome.QUEUED] * 2
        assert fc.bands[-10].in_flight == 2 and fc.bands[-10].queued == 2
        assert fc.tally.dispatched == 2 and fc.bands[-10].dispatched == 2
        assert {b["priority"]: b["dispatched"] for b in fc.snapshot()["bands"]}[-10] == 2
    run(main())


def test_queued_realtime_goes_before_queued_batch():
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}\neviction: {enabled: false}")
        running = [req(fc, clock, "batch") for _ in range(4)]
        assert all(fc.submit(r) is Outcome.DISPATCHED for r in running)
        b = req(fc, clock, "batch")
        rt = req(fc, clock, "realtime")
        assert fc.submit(b) is Outcome.QUEUED
        assert fc.submit(rt) is Outcome.QUEUED
        fc.finish(running[0])
        fc.cycle()
        assert rt.status is Status.DISPATCHED and b.status is Status.QUEUED
        fc.finish(running[1])
        fc.cycle()
        assert b.status is Status.DISPATCHED
        assert rt.waiter.result() is Outcome.DISPATCHED
    run(main())


def test_head_of_line_blocking_stops_lower_bands():
    async def main():
        # Odd on purpose: realtime capped below batch, to see that a blocked higher band stops the walk.
        fc, clock = controller("flowControl: {bands: [{priority: 100, ceiling: 0.5}, {priority: -10, ceiling: 1.0}]}"
                               "\neviction: {enabled: false}")
        for _ in range(2):
            assert fc.submit(req(fc, clock, "realtime")) is Outcome.DISPATCHED
        rt = req(fc, clock, "realtime")
        assert fc.submit(rt) is Outcome.QUEUED          # saturation 0.5 >= 0.5
        b = req(fc, clock, "batch")
        assert fc.submit(b) is Outcome.QUEUED           # a higher band has queued work: no inline dispatch
        fc.cycle()
        assert b.status is Status.QUEUED                # 0.5 < 1.0, but realtime is blocked ahead of it
    run(main())


def test_band_queue_limit_rejects_saturated():
    async def main():
        fc, clock = controller("flowControl: {bands: [{priority: -10, maxRequests: 1}]}")
        for _ in range(2):
            fc.submit(req(fc, clock, "batch"))
        assert fc.submit(req(fc, clock, "batch")) is Outcome.QUEUED
        r = req(fc, clock, "batch")
        assert fc.submit(r) is Outcome.REJECTED and r.drop_reason is DropReason.SATURATED
        assert fc.tally.rejections["rejected-saturated"] == 1
    run(main())


def test_ttl_expiry_and_request_deadline():
    async def main():
        fc, clock = controller("flowControl: {bands: [{priority: -10, ttl: 5}]}")
        for _ in range(2):
            fc.submit(req(fc, clock, "batch"))
        band_ttl = req(fc, clock, "batch")
        short = req(fc, clock, "batch", ttl=1.0)
        assert fc.submit(band_ttl) is Outcome.QUEUED and fc.submit(short) is Outcome.QUEUED
        clock.t += 1.5
        fc.cycle()
        assert short.status is Status.REJECTED and short.drop_reason is DropReason.TTL_EXPIRED
        assert band_ttl.status is Status.QUEUED
        clock.t += 4
        fc.cycle()
        assert band_ttl.drop_reason is DropReason.TTL_EXPIRED
        assert fc.total_queued == 0 and fc.bands[-10].queued == 0
        past = req(fc, clock, "realtime")
        past.ask = replace(past.ask, deadline=clock.t - 1)
        assert fc.submit(past) is Outcome.REJECTED and past.drop_reason is DropReason.TTL_EXPIRED
    run(main())


def test_withdrawn_request_leaves_the_queue_at_once():
    async def main():
        fc, clock = controller()
        for _ in range(2):
            fc.submit(req(fc, clock, "batch"))
        gone = req(fc, clock, "batch", fid="a")
        stays = req(fc, clock, "batch", fid="b")
        fc.submit(gone)
        fc.submit(stays)
        fc.withdraw(gone)
        assert fc.bands[-10].queued == 1 and fc.bands[-10].queue_sizes() == {"b": 1}
        assert fc.tally.rejections["rejected-context-cancelled"] == 1
        fc.bands[-10].ceiling_override = None
        fc.bands.ceilings[-10] = 1.0
        fc.cycle()
        assert stays.status is Status.DISPATCHED and gone.status is Status.WITHDRAWN
    run(main())


def test_no_healthy_replica_is_no_endpoints():
    async def main():
        fc, clock = controller()
        fc.pool.replicas[0].healthy = False
        r = req(fc, clock, "realtime")
        assert fc.submit(r) is Outcome.REJECTED and r.drop_reason is DropReason.NO_ENDPOINTS
    run(main())


def dispatched_batch(fc, clock, n):
    """`n` batch requests dispatched 10 ms apart, each with a task for eviction to cancel."""
    loop = asyncio.get_running_loop()
    batch = []
    for _ in range(n):
        r = req(fc, clock, "batch")
        r.task = loop.create_task(asyncio.sleep(60))
        clock.t += 0.01
        assert fc.submit(r) is Outcome.DISPATCHED
        batch.append(r)
    return batch


def test_blocked_realtime_evicts_newest_batch_and_waits_for_confirmation():
    # A scraped detector sees freed capacity only after the victim's connection closed: stop-and-wait pacing.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}\n"
                               "saturation: {detector: utilization, maxConcurrency: 2}\neviction: {graceSeconds: 0.01}",
                               replicas=2, max_concurrency=2)
        for replica in fc.pool.replicas:
            replica.metrics_at = 0.0  # never scraped: each is scored by its own concurrency
        batch = dispatched_batch(fc, clock, 4)
        rt1, rt2 = req(fc, clock, "realtime"), req(fc, clock, "realtime")
        assert fc.submit(rt1) is Outcome.QUEUED
        fc.cycle()  # saturation 1.0 >= 1.0, deficit 0 -> exactly one victim: the newest batch request
        victims = [r for r in batch if r.drop_reason is DropReason.EVICTED]
        assert victims == [batch[-1]]
        await asyncio.sleep(0)
        assert batch[-1].task.cancelled()
        assert fc.submit(rt2) is Outcome.QUEUED
        fc.cycle()  # stop-and-wait: nothing new while the first victim is unconfirmed
        assert sum(r.drop_reason is DropReason.EVICTED for r in batch) == 1
        fc.finish(batch[-1])  # the proxy closed the victim's upstream
        assert fc.tally.evictions == {"issued": 1, "confirmed": 1}
        fc.cycle()
        assert rt1.status is Status.DISPATCHED and rt2.status is Status.QUEUED
        clock.t += 0.05  # past the grace
        fc.cycle()
        assert batch[-2].drop_reason is DropReason.EVICTED  # next decision for rt2
        for r in batch:
            r.task.cancel()
    run(main())


def test_with_the_concurrency_detector_a_blocked_arrival_takes_its_victims_slot_at_once():
    # The gateway's own count is the reading: the victim's slot is handed on at the decision, in submit(),
    # and the next arrival does not wait for the first victim's connection to close.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}", replicas=2, max_concurrency=2)
        batch = dispatched_batch(fc, clock, 4)
        rt1, rt2 = req(fc, clock, "realtime"), req(fc, clock, "realtime")
        assert fc.submit(rt1) is Outcome.QUEUED and rt1.status is Status.DISPATCHED
        assert [r for r in batch if r.drop_reason is DropReason.EVICTED] == [batch[-1]]
        assert fc.submit(rt2) is Outcome.QUEUED and rt2.status is Status.DISPATCHED
        assert [r for r in batch if r.drop_reason is DropReason.EVICTED] == [batch[-2], batch[-1]]
        assert fc.in_flight == 4 and sum(r.in_flight for r in fc.pool.replicas) == 4
        await asyncio.sleep(0)
        assert batch[-1].task.cancelled() and batch[-2].task.cancelled()
        fc.finish(batch[-1])  # the proxies closed the victims' upstreams: nothing is released twice
        fc.finish(batch[-2])
        assert fc.tally.evictions == {"issued": 2, "confirmed": 2}
        assert fc.in_flight == 4 and sum(r.in_flight for r in fc.pool.replicas) == 4
        for r in batch:
            r.task.cancel()
    run(main())


def test_an_evicted_requests_retry_keeps_its_place_ahead_of_batch_queued_after_it():
    # Like vLLM's preempted sequences: the retry (same request id, same flow) is dispatched before the batch
    # requests that arrived after the evicted attempt, so it returns while its prefix may still be cached.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}", max_concurrency=4)
        batch = dispatched_batch(fc, clock, 4)
        later = [req(fc, clock, "batch") for _ in range(2)]
        assert all(fc.submit(r) is Outcome.QUEUED for r in later)
        rt = req(fc, clock, "realtime")
        assert fc.submit(rt) is Outcome.QUEUED and rt.status is Status.DISPATCHED
        victim = batch[-1]
        assert victim.drop_reason is DropReason.EVICTED
        fc.finish(victim)
        # Another tenant sending the same request id gets no place; the victim's own retry does.
        stranger = FlowRequest(Ask(request_id=victim.request_id, objective="batch", priority=PRIO["batch"],
                                   fairness_id="other", tenant="other", arrived=clock()))
        retry = FlowRequest(Ask(request_id=victim.request_id, objective="batch", priority=PRIO["batch"],
                                fairness_id=victim.fairness_id, tenant=victim.tenant, arrived=clock()))
        assert fc.submit(stranger) is Outcome.QUEUED and stranger.place == stranger.seq
        fc.withdraw(stranger)
        assert fc.submit(retry) is Outcome.QUEUED
        assert retry.place == victim.place < later[0].place and retry.seq > later[-1].seq
        fc.finish(rt)
        fc.cycle()
        assert retry.status is Status.DISPATCHED and all(r.status is Status.QUEUED for r in later)
        assert fc.snapshot()["totals"]["evicted_places_kept"] == 1
        # The place is taken once: a second request with that id queues at its own arrival.
        again = FlowRequest(Ask(request_id=victim.request_id, objective="batch", priority=PRIO["batch"],
                                fairness_id=victim.fairness_id, tenant=victim.tenant, arrived=clock()))
        assert fc.submit(again) is Outcome.QUEUED and again.place == again.seq
        for r in batch:
            r.task.cancel()
    run(main())


def test_a_resumed_attempt_is_not_the_next_victim_and_a_refused_retry_keeps_its_count():
    # A resumed attempt is the newest thing running: by recency alone it would be evicted again at once. The
    # victim order puts never-evicted requests first; and a retry refused before it ran (its wait ran out)
    # leaves its place and count for the next retry.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}", max_concurrency=4)
        loop = asyncio.get_running_loop()
        batch = dispatched_batch(fc, clock, 4)
        rt1 = req(fc, clock, "realtime")
        assert fc.submit(rt1) is Outcome.QUEUED and rt1.status is Status.DISPATCHED
        first = batch[-1]
        assert first.drop_reason is DropReason.EVICTED
        fc.finish(first)
        fc.finish(rt1)
        retry = FlowRequest(Ask(request_id=first.request_id, objective="batch", priority=PRIO["batch"],
                                fairness_id=first.fairness_id, tenant=first.tenant, arrived=clock()))
        retry.task = loop.create_task(asyncio.sleep(60))
        clock.t += 0.01
        assert fc.submit(retry) is Outcome.DISPATCHED and retry.evictions == 1
        rt2 = req(fc, clock, "realtime")
        assert fc.submit(rt2) is Outcome.QUEUED and rt2.status is Status.DISPATCHED
        assert retry.drop_reason is None and batch[-2].drop_reason is DropReason.EVICTED
        # The second victim's retry waits for a slot and its wait runs out: refused, its count is kept.
        fc.finish(batch[-2])
        late = FlowRequest(Ask(request_id=batch[-2].request_id, objective="batch", priority=PRIO["batch"],
                               fairness_id="t", tenant="t", arrived=clock()))
        late.expires_at = clock() + 1
        assert fc.submit(late) is Outcome.QUEUED and late.evictions == 1
        clock.t += 2
        fc.cycle()
        assert late.status is Status.REJECTED and late.drop_reason is DropReason.TTL_EXPIRED
        again = FlowRequest(Ask(request_id=late.request_id, objective="batch", priority=PRIO["batch"], fairness_id="t",
                                tenant="t", arrived=clock()))
        assert fc.submit(again) is Outcome.QUEUED and (again.evictions, again.place) == (1, batch[-2].place)
        for r in (*batch, retry):
            r.task.cancel()
    run(main())


@pytest.mark.parametrize("affinity", [True, False])
def test_an_evicted_requests_retry_goes_back_to_the_replica_it_ran_on_while_that_replica_has_room(affinity):
    # Its prompt and kept output are cached there (GPU or offload tier), so the retry goes back even though the
    # least-loaded scorer would send a new request elsewhere; `picker.evictedAffinity: false` turns that off.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}\nflowControl: {bands: [{priority: 100, "
                               "ceiling: 1.0}, {priority: 0, ceiling: 1.0}, {priority: -10, ceiling: 1.0}]}\n"
                               f"picker: {{evictedAffinity: {str(affinity).lower()}}}", replicas=2, max_concurrency=4)
        batch = dispatched_batch(fc, clock, 8)  # 4 on each replica: the pool is full
        rt = req(fc, clock, "realtime")
        assert fc.submit(rt) is Outcome.QUEUED and rt.status is Status.DISPATCHED
        victim = next(r for r in batch if r.drop_reason is DropReason.EVICTED)
        home, other = victim.replica, next(r for r in fc.pool.replicas if r is not victim.replica)
        fc.finish(victim)
        fc.finish(rt)
        for r in [r for r in batch if r.replica is other][:2]:
            fc.finish(r)
        assert (home.in_flight, other.in_flight) == (3, 2)
        fresh = req(fc, clock, "batch")
        retry = FlowRequest(Ask(request_id=victim.request_id, objective="batch", priority=PRIO["batch"],
                                fairness_id=victim.fairness_id, tenant=victim.tenant, arrived=clock()))
        assert fc.submit(retry) is Outcome.DISPATCHED
        if not affinity:
            assert retry.replica is other and fc.snapshot()["totals"]["evicted_replica_kept"] == 0
            return
        assert retry.replica is home
        assert fc.submit(fresh) is Outcome.DISPATCHED and fresh.replica is other, "no affinity: least loaded"
        assert fc.snapshot()["totals"]["evicted_replica_kept"] == 1
        # A full home replica does not hold the retry back: it goes wherever there is room.
        victim2 = FlowRequest(Ask(request_id="gone", objective="batch", priority=PRIO["batch"], fairness_id="t",
                                  tenant="t", arrived=clock()))
        victim2.affinity = home.url
        home.in_flight = 4
        assert fc.submit(victim2) is Outcome.DISPATCHED and victim2.replica is other
        for r in batch:
            r.task.cancel()
    run(main())


def test_eviction_off_means_realtime_waits():
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}\neviction: {enabled: false}")
        batch = [req(fc, clock, "batch") for _ in range(4)]
        for r in batch:
            fc.submit(r)
        rt = req(fc, clock, "realtime")
        fc.submit(rt)
        fc.cycle()
        assert not fc.tally.evictions and rt.status is Status.QUEUED
    run(main())


def test_reload_keeps_queued_requests_and_applies_new_ceilings():
    async def main():
        fc, clock = controller()
        for _ in range(2):
            fc.submit(req(fc, clock, "batch"))
        waiting = req(fc, clock, "batch")
        fc.submit(waiting)
        assert fc.bands.ceilings[-10] == pytest.approx(0.5)
        fc.apply_config(parse_config("replicas: ['http://127.0.0.1:9000']\nsaturation: {maxConcurrency: 4}\n"
                                     "usageLimit: {policy: priority-holdback, minCeiling: 0.75}", "reloaded"))
        assert fc.bands.ceilings[-10] == pytest.approx(0.75) and fc.loaded.source == "reloaded"
        fc.cycle()
        assert waiting.status is Status.DISPATCHED
    run(main())


def test_a_reloaded_band_ttl_expires_requests_already_queued_counted_from_their_arrival():
    async def main():
        fc, clock = controller()  # batch ceiling 0.5 of 4 slots, no band TTL: queued requests wait indefinitely
        for _ in range(2):
            fc.submit(req(fc, clock, "batch"))
        old = req(fc, clock, "batch")
        assert fc.submit(old) is Outcome.QUEUED
        clock.t += 5.0
        young = req(fc, clock, "batch")
        assert fc.submit(young) is Outcome.QUEUED
        clock.t += 0.5
        fc.apply_config(parse_config("replicas: ['http://127.0.0.1:9000']\nsaturation: {maxConcurrency: 4}\n"
                                     + HOLDBACK + "flowControl: {bands: [{priority: -10, ttl: 2}]}", "reloaded"))
        fc.cycle()
        assert old.status is Status.REJECTED and old.drop_reason is DropReason.TTL_EXPIRED
        assert young.status is Status.QUEUED and fc.bands[-10].queued == 1
        clock.t += 1.6
        fc.cycle()
        assert young.drop_reason is DropReason.TTL_EXPIRED and fc.bands[-10].queued == 0
    run(main())


def test_kv_admission_queues_then_rejects_after_its_deadline():
    async def main():
        fc, clock = controller("admission: {enabled: true, kvPoolBlocks: 100, queueDeadlineMs: 500, "
                               "tenantMaxShare: 1.0, tenantSoftShare: 1.0}\nusageLimit: {policy: static}")
        big = req(fc, clock, "batch")
        big.ask = replace(big.ask, prompt_tokens=70 * 16)
        assert fc.submit(big) is Outcome.DISPATCHED  # 70 <= 75 (batch keeps the interactive reserve)
        nxt = req(fc, clock, "batch")
        nxt.ask = replace(nxt.ask, prompt_tokens=10 * 16)
        assert fc.submit(nxt) is Outcome.QUEUED       # 80 > 75: wait for room
        rt = req(fc, clock, "realtime")
        rt.ask = replace(rt.ask, prompt_tokens=20 * 16)
        assert fc.submit(rt) is Outcome.DISPATCHED     # 90 <= 92: the interactive reserve
        never = req(fc, clock, "batch")
        never.ask = replace(never.ask, prompt_tokens=80 * 16)
        assert fc.submit(never) is Outcome.REJECTED and never.drop_reason is DropReason.KV_NEVER_FITS
        clock.t += 0.6
        fc.cycle()
        assert nxt.drop_reason is DropReason.KV_CAPACITY and "queueDeadlineMs" in nxt.drop_message
        assert fc.ledger.kv_tokens_on(fc.pool.replicas[0].url) == 90 * 16
        fc.finish(big)
        assert fc.ledger.kv_tokens_on(fc.pool.replicas[0].url) == 20 * 16
        assert fc.snapshot()["kv"]["rejected_tokens"] == {"rejected-kv-capacity-never-fits": 80 * 16,
                                                          "rejected-kv-capacity": 10 * 16}
    run(main())


def test_victim_views_carry_resumable_reservation_and_soft_quota_excess():
    async def main():
        fc, clock = controller("admission: {kvPoolBlocks: 1000, tenantMaxShare: 0.5, tenantSoftShare: 0.1}\n"
                               "usageLimit: {policy: static}")
        fc.pool.replicas[0].num_gpu_blocks = 1000
        r = req(fc, clock, "batch", fid="heavy")
        r.ask = replace(r.ask, prompt_tokens=150 * 16, max_new_tokens=50 * 16, resumable=True)
        assert fc.submit(r) is Outcome.DISPATCHED
        view = fc.eviction.victim_view(r, clock())
        assert (view.resumable, view.reserved_blocks, view.prompt_tokens, view.max_new_tokens) == (
            True, 200, 2400, 800)
        assert view.tenant_over_soft_quota == pytest.approx(1.0)  # 0.2 of the pool against a soft 0.1
        assert view.replica == fc.pool.replicas[0].url and not view.streaming_started
    run(main())


def test_flow_control_metrics_carry_fairness_priority_and_outcome():
    """As llm-d's flow-control metrics: the queue duration by fairness id, priority and outcome, and the
    queue size by fairness id and priority."""
    async def main():
        fc, clock = controller("flowControl: {bands: [{priority: -10, maxRequests: 2}]}")
        fc.metrics.watch(fc.snapshot)
        registry = fc.metrics.registry
        inline = [req(fc, clock, "batch", fid="a") for _ in range(2)]
        assert [fc.submit(r) for r in inline] == [Outcome.DISPATCHED] * 2
        waits = req(fc, clock, "batch", fid="a")
        gone = req(fc, clock, "batch", fid="b")
        assert fc.submit(waits) is Outcome.QUEUED and fc.submit(gone) is Outcome.QUEUED
        refused = req(fc, clock, "batch", fid="b")
        assert fc.submit(refused) is Outcome.REJECTED

        def size(fid: str) -> float | None:
            return registry.get_sample_value("holdback_gateway_flow_control_queue_size",
                                             {"pool": "default", "fairness_id": fid, "priority": "-10"})

        assert (size("a"), size("b")) == (1, 1)
        clock.t += 2.0
        fc.withdraw(gone)
        fc.bands.ceilings[-10] = 1.0
        fc.cycle()
        assert waits.status is Status.DISPATCHED
        assert (size("a"), size("b")) == (None, None)  # empty flows are gone from the band

        def duration(fid: str, outcome: str, stat: str) -> float | None:
            return registry.get_sample_value(
                f"holdback_gateway_flow_control_request_queue_duration_seconds_{stat}",
                {"pool": "default", "fairness_id": fid, "priority": "-10", "outcome": outcome})

        assert duration("a", "dispatched", "count") == 3  # two inline, one after waiting
        assert duration("a", "dispatched", "sum") == pytest.approx(2.0)
        assert duration("b", "rejected-saturated", "count") == 1
        assert duration("b", "rejected-context-cancelled", "count") == 1
        assert duration("b", "rejected-context-cancelled", "sum") == pytest.approx(2.0)
        assert duration("b", "dispatched", "count") is None
    run(main())



def blocked_release(fc, band, what):
    return fc.metrics.registry.get_sample_value(f"holdback_gateway_blocked_release_seconds_{what}",
                                                {"pool": "default", "band": band})


def test_blocked_arrival_to_released_slot_is_measured_for_realtime_only():
    # Eviction off: a blocked realtime arrival waits for a batch request to end; the histogram holds arrival ->
    # that release, not arrival -> dispatch (the dispatch cycle runs later) and not the batch request's own wait.
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}\neviction: {enabled: false}")
        batch = [req(fc, clock, "batch") for _ in range(5)]
        for r in batch:
            fc.submit(r)
        assert batch[-1].status is Status.QUEUED
        rt = req(fc, clock, "realtime")
        assert fc.submit(rt) is Outcome.QUEUED
        clock.t += 0.75
        fc.finish(batch[0])
        clock.t += 0.2  # the dispatch loop gets round to it later
        fc.cycle()
        assert rt.status is Status.DISPATCHED and batch[-1].status is Status.QUEUED
        assert blocked_release(fc, "100", "count") == 1
        assert blocked_release(fc, "100", "sum") == pytest.approx(0.75)
        assert blocked_release(fc, "-10", "count") is None  # sheddable: never counted
    run(main())


def test_blocked_arrival_served_by_an_eviction_decision_counts_zero_wait():
    async def main():
        fc, clock = controller("usageLimit: {policy: static, threshold: 1.0}", replicas=2, max_concurrency=2)
        batch = dispatched_batch(fc, clock, 4)
        rt = req(fc, clock, "realtime")
        assert fc.submit(rt) is Outcome.QUEUED and rt.status is Status.DISPATCHED
        assert blocked_release(fc, "100", "count") == 1 and blocked_release(fc, "100", "sum") == 0.0
        inline = req(fc, clock, "realtime")
        fc.finish(batch[0])
        assert fc.submit(inline) is Outcome.DISPATCHED  # found room: not a blocked arrival
        assert blocked_release(fc, "100", "count") == 1
        for r in batch:
            r.task.cancel()
    run(main())
