"""The replica's own limits (gateway `engine`): its concurrency from maxNumSeqs + queueAllowance, eviction for a
higher-priority request waiting inside the replica for an engine slot, and the priority written for replicas
that run vLLM's priority policy."""

from dataclasses import replace
import asyncio

import pytest

from gateway.cache_salt import replica_priority
from gateway.flow.controller import FlowController
from gateway.flow.interface import Outcome
from gateway.flow.request import Ask, DropReason, FlowRequest, Status
from gateway.metrics import GatewayMetrics
from gateway.policies.saturation import ConcurrencyDetector
from gateway.replicas import Replica, ReplicaPool
from gateway.settings import ConfigError, parse_config
from gateway.upstream import connection_limit

pytestmark = pytest.mark.unit

A, B = "http://127.0.0.1:9100", "http://127.0.0.1:9101"
PRIO = {"realtime": 100, "standard": 0, "batch": -10}


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def controller(engine: str, urls=(A,), extra="usageLimit: {policy: static, threshold: 1.0}"):
    text = f"replicas: {list(urls)}\nsaturation: {{maxConcurrency: 48}}\nengine: {engine}\n{extra}"
    pool = ReplicaPool(list(urls))
    for r in pool.replicas:
        r.healthy = True
    clock = Clock()
    return FlowController(parse_config(text, "test"), pool, GatewayMetrics(), clock=clock), clock


def request(clock, objective, n=[0]):
    n[0] += 1
    return FlowRequest(Ask(request_id=f"{objective}-{n[0]}", objective=objective, priority=PRIO[objective],
                           fairness_id="t", tenant="t", arrived=clock()))


def queued(fc, clock, objective):
    """A streamed request submitted while it cannot be dispatched: it waits in the gateway's queue."""
    r = request(clock, objective)
    r.ask, r.task = replace(r.ask, streamed=True), asyncio.get_running_loop().create_task(asyncio.sleep(60))
    assert fc.submit(r) is Outcome.QUEUED
    return r


def dispatch(fc, clock, objective, *, streaming=True, streamed=True):
    r = request(clock, objective)
    r.ask = replace(r.ask, streamed=streamed)
    r.task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    clock.t += 0.01
    assert fc.submit(r) is Outcome.DISPATCHED
    if streaming:
        fc.started_streaming(r)
    return r


def test_engine_settings_per_replica_and_the_capacity_they_give():
    cfg = parse_config(f"replicas: [{A}, {B}]\nengine: {{maxNumSeqs: 8, queueAllowance: 2, replicas: "
                       f"{{{B}/: {{schedulingPolicy: priority, maxNumSeqs: 4}}}}}}\n", "t").config
    assert cfg.capacity(A) == 10 and cfg.capacity(B) == 6
    assert not cfg.engine.priority_scheduling(A) and cfg.engine.priority_scheduling(B)
    assert parse_config(f"replicas: [{A}]\n", "t").config.capacity(A) == 48  # unset: saturation.maxConcurrency
    assert connection_limit(cfg) == 256
    with pytest.raises(ConfigError, match=r"engine.queueAllowance counts requests beyond the replica's slots, "
                                          r"and with learnMaxNumSeqs off they are unknown: set engine.maxNumSeqs"):
        parse_config("engine: {queueAllowance: 2, learnMaxNumSeqs: false}\n", "t")
    learned = parse_config(f"replicas: [{A}]\nengine: {{queueAllowance: 2}}\n", "t").config
    assert learned.capacity(A) == 50  # maxConcurrency until learned, and the allowance beyond learned slots
    with pytest.raises(ConfigError, match="engine.replicas: 'r1' must be a replica's http"):
        parse_config("engine: {replicas: {r1: {maxNumSeqs: 2}}}\n", "t")


def test_vllm_runs_lower_priorities_first():
    assert replica_priority(PRIO["realtime"]) < replica_priority(PRIO["standard"]) < replica_priority(PRIO["batch"])


