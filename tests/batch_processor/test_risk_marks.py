"""The processor marks its batches at risk of missing their window in Redis for the workers, counts them, and
takes a mark back once the batch's pace would finish it in time; marks a dead owner left lapse."""

from __future__ import annotations

import time

from holdback.contract import at_risk_key
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401


def test_a_batch_behind_its_pace_is_marked_and_unmarked_once_it_catches_up(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(10)]))
    on_time = harness.submit(jsonl([chat(i) for i in range(2)]), tenant="t2")
    p = harness.processor(window=10)
    p.tick()
    assert harness.batch(batch_id).status == "in_progress"
    now = time.time()
    # 100 s in with nothing finished and 50 s left: at risk. The other batch has its whole day left.
    harness.set_batch(batch_id, in_progress_at=int(now - 100), expires_at=int(now + 50))
    harness.set_batch(on_time, in_progress_at=int(now - 1))
    key = at_risk_key(harness.settings.redis_namespace)
    assert p.risk.update([batch_id, on_time], force=True) == {batch_id}
    marks = dict(harness.redis.zrange(key, 0, -1, withscores=True))
    assert set(marks) == {batch_id.encode()} and marks[batch_id.encode()] > time.time()
    assert p.metrics.batches_at_risk._value.get() == 1
    # Nine of ten finish: the last needs ~11 s at this pace, well inside the 50 s left.
    for row in harness.rows(batch_id)[:9]:
        harness.succeed(row.id)
    assert p.risk.update([batch_id, on_time], force=True) == set()
    assert harness.redis.zcard(key) == 0 and p.metrics.batches_at_risk._value.get() == 0


def test_a_mark_a_dead_processor_left_lapses(harness: Harness):
    p = harness.processor()
    key = at_risk_key(harness.settings.redis_namespace)
    harness.redis.zadd(key, {"batch_of_a_dead_owner": time.time() - 1, "batch_still_marked": time.time() + 30})
    p.risk.update([], force=True)
    assert harness.redis.zrange(key, 0, -1) == [b"batch_still_marked"]
