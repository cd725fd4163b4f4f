"""Fair window refill into the RQ queue, and reconciliation of the database with Redis."""

from __future__ import annotations

import time

from rq import Queue
from sqlalchemy import select

from batch_processor.fairness import BatchWindow, RefillRoundRobin, tenant_window
from holdback.attempts.transactions import begin_attempt
from holdback.contract import JOB_FUNCTION
from holdback.db import transaction
from holdback.models import Attempt, RequestRow
from holdback.results import schedule_retry
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401


def _statuses(harness: Harness, batch_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in harness.rows(batch_id):
        out[r.status] = out.get(r.status, 0) + 1
    return out


def test_round_robin_interleaves_tenants_then_batches():
    rr = RefillRoundRobin(window=8, chunk=2)
    steps = rr.plan([BatchWindow("a1", "A", 0), BatchWindow("a2", "A", 0), BatchWindow("b1", "B", 7)])
    # The window is the tenant's: B has 1 row to go; A's two batches take turns within A's 8.
    assert steps == [("a1", 2), ("b1", 1), ("a2", 2), ("a1", 2), ("a2", 2)]
    # Next round another tenant goes first.
    assert rr.plan([BatchWindow("a1", "A", 2), BatchWindow("b1", "B", 2)])[0] == ("b1", 2)


def test_a_tenant_gets_one_window_however_many_batches_it_splits_its_work_into():
    rr = RefillRoundRobin(window=12, chunk=4)
    batches = [BatchWindow(f"a{i}", "A", 0) for i in range(3)] + [BatchWindow("b1", "B", 0)]
    given: dict[str, int] = {}
    for batch_id, n in rr.plan(batches):
        given[batch_id[0]] = given.get(batch_id[0], 0) + n
    assert given == {"a": 12, "b": 12}
    # A batch with nothing pending takes no share: its tenant's other batch gets the whole deficit.
    steps = rr.plan([BatchWindow("a1", "A", 4, pending=0), BatchWindow("a2", "A", 0, pending=100)])
    assert steps == [("a2", 4), ("a2", 4)]


def test_windows_shrink_so_all_tenants_together_hold_about_two_rounds_of_the_workers():
    assert tenant_window(256, tenants=3, capacity=64) == 43  # 2 x 64 / 3, rounded up
    assert tenant_window(256, tenants=1, capacity=64) == 128
    assert tenant_window(256, tenants=40, capacity=64) == 16  # never below one refill chunk
    assert tenant_window(100, tenants=1, capacity=640) == 100  # --window stays the ceiling
    assert tenant_window(256, tenants=3, capacity=0) == 256  # no worker registered: nothing to size by
    assert tenant_window(256, tenants=3, capacity=64, rounds=0) == 256


def test_jobs_follow_the_worker_contract(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(3)]))
    harness.processor().tick()
    rows = harness.rows(batch_id)
    assert harness.queued_job_ids() == [r.id for r in rows]
    job = Queue(harness.queue.queue.name, connection=harness.redis).fetch_job(rows[0].id)
    assert job.func_name == JOB_FUNCTION and job.args == (rows[0].id, batch_id)
    assert job.result_ttl == 0 and job.retries_left is None
    assert all(r.status == "queued" and r.enqueued_at for r in rows)


def test_small_batch_is_queued_before_a_big_one_drains(harness: Harness):
    big = harness.submit(jsonl([chat(i) for i in range(600)]), tenant="big")
    p = harness.processor(window=50)
    p.tick()
    assert len(harness.queued_job_ids()) == 50
    p.tick()
    assert len(harness.queued_job_ids()) == 50  # a full window is not topped up again

    small = harness.submit(jsonl([chat(i) for i in range(5)]), tenant="small")
    p.tick()
    small_ids = {r.id for r in harness.rows(small)}
    queue = harness.queued_job_ids()
    assert small_ids <= set(queue) and len(queue) == 55

    # Workers finish 20 of the big batch's rows; its refill goes behind the small batch's rows.
    big_rows = harness.rows(big)
    for row in big_rows[:20]:
        harness.succeed(row.id)
    p.tick()
    queue = harness.queued_job_ids()
    refill = [r.id for r in harness.rows(big) if r.status == "queued" and r.line > 50]
    assert len(refill) == 20
    assert max(queue.index(i) for i in small_ids) < min(queue.index(i) for i in refill)
    assert len(queue) == len(set(queue))  # no job id pushed twice
    assert _statuses(harness, big) == {"succeeded": 20, "queued": 50, "pending": 530}
    assert _statuses(harness, small) == {"queued": 5}


