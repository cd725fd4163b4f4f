"""Due retries go to the front of the queue, in due order, ahead of jobs that never ran."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from rq import Queue

from async_processor.queue import ClaimQueue
from holdback.contract import requests_queue_name


def test_due_retries_jump_ahead_of_waiting_jobs_in_due_order(backend):
    name = requests_queue_name(backend.namespace)
    sync = backend.redis()
    q = Queue(name, connection=sync)
    for i in range(3):
        q.enqueue("async_processor.job.run_request", f"row-new-{i}", "b", job_id=f"row-new-{i}", result_ttl=0)
    now = time.time()
    for i in range(2):
        job = q.enqueue("async_processor.job.run_request", f"row-retry-{i}", "b", job_id=f"row-retry-{i}",
                        result_ttl=0)
        sync.lrem(q.key, 0, job.id)
        q.scheduled_job_registry.schedule(job, _utc(now - 10 + i))  # retry-0 fell due before retry-1

    async def move() -> int:
        client = aioredis.Redis.from_url(backend.redis_url)
        try:
            return await ClaimQueue(client, name, "test-worker", ttl=60, failure_ttl=60).move_due()
        finally:
            await client.aclose()

    assert asyncio.run(move()) == 2
    order = [x.decode() for x in sync.lrange(q.key, 0, -1)]
    assert order == ["row-retry-0", "row-retry-1", "row-new-0", "row-new-1", "row-new-2"]
    assert q.scheduled_job_registry.count == 0


def _utc(ts: float):
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc)
