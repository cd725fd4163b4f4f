"""The worker's Redis structures, read back through RQ's own API and CLI.

The worker moves jobs with its own Lua scripts over RQ's private layout (executions, the started and
scheduled registries, the worker hash). pyproject pins RQ to the release line these tests pass on: a
release that moves a key or changes a format fails here, not in a deployment.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis.asyncio as aioredis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.worker import Worker

from async_processor.queue import Finish, ClaimQueue
from async_processor.registration import Registration


@pytest.fixture
def layout(backend):
    name = f"{backend.namespace}-layout"
    sync = backend.redis()
    queue = Queue(name, connection=sync)
    ids = [f"row-{uuid.uuid4().hex}" for _ in range(4)]
    for row_id in ids:
        queue.enqueue("async_processor.job.run_request", args=(row_id, "batch-x"), job_id=row_id, result_ttl=0)
    yield backend, sync, queue, ids
    for row_id in ids:
        sync.delete(f"rq:job:{row_id}", f"rq:results:{row_id}", f"rq:executions:{row_id}")
    sync.close()


def rq_info(backend, queue_name: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", backend.redis_url, queue_name],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_rq_reads_what_the_worker_scripts_write(layout):
    backend, sync, queue, ids = layout
    scheduled_id, failed_id, deleted_id, requeued_id = ids
    worker_name = f"{backend.namespace}-w"

    async def scenario() -> None:
        client = aioredis.Redis.from_url(backend.redis_url)
        rq_queue = ClaimQueue(client, queue.name, worker_name, ttl=60, failure_ttl=600)
        registration = Registration(client, rq_queue, concurrency=8, ttl=60)
        try:
            await registration.register_birth()
            workers = Worker.all(queue=queue)
            assert [(w.name, w.pid) for w in workers] == [(worker_name, registration.pid)]

            claims, missing = await rq_queue.claim(8)
            assert missing == 0 and sorted(c.job_id for c in claims) == sorted(ids)
            assert queue.count == 0
            assert sorted(StartedJobRegistry(queue=queue).get_job_ids(cleanup=False)) == sorted(ids)
            for claim in claims:
                job = Job.fetch(claim.job_id, connection=sync)
                assert job.get_status() == JobStatus.STARTED and job.worker_name == worker_name
                assert [e.id for e in job.get_executions()] == [claim.execution_id]
            info = rq_info(backend, queue.name)
            assert worker_name in info and queue.name in info

            by_id = {c.job_id: c for c in claims}
            await rq_queue.finish(by_id[scheduled_id], Finish.schedule, time.time() + 3600)
            await rq_queue.finish(by_id[failed_id], Finish.failed, succeeded=False,
                                  reason="failed: gave up after 5 transient failures")
            await rq_queue.finish(by_id[deleted_id], Finish.delete)
            await rq_queue.finish(by_id[requeued_id], Finish.requeue)

            assert StartedJobRegistry(queue=queue).get_job_ids(cleanup=False) == []
            assert ScheduledJobRegistry(queue=queue).get_job_ids() == [scheduled_id]
            assert Job.fetch(scheduled_id, connection=sync).get_status() == JobStatus.SCHEDULED
            assert FailedJobRegistry(queue=queue).get_job_ids() == [failed_id]
            failed = Job.fetch(failed_id, connection=sync)
            assert failed.get_status() == JobStatus.FAILED
            result = failed.latest_result()
            assert result.type is Result.Type.FAILED and result.worker_name == worker_name
            assert result.exc_string == "failed: gave up after 5 transient failures"
            with pytest.raises(NoSuchJobError):
                Job.fetch(deleted_id, connection=sync)
            assert queue.job_ids == [requeued_id]
            assert Job.fetch(requeued_id, connection=sync).get_status() == JobStatus.QUEUED

            # The scheduler role: a due job goes to the front of the queue and RQ sees it queued.
            sync.zadd(ScheduledJobRegistry(queue=queue).key, {scheduled_id: time.time() - 1})
            assert await rq_queue.move_due() == 1
            assert queue.job_ids == [scheduled_id, requeued_id]
            assert Job.fetch(scheduled_id, connection=sync).get_status() == JobStatus.QUEUED

            worker = Worker.find_by_key(rq_queue.worker_key, connection=sync)
            # Every ended execution is counted; only the failed one as a failure.
            assert (worker.successful_job_count, worker.failed_job_count) == (3, 1)

            await registration.register_death()
            assert Worker.all(queue=queue) == []
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_failed_job_without_a_reason_writes_no_result(layout):
    backend, sync, queue, ids = layout

    async def scenario() -> None:
        client = aioredis.Redis.from_url(backend.redis_url)
        rq_queue = ClaimQueue(client, queue.name, f"{backend.namespace}-w", ttl=60, failure_ttl=600)
        try:
            claims, _ = await rq_queue.claim(1)
            await rq_queue.finish(claims[0], Finish.failed, succeeded=False)
            job = Job.fetch(claims[0].job_id, connection=sync)
            assert job.get_status() == JobStatus.FAILED and job.latest_result() is None
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_heartbeat_that_read_a_claim_before_its_requeue_re_adds_it_and_forget_takes_it_back(layout):
    # The race a stopping worker meets (CI, test_sigterm_requeues_...): a heartbeat's snapshot of its claims is
    # taken, the drain requeues one of them, then the heartbeat writes; the started registry shows the requeued job
    # started by nobody until the worker, its heartbeats stopped, forgets what it requeued.
    backend, sync, queue, ids = layout

    async def scenario() -> None:
        client = aioredis.Redis.from_url(backend.redis_url)
        rq_queue = ClaimQueue(client, queue.name, f"{backend.namespace}-w", ttl=60, failure_ttl=600)
        started = StartedJobRegistry(queue=queue)
        try:
            claims, _ = await rq_queue.claim(1)
            await rq_queue.finish(claims[0], Finish.requeue)
            assert started.get_job_ids(cleanup=False) == [] and claims[0].job_id in queue.get_job_ids()
            await rq_queue.heartbeat(claims)  # the snapshot taken before the requeue
            assert started.get_job_ids(cleanup=False) == [claims[0].job_id]
            await rq_queue.forget(claims)
            assert started.get_job_ids(cleanup=False) == [] and claims[0].job_id in queue.get_job_ids()
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_stock_rq_worker_tears_down_after_its_pubsub_thread_has_read_the_unsubscribe(backend):
    # RQ's worker listens for commands on a pubsub thread that waits up to 60 s for a subscription, and its
    # teardown stops that thread expecting `stop()` to return at once (it joins for 1 s itself). redis-py 8.2
    # made `stop()` join without a bound, so once the thread has read the unsubscribe reply a burst
    # `rq worker` hung up to 60 s on exit; pyproject keeps redis below that release. Put the thread in that
    # state deterministically and require the teardown to finish well inside the 60 s.
    sync = backend.redis()
    worker = Worker([Queue(f"{backend.namespace}-teardown", connection=sync)], connection=sync)
    worker.subscribe()
    try:
        deadline = time.monotonic() + 30
        while not worker.pubsub.subscribed:
            assert time.monotonic() < deadline, "the worker's pubsub thread never subscribed"
            time.sleep(0.05)
        worker.pubsub.unsubscribe()
        while worker.pubsub.subscribed:
            assert time.monotonic() < deadline, "the worker's pubsub thread never read the unsubscribe reply"
            time.sleep(0.05)
        done = threading.Event()
        threading.Thread(target=lambda: (worker.unsubscribe(), done.set()), daemon=True).start()
        assert done.wait(15), "RQ's worker teardown waited on its pubsub thread (redis-py's stop() joins)"
    finally:
        sync.close()
