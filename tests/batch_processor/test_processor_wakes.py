"""A processor between rounds waits for a wake-up on its channel, not only for its poll interval: a batch created
is claimed, and a batch whose last row ended is finalized, as soon as the wake-up comes (`jobqueue.Wakes`)."""

from __future__ import annotations

import threading

import redis

from batch_processor.jobqueue import Wakes
from holdback.contract import wake_channel
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401
from tests.support import poll

# Far longer than any wait below: a round that came by the poll would fail the test.
POLL = 120.0


def subscribed(harness: Harness) -> bool:
    channel = wake_channel(harness.settings.redis_namespace)
    return dict(harness.redis.pubsub_numsub(channel)).get(channel.encode(), 0) > 0


def test_a_processor_waiting_out_a_long_poll_claims_a_new_batch_and_finalizes_a_done_one_when_woken(
        harness: Harness):
    p = harness.processor(poll_interval=POLL, lease_seconds=4 * POLL)
    stop = threading.Event()
    loop = threading.Thread(target=p.run, args=(stop,), daemon=True)
    loop.start()
    try:
        # Its first round found nothing; it waits now, subscribed (a wake-up published before that is lost).
        poll(lambda: p._rounds >= 1 and subscribed(harness), 30, "the processor waiting on its wake channel")
        batch_id = harness.submit(jsonl([chat(1), chat(2)]))
        harness.queue.publish_wake(batch_id)  # what the API does after it committed the batch
        poll(lambda: len(harness.queued_job_ids()) == 2, 30, "the new batch's rows queued",
             lambda: f"batch {harness.batch(batch_id).status}, rounds {p._rounds}")
        rounds = p._rounds
        for row in harness.rows(batch_id):
            harness.succeed(row.id)
        poll(lambda: p._rounds == rounds and subscribed(harness), 30, "the processor waiting again")
        harness.queue.publish_wake(batch_id)  # what the worker that made the last row final does
        poll(lambda: harness.batch(batch_id).status == "completed", 30, "the done batch completed",
             lambda: f"batch {harness.batch(batch_id).status}, rounds {p._rounds}")
        assert p._rounds == rounds + 1  # one round for the wake-up, none by the poll
    finally:
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()


def test_a_burst_of_wake_ups_makes_one_round_and_a_lost_redis_makes_the_wait_its_interval(harness: Harness):
    wakes, stop = Wakes(harness.redis, harness.settings.redis_namespace), threading.Event()
    try:
        assert wakes.wait(stop, 0.01) is False  # subscribes; nothing came
        # One pipeline: Redis writes the five to the subscriber in one reply. Published one by one, a loaded
        # machine may hand them over in two reads, and two rounds for a burst is harmless, but not this test's case.
        burst = harness.redis.pipeline(transaction=False)
        for i in range(5):
            burst.publish(wake_channel(harness.settings.redis_namespace), f"batch-{i}")
        burst.execute()
        assert wakes.wait(stop, 30) is True
        assert wakes.wait(stop, 0.05) is False  # the other four were taken with the first
    finally:
        wakes.close()
    broken = Wakes(redis.Redis.from_url("redis://127.0.0.1:1"), harness.settings.redis_namespace)
    assert broken.wait(stop, 0.05) is False  # nothing to subscribe to: the interval, then False
