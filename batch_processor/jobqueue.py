"""The processor's side of the hand-off: one RQ job per request row (`holdback.jobs`), and the batch
cancel channel.

Contract with the worker (async_processor; the names are in `holdback.contract`):
- queue `requests_queue_name(namespace)`, job function `JOB_FUNCTION`, args `(row_id, batch_id)`,
  job id = row id, `result_ttl=0`, no RQ retries: the database drives retries;
- cancel events: `PUBLISH cancel_channel(namespace) <batch_id>`; a worker aborts every in-flight request
  of that batch (closing its gateway connection so the gateway aborts upstream).

A row is pushed only after a conditional UPDATE moved it to `queued` in a committed transaction,
so each pending->queued (or reconciliation) transition pushes its job id once.
"""

from __future__ import annotations

from typing import Iterable

import redis

from holdback import jobs
from holdback.contract import cancel_channel, requests_queue_name

# A started job whose hash shows a heartbeat this recent still has a live worker (RQ's default
# heartbeat TTL is 90 s: a 30 s monitoring interval plus 60 s).
HEARTBEAT_FRESH_SECONDS = 90.0


class RequestQueue:
    def __init__(self, connection: redis.Redis, namespace: str):
        self.connection = connection
        self.namespace = namespace
        self.queue = jobs.rq_queue(connection, requests_queue_name(namespace))

    def push(self, rows: Iterable[tuple[str, str]], at_front: bool = False) -> int:
        """Enqueue (row_id, batch_id) pairs in order (`at_front`: ahead of everything waiting, still in this
        order); returns how many were pushed."""
        return jobs.push(self.connection, self.queue.name, rows, at_front=at_front)

    def remove(self, row_ids: Iterable[str]) -> None:
        """Take jobs that have not started out of the queue and the scheduled registry, and delete them.

        A job a worker already took stays; the worker finds its row final and does nothing, or is
        told to abort by the cancel event."""
        jobs.remove(self.connection, self.queue.name, row_ids)

    def worker_capacity(self) -> int:
        """Requests the queue's live workers can run at once: each holdback worker's `concurrency`, 1 for a
        plain `rq worker`; registrations that ended (`death`) or expired do not count."""
        return jobs.worker_capacity(self.connection, self.queue.name)

    def publish_cancel(self, batch_id: str) -> int:
        """Tell workers to abort this batch's in-flight requests; returns how many subscribers heard it."""
        return int(self.connection.publish(cancel_channel(self.namespace), batch_id))

    def depth(self) -> int:
        return jobs.depth(self.connection, self.queue.name)

    def live_ids(self) -> set[str]:
        """Job ids RQ holds somewhere: waiting, being taken, running (live heartbeat) or scheduled, read in one
        snapshot (`holdback.jobs.live_ids`)."""
        return jobs.live_ids(self.connection, self.queue.name)

    def heartbeating_ids(self, row_ids: Iterable[str], within: float = HEARTBEAT_FRESH_SECONDS) -> set[str]:
        """Of these job ids, those whose job hash says started with a heartbeat in the last `within` s
        (a worker that keeps `Job.heartbeat` fresh without RQ's started registry)."""
        return jobs.heartbeating_ids(self.connection, row_ids, within)
