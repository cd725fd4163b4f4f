"""The worker's presence in Redis, in RQ's format: its worker hash and sets (`rq info`, `Worker.all()`),
its heartbeat, and the scheduler lock that picks one process to move due retries back to the queue."""

from __future__ import annotations

import os
import socket
import sys

import redis.asyncio as aioredis

from async_processor.queue import ClaimQueue
from holdback import jobs


class WorkerNameTaken(RuntimeError):
    pass


class Registration:
    def __init__(self, redis: aioredis.Redis, queue: ClaimQueue, concurrency: int, ttl: int):
        self.redis = redis
        self.queue = queue
        self.name = queue.worker_name
        self.key = queue.worker_key
        self.concurrency = concurrency
        self.ttl = ttl
        self.birth = jobs.timestamp()
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.state = "starting"
        self._lock_script = redis.register_script(jobs.SCHEDULER_LOCK_SCRIPT)
        self._release_script = redis.register_script(jobs.SCHEDULER_RELEASE_SCRIPT)
        self.lock_key = jobs.scheduler_lock_key(queue.name)
        self.scheduler_key = jobs.scheduler_key(self.name)

    def _hash(self, in_flight: int) -> dict[str, str | int]:
        return {
            "birth": self.birth,
            "last_heartbeat": jobs.timestamp(),
            "queues": self.queue.name,
            "pid": self.pid,
            "hostname": self.hostname,
            "ip_address": "unknown",
            "version": jobs.RQ_VERSION,
            "python_version": sys.version,
            "state": self.state,
            "concurrency": self.concurrency,
            "in_flight": in_flight,
            "worker_class": "async_processor.worker.AsyncWorker",
        }

    async def register_birth(self) -> None:
        if await self.redis.exists(self.key) and not await self.redis.hexists(self.key, "death"):
            raise WorkerNameTaken(
                f"a live worker named {self.name!r} is registered in Redis; give this one another --name "
                f"or wait {self.ttl + 60}s for the old registration to expire")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            await self._write(pipe, 0)
            await pipe.execute()

    async def heartbeat(self, in_flight: int) -> None:
        """Rewrite the whole registration: it also comes back after Redis lost it (flush, failover)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            await self._write(pipe, in_flight)
            await pipe.execute()

    async def _write(self, pipe, in_flight: int) -> None:
        pipe.hset(self.key, mapping=self._hash(in_flight))
        pipe.expire(self.key, self.ttl + 60)
        pipe.sadd(jobs.WORKERS_KEY, self.key)
        pipe.sadd(jobs.workers_by_queue_key(self.queue.name), self.key)

    async def register_death(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(jobs.WORKERS_KEY, self.key)
            pipe.srem(jobs.workers_by_queue_key(self.queue.name), self.key)
            pipe.hset(self.key, "death", jobs.timestamp())
            pipe.expire(self.key, 60)
            pipe.delete(self.queue.executions_key)
            await pipe.execute()

    # -- the scheduler role: RQ's lock key, so a plain `rq worker --with-scheduler` takes turns with us --

    async def acquire_scheduler(self, ttl: int) -> bool:
        """Acquire or refresh the queue's scheduler lock; True while this worker holds it."""
        outcome = await self._lock_script(keys=[self.lock_key], args=[self.name, ttl])
        if outcome in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.scheduler_key, mapping={
                    "name": self.name, "hostname": self.hostname, "pid": str(self.pid), "queues": self.queue.name,
                    "created_at": self.birth, "last_heartbeat": jobs.timestamp()})
                pipe.expire(self.scheduler_key, ttl)
                await pipe.execute()
            return True
        return False

    async def release_scheduler(self) -> None:
        await self._release_script(keys=[self.lock_key], args=[self.name])
        await self.redis.delete(self.scheduler_key)
