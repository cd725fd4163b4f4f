"""The Redis side of dispatch: one RQ job per request row, and the batch cancel channel.

Contract with the worker (async_processor; the names are in `holdback.contract`):
- queue `requests_queue_name(namespace)`, job function `JOB_FUNCTION`, args `(row_id, batch_id)`,
  job id = row id, `result_ttl=0`, no RQ retries: the database drives retries;
- cancel events: `PUBLISH cancel_channel(namespace) <batch_id>`; a worker aborts every in-flight request
  of that batch (closing its gateway connection so the gateway aborts upstream).

A row is pushed only after a conditional UPDATE moved it to `queued` in a committed transaction,
so each pending->queued (or reconciliation) transition pushes its job id once.
"""

from __future__ import annotations

import time
from typing import Iterable

import redis
from rq import Queue
from rq.job import Job
from rq.worker_registration import WORKERS_BY_QUEUE_KEY
from rq.utils import utcparse

from holdback.contract import JOB_FUNCTION, cancel_channel, requests_queue_name

# RQ kills a job that runs longer than this; a request's own deadline is enforced by the worker.
JOB_TIMEOUT_SECONDS = 1800
PUSH_CHUNK = 1000
# A started job whose hash shows a heartbeat this recent still has a live worker (RQ's default
# heartbeat TTL is 90 s: a 30 s monitoring interval plus 60 s).
HEARTBEAT_FRESH_SECONDS = 90.0


class RequestQueue:
    def __init__(self, connection: redis.Redis, namespace: str):
        self.connection = connection
        self.namespace = namespace
        self.queue = Queue(requests_queue_name(namespace), connection=connection)

    def push(self, jobs: Iterable[tuple[str, str]], at_front: bool = False) -> int:
        """Enqueue (row_id, batch_id) pairs in order (`at_front`: ahead of everything waiting, still in this
        order); returns how many were pushed."""
        pushed = 0
        batch: list = []
        # Each front push goes before the previous one: push in reverse to keep the given order.
        for row_id, batch_id in (reversed(list(jobs)) if at_front else jobs):
            batch.append(Queue.prepare_data(
                JOB_FUNCTION, args=(row_id, batch_id), job_id=row_id, result_ttl=0, timeout=JOB_TIMEOUT_SECONDS,
                at_front=at_front,
            ))
            if len(batch) >= PUSH_CHUNK:
                pushed += self._push(batch)
                batch = []
        if batch:
            pushed += self._push(batch)
        return pushed

    def _push(self, datas: list) -> int:
        with self.connection.pipeline() as pipe:
            self.queue.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
        return len(datas)

    def remove(self, row_ids: Iterable[str]) -> None:
        """Take jobs that have not started out of the queue and the scheduled registry, and delete them.

        A job a worker already took stays; the worker finds its row final and does nothing, or is
        told to abort by the cancel event."""
        ids = list(row_ids)
        queue_key = self.queue.key
        scheduled_key = self.queue.scheduled_job_registry.key
        for start in range(0, len(ids), PUSH_CHUNK):
            chunk = ids[start:start + PUSH_CHUNK]
            with self.connection.pipeline(transaction=False) as pipe:
                for row_id in chunk:
                    pipe.lrem(queue_key, 0, row_id)
                pipe.zrem(scheduled_key, *chunk)
                pipe.execute()
            # Only delete the hashes of jobs no worker holds: a started job's hash is the worker's to clean.
            started = self._started_ids()
            idle = [row_id for row_id in chunk if row_id not in started]
            if idle:
                self.connection.delete(*(Job.key_for(row_id) for row_id in idle))

    def worker_capacity(self) -> int:
        """Requests the queue's live workers can run at once: each holdback worker's `concurrency`, 1 for a
        plain `rq worker`; registrations that ended (`death`) or expired do not count."""
        keys = list(self.connection.smembers(WORKERS_BY_QUEUE_KEY % self.queue.name))
        if not keys:
            return 0
        with self.connection.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(key, "birth", "death", "concurrency")
            fields = pipe.execute()
        return sum(int(concurrency or 1) for birth, death, concurrency in fields if birth and not death)

    def publish_cancel(self, batch_id: str) -> int:
        """Tell workers to abort this batch's in-flight requests; returns how many subscribers heard it."""
        return int(self.connection.publish(cancel_channel(self.namespace), batch_id))

    def depth(self) -> int:
        return int(self.connection.llen(self.queue.key))

    def live_ids(self) -> set[str]:
        """Job ids RQ holds somewhere: waiting, being taken, running (live heartbeat) or scheduled.

        One MULTI/EXEC, so the four reads are a single snapshot: a job moving between them (a due
        retry going back to the queue, a dead worker's job requeued) is seen exactly where it is.
        A job that finished before the snapshot has changed its row's state, which the caller's
        conditional UPDATE notices."""
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.lrange(self.queue.key, 0, -1)
            pipe.lrange(self.queue.intermediate_queue_key, 0, -1)
            pipe.zrangebyscore(self.queue.started_job_registry.key, time.time(), "+inf")
            pipe.zrange(self.queue.scheduled_job_registry.key, 0, -1)
            queued, taking, started, scheduled = pipe.execute()
        live = {_text(x) for x in queued} | {_text(x) for x in taking} | {_text(x) for x in scheduled}
        live.update(_text(entry).split(":", 1)[0] for entry in started)
        return live

    def _started_ids(self) -> set[str]:
        # Entries are "<job id>:<execution id>" scored by heartbeat expiry; an expired one is a dead worker.
        entries = self.connection.zrangebyscore(self.queue.started_job_registry.key, time.time(), "+inf")
        return {_text(entry).split(":", 1)[0] for entry in entries}

    def heartbeating_ids(self, row_ids: Iterable[str], within: float = HEARTBEAT_FRESH_SECONDS) -> set[str]:
        """Of these job ids, those whose job hash says started with a heartbeat in the last `within` s
        (a worker that keeps `Job.heartbeat` fresh without RQ's started registry)."""
        ids = list(row_ids)
        if not ids:
            return set()
        with self.connection.pipeline(transaction=False) as pipe:
            for row_id in ids:
                pipe.hmget(Job.key_for(row_id), "status", "last_heartbeat")
            replies = pipe.execute()
        cutoff = time.time() - within
        alive = set()
        for row_id, (status, heartbeat) in zip(ids, replies):
            if status is not None and _text(status) == "started" and heartbeat is not None:
                if _heartbeat_ts(_text(heartbeat)) >= cutoff:
                    alive.add(row_id)
        return alive


def _heartbeat_ts(value: str) -> float:
    try:
        return utcparse(value).timestamp()
    except ValueError:
        return 0.0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