def test_the_concurrency_detector_counts_each_replicas_own_capacity():
    d = ConcurrencyDetector(max_concurrency=48)
    small, default = Replica(A, healthy=True, in_flight=4, capacity=8), Replica(B, healthy=True, in_flight=12)
    assert d.saturation([small, default], 0) == pytest.approx(16 / 56)
    assert d.replica_score(small, 0) == pytest.approx(0.5)
    assert d.has_room(small, 0)
    small.in_flight = 8
    assert not d.has_room(small, 0) and d.has_room(default, 0)


def test_a_replica_gets_no_more_than_its_slots_and_allowance():
    async def main():
        fc, clock = controller("{maxNumSeqs: 3, queueAllowance: 1}")
        assert fc.pool.replicas[0].capacity == 4 and fc.pool.replicas[0].max_num_seqs == 3
        batch = [dispatch(fc, clock, "batch") for _ in range(4)]
        extra = request(clock, "batch")
        assert fc.submit(extra) is Outcome.QUEUED  # the pool is full at 4, not at maxConcurrency 48
        assert fc.snapshot()["replicas"][0]["limit"] == 4
        for r in batch:
            r.task.cancel()
    run(main())


def test_realtime_waiting_inside_the_replica_evicts_one_running_batch_request_there():
    async def main():
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 3, queueAllowance: 2}")
        batch = [dispatch(fc, clock, "batch") for _ in range(3)]  # every engine slot runs batch
        assert fc.tally.evictions.get("issued", 0) == 0
        rt = dispatch(fc, clock, "realtime", streaming=False)  # dispatched into the allowance: it waits in vLLM
        victims = [r for r in batch if r.drop_reason is DropReason.EVICTED]
        assert victims == [batch[-1]] and rt.status is Status.DISPATCHED and rt.slot_freed
        await asyncio.sleep(0)
        assert batch[-1].task.cancelled()
        fc.finish(batch[-1])
        fc.cycle()  # served once: the same waiting request does not take a second victim
        assert sum(r.drop_reason is DropReason.EVICTED for r in batch) == 1
        fc.started_streaming(rt)
        assert rt not in fc.eviction.awaiting
        for r in batch:
            r.task.cancel()
    run(main())


def test_realtime_within_the_slots_evicts_nothing():
    async def main():
        fc, clock = controller("{maxNumSeqs: 3, queueAllowance: 2}")
        batch = [dispatch(fc, clock, "batch") for _ in range(2)]
        rt = dispatch(fc, clock, "realtime", streaming=False)  # the third slot is free: it runs at once
        fc.cycle()
        assert not any(r.drop_reason is DropReason.EVICTED for r in batch) and not rt.slot_freed
        fc.finish(rt)
        assert rt not in fc.eviction.awaiting
        for r in batch:
            r.task.cancel()
    run(main())


def test_a_running_victim_goes_before_one_still_waiting_inside_and_that_one_goes_too():
    async def main():
        fc, clock = controller("{maxNumSeqs: 2, queueAllowance: 2}")
        running = [dispatch(fc, clock, "batch") for _ in range(2)]
        queued_inside = dispatch(fc, clock, "batch", streaming=False)  # newest, but it holds no slot
        dispatch(fc, clock, "realtime", streaming=False)
        # One running victim frees the slot; the batch request waiting inside vLLM would take it if the victim's
        # abort reached vLLM before the realtime request, so it is evicted as well.
        assert [r for r in running if r.drop_reason is DropReason.EVICTED] == [running[-1]]
        assert queued_inside.drop_reason is DropReason.EVICTED
        assert fc.tally.evictions["issued"] == 2
        for r in (*running, queued_inside):
            r.task.cancel()
    run(main())


def test_realtime_at_a_full_allowance_evicts_one_running_batch_request_and_clears_the_replicas_queue():
    async def main():
        # The slots run batch and batch fills the allowance too: realtime is blocked at the gateway's capacity.
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 2, queueAllowance: 1}")
        running = [dispatch(fc, clock, "batch") for _ in range(2)]
        inside = dispatch(fc, clock, "batch", streaming=False)  # the newest: it waits inside vLLM, holding no slot
        rt = queued(fc, clock, "realtime")
        fc.cycle()
        # The victim is one that runs (evicting only the waiting one would free no engine slot); realtime goes in
        # with that slot counted as its own. The one waiting inside goes too: it would take the freed slot
        # whenever the victim's abort reaches vLLM before the realtime request does.
        assert rt.status is Status.DISPATCHED and rt.slot_freed
        assert [r for r in running if r.drop_reason is DropReason.EVICTED] == [running[-1]]
        assert inside.drop_reason is DropReason.EVICTED
        fc.cycle()
        assert fc.tally.evictions.get("issued", 0) == 2  # no second running victim for the same request
        for r in (*running, inside, rt):
            r.task.cancel()
    run(main())


