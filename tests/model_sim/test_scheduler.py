"""The scheduler and KV cache driven step by step, without HTTP or clocks."""

from __future__ import annotations

import itertools

import pytest

from model_sim.config import EngineConfig
from model_sim.generation import output_token_id
from model_sim.request import Request, RequestStatus
from model_sim.request_queue import SchedulingPolicy
from model_sim.scheduler import Scheduler

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int, priority: int = 0, arrival: float | None = None,
                 prompt: list[int] | None = None) -> Request:
    n = next(_ids)
    return Request(
        request_id=f"t-{n}",
        prompt_token_ids=prompt if prompt is not None else [1000 + n * 7919 + i for i in range(prompt_len)],
        max_tokens=max_tokens,
        target_output_tokens=max_tokens,
        priority=priority,
        arrival_time=float(n) if arrival is None else arrival,
    )


def run_step(sched: Scheduler, now: float = 0.0):
    out = sched.schedule(now)
    return out, sched.update_from_output(out, now)


def run_to_completion(sched: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def test_blocks_grow_by_one_each_time_output_crosses_a_block_boundary():
    sched = Scheduler(EngineConfig(num_blocks=64, block_size=16))
    req = make_request(prompt_len=10, max_tokens=40)
    sched.add_request(req)
    seen = []
    while not req.status.is_finished:
        out = sched.schedule(0.0)
        seen.append((req.num_tokens, sched.kv.num_blocks_of(req.request_id)))
        sched.update_from_output(out, 0.0)
    # While a step runs, the request holds exactly the blocks for the tokens it has.
    for num_tokens, blocks in seen:
        assert blocks == -(-num_tokens // 16)
    assert [b for _, b in seen] == sorted(b for _, b in seen)
    assert seen[0][1] == 1 and seen[-1][1] == 4  # 10 + 39 tokens in KV at most
    assert req.output_token_ids == [output_token_id(i) for i in range(40)]
    assert sched.kv.pool.num_used == 0


def test_prefill_is_chunked_by_the_token_budget():
    sched = Scheduler(EngineConfig(max_num_batched_tokens=100, num_blocks=64))
    req = make_request(prompt_len=250, max_tokens=2)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out, _ = run_step(sched)
        chunks.append(out.num_prefill_tokens)
    assert chunks == [100, 100, 50]


def test_kv_full_preempts_last_running_under_fcfs_and_everyone_finishes():
    sched = Scheduler(EngineConfig(num_blocks=8, block_size=16, max_num_seqs=8))
    reqs = [make_request(prompt_len=16, max_tokens=40) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    first_victim = None
    while sched.has_unfinished():
        out, _ = run_step(sched)
        if out.preempted and first_victim is None:
            first_victim = out.preempted[0]
            assert first_victim is reqs[-1], "fcfs preempts the request that arrived last"
            assert first_victim.status is RequestStatus.PREEMPTED
    assert sched.stats.num_preemptions > 0
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [output_token_id(i) for i in range(40)]
    assert sched.kv.pool.num_used == 0


def test_preemption_resets_progress_and_puts_victim_at_front_of_waiting():
    sched = Scheduler(EngineConfig(num_blocks=4, block_size=16, max_num_seqs=4))
    a = make_request(prompt_len=16, max_tokens=40)
    b = make_request(prompt_len=16, max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    while not sched.stats.num_preemptions:
        run_step(sched)
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and sched.kv.num_blocks_of(b.request_id) == 0
    assert b.num_output_tokens > 0, "a preempted request keeps the output it already produced"
    assert list(sched.waiting)[0] is b, "the victim goes back to the front of the queue"


def test_priority_policy_orders_waiting_lower_value_first_and_preempts_max_priority():
    sched = Scheduler(EngineConfig(max_num_seqs=1, scheduling_policy=SchedulingPolicy.PRIORITY, num_blocks=64))
    running = make_request(prompt_len=4, max_tokens=3, priority=0)
    sched.add_request(running)
    run_step(sched)
    waiting = [make_request(4, 2, priority=p) for p in (5, -1, 3, -1)]
    for r in waiting:
        sched.add_request(r)
    assert [r.priority for r in sched.waiting] == [-1, -1, 3, 5]
    assert list(sched.waiting)[:2] == [waiting[1], waiting[3]], "ties go by arrival"
    order = []
    while sched.has_unfinished():
        _, outcome = run_step(sched)
        order += [r for r in outcome.finished if r is not running]
    assert [r.priority for r in order] == [-1, -1, 3, 5]

    sched = Scheduler(EngineConfig(num_blocks=6, block_size=16, scheduling_policy=SchedulingPolicy.PRIORITY))
    urgent = make_request(16, 40, priority=-5)
    sheddable = make_request(16, 40, priority=10)
    normal = make_request(16, 40, priority=0)
    for r in (urgent, sheddable, normal):
        sched.add_request(r)
    while not sched.stats.num_preemptions:
        run_step(sched)
    assert sheddable.num_preemptions == 1 and urgent.num_preemptions == 0


def test_waiting_high_priority_does_not_preempt_running_work():
    sched = Scheduler(EngineConfig(max_num_seqs=1, scheduling_policy=SchedulingPolicy.PRIORITY, num_blocks=64))
    low = make_request(4, 10, priority=10)
    sched.add_request(low)
    run_step(sched)
    high = make_request(4, 10, priority=-10)
    sched.add_request(high)
    run_step(sched)
    assert low.status is RequestStatus.RUNNING and high.status is RequestStatus.WAITING
    assert sched.stats.num_preemptions == 0


def test_prefix_cache_shares_blocks_and_keeps_them_until_the_last_holder_leaves():
    sched = Scheduler(EngineConfig(num_blocks=32, block_size=16, enable_prefix_caching=True))
    prefix = list(range(1, 65))  # 4 full blocks
    a = make_request(0, 4, prompt=prefix + [900, 901])
    sched.add_request(a)
    run_step(sched)
    b = make_request(0, 40, prompt=prefix + [902])
    sched.add_request(b)
    run_step(sched)
    assert b.num_cached_tokens == 64
    shared = sched.kv.block_ids(a.request_id)[:4]
    assert sched.kv.block_ids(b.request_id)[:4] == shared
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    assert sched.stats.prefix_cache_hits == 64
    assert sched.stats.prefix_cache_queries == 66 + 65

    while not a.status.is_finished:
        run_step(sched)
    assert b.status is RequestStatus.RUNNING
    assert sched.kv.block_ids(b.request_id)[:4] == shared
    assert all(sched.kv.pool.blocks[i].ref_cnt == 1 for i in shared), "b still holds the shared prefix"
    assert sched.kv.pool.num_used == sched.kv.num_blocks_of(b.request_id)

    run_to_completion(sched)
    assert sched.kv.pool.num_used == 0
    c = make_request(0, 2, prompt=prefix + [903])
    sched.add_request(c)
    run_step(sched)
    assert c.num_cached_tokens == 64, "freed blocks stay cached until their space is needed"


def test_cached_free_blocks_are_evicted_when_space_is_needed():
    sched = Scheduler(EngineConfig(num_blocks=8, block_size=16, enable_prefix_caching=True))
    a = make_request(0, 2, prompt=list(range(1, 98)))  # 7 blocks
    sched.add_request(a)
    run_to_completion(sched)
    assert sched.kv.pool.num_cached_free >= 6
    b = make_request(100, 2)  # a different prompt that needs the space
    sched.add_request(b)
    run_to_completion(sched)
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_used == 0


def test_an_aborted_requests_blocks_reused_on_the_gpu_are_loaded_back_from_the_offload_tier():
    # The GPU holds 8 blocks; the tier 32. An aborted request's 5 full blocks are overwritten on the GPU by
    # another prompt, yet its retry finds them in the tier: loaded, not computed, and counted as cached.
    def run(offload_blocks: int) -> tuple[Scheduler, Request, int]:
        sched = Scheduler(EngineConfig(num_blocks=8, block_size=16, enable_prefix_caching=True,
                                       offload_blocks=offload_blocks))
        prompt = list(range(1, 81)) + [500, 501, 502]  # 5 full blocks and 3 tokens
        first = make_request(0, 40, prompt=prompt)
        sched.add_request(first)
        for _ in range(3):
            run_step(sched)
        sched.abort_request(first.request_id, 0.0)
        other = make_request(120, 2)  # all 8 blocks: overwrites every freed GPU block
        sched.add_request(other)
        run_to_completion(sched)
        retry = make_request(0, 4, prompt=prompt)
        sched.add_request(retry)
        out, _ = run_step(sched)
        return sched, retry, out.num_loaded_tokens

    sched, retry, loaded = run(0)
    assert retry.num_cached_tokens == 0 and loaded == 0, "without a tier the GPU cache lost the prefix"
    sched, retry, loaded = run(32)
    assert loaded == 80 and retry.num_cached_tokens == 80
    assert sched.stats.offload_hits == 80 and sched.stats.prefix_cache_hits == 0
    assert sched.kv.offload.stored >= 5 + 7
    run_to_completion(sched)
    assert sched.kv.pool.num_used == 0


def test_the_offload_tier_evicts_least_recently_used_blocks_and_the_gpu_hit_comes_first():
    sched = Scheduler(EngineConfig(num_blocks=64, block_size=16, enable_prefix_caching=True, offload_blocks=4))
    a = make_request(0, 1, prompt=list(range(1, 50)))  # 3 full blocks
    sched.add_request(a)
    run_to_completion(sched)
    assert len(sched.kv.offload) == 3
    b = make_request(0, 1, prompt=list(range(200, 250)))  # 3 more: a's oldest two go
    sched.add_request(b)
    run_to_completion(sched)
    assert len(sched.kv.offload) == 4 and sched.kv.offload.evicted == 2
    c = make_request(0, 1, prompt=list(range(1, 50)))  # a's blocks are still on the GPU (free, cached)
    sched.add_request(c)
    out, _ = run_step(sched)
    assert c.num_cached_tokens == 48 and out.num_loaded_tokens == 0, "the GPU cache is asked first"


def test_an_offload_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        EngineConfig(num_blocks=8, offload_blocks=4).validate()
    with pytest.raises(ValueError, match="must not be negative"):
        EngineConfig(num_blocks=8, enable_prefix_caching=True, offload_blocks=-1).validate()


def test_abort_frees_blocks_immediately_wherever_the_request_is():
    sched = Scheduler(EngineConfig(max_num_seqs=1, num_blocks=64))
    running = make_request(40, 100)
    waiting = make_request(40, 100)
    sched.add_request(running)
    sched.add_request(waiting)
    run_step(sched)
    assert sched.kv.pool.num_used == 3
    assert sched.abort_request(waiting.request_id, 0.0) is waiting
    assert len(sched.waiting) == 0
    out = sched.schedule(0.0)
    assert sched.abort_request(running.request_id, 0.0) is running
    assert sched.kv.pool.num_used == 0 and not sched.running
    outcome = sched.update_from_output(out, 0.0)  # the step that was in flight ignores it
    assert outcome.new_token == [] and running.status is RequestStatus.FINISHED_ABORTED
    assert sched.stats.finished["abort"] == 2


def test_abort_counts_the_computed_work_it_throws_away():
    sched = Scheduler(EngineConfig(max_num_seqs=2, num_blocks=64))
    decoding = make_request(40, 100)
    never_ran = make_request(40, 100)
    sched.add_request(decoding)
    for _ in range(4):  # prefill (first token) then three decode steps
        run_step(sched)
    assert decoding.num_computed_tokens == 40 + 3
    sched.add_request(never_ran)
    sched.abort_request(never_ran.request_id, 0.0)
    assert sched.stats.aborted_tokens == 0
    sched.abort_request(decoding.request_id, 0.0)
    assert sched.stats.aborted_tokens == 43


def test_without_preemption_outgrowing_the_cache_is_an_oom_that_fails_the_whole_batch():
    # 16 blocks x 16 tokens. Two requests of 30 prompt tokens (2 blocks each) are admitted; each grows to
    # 30 + 99 tokens (9 blocks), 18 together, so decoding runs out of blocks with nothing preemptible.
    sched = Scheduler(EngineConfig(num_blocks=16, block_size=16, preemption=False))
    a, b = make_request(30, 100), make_request(30, 100)
    sched.add_request(a)
    sched.add_request(b)
    failed = []
    for _ in range(200):
        out, _ = run_step(sched)
        failed += out.failed
        if out.failed:
            break
    assert sched.stats.kv_oom == 1
    assert {r.request_id for r in failed} == {a.request_id, b.request_id}
    assert sched.stats.kv_oom_failed_requests == 2
    assert all(r.status is RequestStatus.FINISHED_ABORTED and "out of memory" in r.error for r in failed)
    assert sched.stats.num_preemptions == 0
    assert sched.kv.pool.num_used == 0 and not sched.running


def test_with_preemption_the_same_load_preempts_and_never_counts_an_oom():
    sched = Scheduler(EngineConfig(num_blocks=16, block_size=16))
    a, b = make_request(30, 100), make_request(30, 100)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched)
    assert sched.stats.kv_oom == 0 and sched.stats.num_preemptions > 0
    assert a.error is None and b.error is None and a.num_output_tokens == b.num_output_tokens == 100