def test_window_counts_running_and_retrying_rows(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(20)]))
    p = harness.processor(window=6)
    p.tick()
    rows = harness.rows(batch_id)
    with transaction(harness.factory) as s:
        begin_attempt(s, rows[0].id, "w")  # running
        begin_attempt(s, rows[1].id, "w")
        schedule_retry(s, rows[1].id, time.time() + 60, evicted=True, transient=False)  # retry_wait
    p.tick()
    assert _statuses(harness, batch_id) == {"running": 1, "retry_wait": 1, "queued": 4, "pending": 14}


def _wipe_namespace(harness: Harness) -> None:
    """Redis lost everything of ours (a restart without persistence): the queue, its registries and
    the job hashes. The machine's Redis is shared, so no FLUSHALL: only this test's keys go."""
    r = harness.redis
    for key in r.scan_iter(match=f"*{harness.settings.redis_namespace}*"):
        r.delete(key)
    with harness.factory() as s:
        for row_id in s.scalars(select(RequestRow.id)):
            r.delete(f"rq:job:{row_id}")


def test_reconcile_requeues_rows_redis_lost(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(12)]))
    p = harness.processor(window=8, reconcile_grace=0.0, running_grace=0.0, reconcile_interval=0.0)
    p.tick()
    queued = sorted(r.id for r in harness.rows(batch_id) if r.status == "queued")
    assert len(queued) == 8

    p.tick()  # Redis still has them: reconciliation leaves them alone
    assert sorted(harness.queued_job_ids()) == queued

    _wipe_namespace(harness)
    assert harness.queued_job_ids() == []
    done = p.tick()
    assert done.reconciled["lost_queued"] == 8
    assert sorted(harness.queued_job_ids()) == queued  # each exactly once
    assert _statuses(harness, batch_id) == {"queued": 8, "pending": 4}


def test_reconcile_requeues_lost_retries_and_abandoned_attempts(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(6)]))
    p = harness.processor(window=6, reconcile_grace=0.0, running_grace=0.0, reconcile_interval=0.0)
    p.tick()
    rows = harness.rows(batch_id)
    retry, dead, alive, future = rows[0].id, rows[1].id, rows[2].id, rows[3].id
    harness.redis.delete(harness.queue.queue.key)  # the workers took every job...
    with transaction(harness.factory) as s:
        for row_id in (retry, dead, alive, future):
            begin_attempt(s, row_id, "w1")
        schedule_retry(s, retry, time.time() - 1, evicted=True, transient=False)  # ...parked, job lost
        schedule_retry(s, future, time.time() + 300, evicted=True, transient=False)  # waits; not due yet
    # A live worker still runs `alive`: its execution sits in RQ's started registry with a fresh heartbeat.
    harness.redis.zadd(harness.queue.queue.started_job_registry.key, {f"{alive}:exec1": time.time() + 60})

    done = p.tick()

    assert done.reconciled == {"lost_queued": 2, "lost_retry": 1, "abandoned": 1}
    by_id = {r.id: r for r in harness.rows(batch_id)}
    assert by_id[alive].status == "running" and by_id[future].status == "retry_wait"
    assert by_id[retry].status == by_id[dead].status == "queued"
    assert sorted(harness.queued_job_ids()) == sorted([retry, dead, rows[4].id, rows[5].id])
    with harness.factory() as s:
        attempt = s.query(Attempt).filter_by(request_id=dead).one()
        assert attempt.outcome == "abandoned" and attempt.ended_at is not None
    # The requeued row keeps its history: the next attempt is number 2.
    with transaction(harness.factory) as s:
        assert begin_attempt(s, dead, "w2").number == 2


def test_a_tenants_window_spans_its_batches_and_every_processor(harness: Harness):
    a1, a2 = (harness.submit(jsonl([chat(i) for i in range(100)]), tenant="a") for _ in range(2))
    b1 = harness.submit(jsonl([chat(i) for i in range(100)]), tenant="b")
    first, second = harness.processor(window=30, claim_per_round=2), harness.processor(window=30)
    first.tick()  # holds a1 and a2
    second.tick()  # holds b1
    assert first.owned == {a1, a2} and second.owned == {b1}
    queued = {b: _statuses(harness, b).get("queued", 0) for b in (a1, a2, b1)}
    assert queued[a1] + queued[a2] == 30 and queued[b1] == 30, queued

    # a2 moves to the second processor: tenant a's window still holds across both.
    first.lease.release({a2})
    first.owned.discard(a2)
    for row in harness.rows(a1)[:10]:
        if row.status == "queued":
            harness.succeed(row.id)
    second.tick()
    first.tick()
    assert second.owned == {a2, b1}
    in_flight_a = sum(_statuses(harness, b).get("queued", 0) for b in (a1, a2))
    assert in_flight_a == 30, in_flight_a