def test_no_lower_priority_request_joins_a_full_replicas_queue_before_the_realtime_one_there_answers():
    async def main():
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 2, queueAllowance: 2}")
        running = [dispatch(fc, clock, "batch") for _ in range(2)]
        rt = dispatch(fc, clock, "realtime", streaming=False)  # into the allowance; a running victim is evicted
        assert [r for r in running if r.drop_reason is DropReason.EVICTED] == [running[-1]]
        fc.finish(running[-1])
        # A batch request (the victim's retry, say) would reach vLLM's queue before or after the realtime one;
        # sent before, it takes the freed slot. It waits at the gateway until the realtime request answers.
        later = queued(fc, clock, "batch")
        fc.cycle()
        assert later.status is not Status.DISPATCHED
        fc._wake.clear()
        fc.started_streaming(rt)
        assert fc._wake.is_set()
        fc.cycle()
        assert later.status is Status.DISPATCHED
        for r in (*running, rt, later):
            r.task.cancel()
    run(main())


def test_a_replica_with_a_free_slot_takes_batch_while_realtime_waits_for_its_first_token():
    async def main():
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 3, queueAllowance: 2}")
        dispatch(fc, clock, "realtime", streaming=False)  # in a free slot: it needs none freed
        ok = [dispatch(fc, clock, "batch") for _ in range(2)]  # the other slots are free too: they run at once
        assert all(r.status is Status.DISPATCHED for r in ok)
        for r in ok:
            r.task.cancel()
    run(main())


def test_no_streamed_request_that_has_not_answered_is_a_victim_and_the_decision_waits_for_one_that_streams():
    async def main():
        # The realtime request reaches the replica before any batch request there has answered: the gateway
        # cannot tell which of them runs, and evicting one that waits frees no slot.
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 1, queueAllowance: 4}")
        batch = [dispatch(fc, clock, "batch", streaming=False) for _ in range(3)]
        rt = dispatch(fc, clock, "realtime", streaming=False)
        fc.cycle()
        assert not any(r.drop_reason is DropReason.EVICTED for r in batch) and not rt.slot_freed
        fc._wake.clear()
        fc.started_streaming(batch[1])  # this one runs (it reached vLLM first): it is the victim
        assert fc._wake.is_set()  # the dispatch loop decides again now
        fc.cycle()
        # The running one frees the slot; the two still waiting inside go too (either would take it).
        assert batch[1].drop_reason is DropReason.EVICTED and rt.slot_freed
        assert fc.tally.evictions["issued"] == 3
        for r in batch:
            r.task.cancel()
    run(main())


def test_a_request_that_asked_for_no_stream_stays_a_victim_before_it_answers():
    async def main():
        fc, clock = controller("{schedulingPolicy: priority, maxNumSeqs: 1, queueAllowance: 4}")
        whole = dispatch(fc, clock, "batch", streaming=False, streamed=False)  # it answers only when done
        dispatch(fc, clock, "realtime", streaming=False)
        assert whole.drop_reason is DropReason.EVICTED
        whole.task.cancel()
    run(main())


def test_without_eviction_realtime_waits_inside():
    async def main():
        fc, clock = controller("{maxNumSeqs: 2, queueAllowance: 1}",
                               extra="usageLimit: {policy: static, threshold: 1.0}\neviction: {policy: none}")
        batch = [dispatch(fc, clock, "batch") for _ in range(2)]
        dispatch(fc, clock, "realtime", streaming=False)
        fc.cycle()
        assert not any(r.drop_reason is DropReason.EVICTED for r in batch)
        for r in batch:
            r.task.cancel()
    run(main())


def run(coro):
    return asyncio.run(coro)
