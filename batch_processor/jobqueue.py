"""The processor's side of the hand-off: one RQ job per request row (`holdback.jobs`), and the batch
cancel channel.

Contract with the worker (async_processor; the names are in `holdback.contract`):
- queue `requests_queue_name(namespace)`, job function `JOB_FUNCTION`, args `(row_id, batch_id)`,
  job id = row id, `result_ttl=0`, no RQ retries: the database drives retries;
- cancel events: `PUBLISH cancel_channel(namespace) <batch_id>`; a worker aborts every in-flight request
  of that batch (closing its gateway connection so the gateway aborts upstream);
- wake-ups: `PUBLISH wake_channel(namespace) <batch_id>` when a worker made a batch's last row final (the API
  publishes one when a batch is created or cancelled); every processor takes its next round at once (`Wakes`);
- work: `PUBLISH work_channel(namespace) <jobs pushed>` after every push; idle workers claim at once.

A row is pushed only after a conditional UPDATE moved it to `queued` in a committed transaction,
so each pending->queued (or reconciliation) transition pushes its job id once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterable

import redis
import redis.client

from holdback import jobs
from holdback.contract import cancel_channel, requests_queue_name, wake_channel, work_channel

# A started job whose hash shows a heartbeat this recent still has a live worker (RQ's default
# heartbeat TTL is 90 s: a 30 s monitoring interval plus 60 s).
HEARTBEAT_FRESH_SECONDS = 90.0
# How soon a processor waiting for a wake-up sees that it was asked to stop.
STOP_CHECK = 0.25


class RequestQueue:
    def __init__(self, connection: redis.Redis, namespace: str):
        self.connection = connection
        self.namespace = namespace
        self.queue = jobs.rq_queue(connection, requests_queue_name(namespace))

    def push(self, rows: Iterable[tuple[str, str]], at_front: bool = False) -> int:
        """Enqueue (row_id, batch_id) pairs in order (`at_front`: ahead of everything waiting, still in this
        order); returns how many were pushed."""
        pushed = jobs.push(self.connection, self.queue.name, rows, at_front=at_front)
        if pushed:
            self.connection.publish(work_channel(self.namespace), pushed)
        return pushed

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

    def publish_wake(self, batch_id: str) -> None:
        """Tell the processors to take their next round now (`Wakes`)."""
        self.connection.publish(wake_channel(self.namespace), batch_id)

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


class Wakes:
    """The processor loop's wait between rounds: until a wake-up comes on `wake_channel` (a batch created or
    cancelled, a batch's last row final), the processor stops, or the poll interval passes. Without it a new
    batch waited up to a poll interval (0.2 s) for its first request and a done batch as long for `completed`.
    While Redis cannot be reached it waits out the interval, and subscribes again on the next wait."""

    def __init__(self, connection: redis.Redis, namespace: str):
        self.connection = connection
        self.channel = wake_channel(namespace)
        self._pubsub: redis.client.PubSub | None = None

    def wait(self, stop: threading.Event, timeout: float) -> bool:
        """True when a wake-up came (every one waiting is taken: a burst makes one round)."""
        deadline = time.monotonic() + timeout
        try:
            if self._pubsub is None:
                self._pubsub = self.connection.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(self.channel)
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._pubsub.get_message(timeout=min(left, STOP_CHECK)) is None:
                    continue  # nothing yet (or the subscription's own confirmation): is it time, or stopped?
                while self._pubsub.get_message(timeout=0) is not None:
                    continue
                return True
            return False
        except redis.RedisError:
            self.close()
            stop.wait(max(0.0, deadline - time.monotonic()))
            return False

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                self._pubsub.close()
            self._pubsub = None
