"""The worker's two channels from the processor, on the test's Redis: a push wakes an idle worker's claim loop
at once (it would otherwise wait out its idle poll), and a cancel aborts the batch's requests here."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from async_processor.config import WorkerConfig
from async_processor.worker import AsyncWorker
from batch_processor.jobqueue import RequestQueue
from holdback.contract import requests_queue_name, work_channel


def worker(backend) -> AsyncWorker:  # noqa: ANN001
    return AsyncWorker(WorkerConfig(name="w-channels", queue_name=requests_queue_name(backend.namespace),
                                    namespace=backend.namespace, redis_url=backend.redis_url,
                                    database_url=backend.database_url, gateway_url="http://127.0.0.1:1",
                                    gateway_key=None))


def test_a_push_wakes_an_idle_worker_and_a_cancel_reaches_it(backend):
    w = worker(backend)
    published = backend.redis()
    channel = work_channel(backend.namespace)

    async def scenario() -> None:
        w.redis = aioredis.Redis.from_url(backend.redis_url)
        listener = asyncio.create_task(w._channel_listener())
        try:
            async def subscribed() -> None:
                while dict(published.pubsub_numsub(channel)).get(channel.encode(), 0) == 0:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(subscribed(), 30)
            idle = asyncio.create_task(w._idle(600.0))  # far longer than the wait below
            # What the processor does when it hands rows off: push the jobs, then say so.
            # (The job's id names the namespace: the backend's clean-up takes its RQ hash with the rest.)
            assert RequestQueue(published, backend.namespace).push([(f"{backend.namespace}-row", "batch-1")]) == 1
            await asyncio.wait_for(idle, 30)
            assert w.work_pushed.is_set()
            published.publish(f"{backend.namespace}:cancel", "batch-1")

            async def cancelled() -> None:
                while "batch-1" not in w.cancelled_batches:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(cancelled(), 30)
        finally:
            w.closing.set()
            await asyncio.wait_for(listener, 30)
            await w.redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        published.close()


def test_an_idle_wait_ends_at_its_interval_or_at_a_stop(backend):
    w = worker(backend)

    async def scenario() -> None:
        await asyncio.wait_for(w._idle(0.01), 30)  # nothing pushed: the interval
        waiting = asyncio.create_task(w._idle(600.0))
        w.stop()
        await asyncio.wait_for(waiting, 30)

    asyncio.run(scenario())
