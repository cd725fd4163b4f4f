"""One tenant's volume against the processor's round: a large cancel closes its rows a chunk per transaction
and goes on next round once the round's budget is spent, and whole-batch steps are taken one tenant at a
time in turn, so a tenant with many large batches holds up no other tenant's batch."""

from __future__ import annotations

import time

from batch_processor.closing import cancel_batch
from holdback.models import RequestStatus
from tests.batch_processor.test_processor_support import Harness, ReadHooks, chat, jsonl


class _Stopper:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def stop_batch(self, batch_id: str, row_ids: list[str]) -> None:
        self.calls.append(len(row_ids))


def test_a_cancel_past_its_deadline_stops_after_one_chunk_and_the_next_call_finishes_it(backend):
    harness = Harness(backend)
    try:
        batch_id = harness.submit(jsonl([chat(i) for i in range(4500)]))
        p = harness.processor(window=10)
        p.tick()
        harness.set_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))
        stopper = _Stopper()
        # A deadline already past: one chunk (2,000 rows), then the call returns with the batch still open.
        assert cancel_batch(harness.factory, harness.store, stopper, batch_id, owner=p.config.name,
                            deadline=time.monotonic()) is None
        statuses = [r.status for r in harness.rows(batch_id)]
        assert statuses.count(RequestStatus.cancelled.value) == 2000
        assert harness.batch(batch_id).status == "cancelling" and harness.batch(batch_id).failed == 2000
        result = cancel_batch(harness.factory, harness.store, stopper, batch_id, owner=p.config.name)
        assert result is not None and result.status == "cancelled"
        batch = harness.batch(batch_id)
        assert (batch.total, batch.failed) == (4500, 4500)
        assert len(harness.read_file(batch.error_file_id)) == 4500, "one error line per row, none twice"
        assert sum(stopper.calls) == 10, "the queued window's jobs removed once, whichever chunk held them"
    finally:
        harness.close()


def test_whole_batch_steps_take_turns_between_tenants(backend):
    harness = Harness(backend)
    try:
        flood = [harness.submit(jsonl([chat(i) for i in range(50)]), tenant="flood") for _ in range(4)]
        quiet = harness.submit(jsonl([chat(i) for i in range(50)]), tenant="quiet")
        # No budget: one whole-batch step per round.
        p = harness.processor(window=10, round_work_seconds=0.0)
        p.tick()
        p.tick()
        assert harness.batch(quiet).status == "in_progress", "the quiet tenant's turn came in the second round"
        assert sum(harness.batch(b).status == "in_progress" for b in flood) == 1
        for _ in range(3):
            p.tick()
        assert all(harness.batch(b).status == "in_progress" for b in flood)
    finally:
        harness.close()


def test_a_long_step_refills_the_running_batches_windows_while_it_lasts(backend):
    # A window of rows lasts a fraction of a second at full speed; expanding (closing, finalizing) another
    # tenant's 10,000-row batch takes longer, and the quiet tenant's workers ran dry until the step ended.
    harness = Harness(backend)
    try:
        quiet = harness.submit(jsonl([chat(i) for i in range(100)]), tenant="quiet")
        p = harness.processor(window=10, poll_interval=0.004)
        p.tick()
        first = harness.queued_job_ids()
        assert len(first) == 10
        harness.submit(jsonl([chat(i) for i in range(3000)]), tenant="flood")
        seen: list[set[str]] = []

        def workers_finish_the_window() -> None:
            for row_id in first:
                harness.succeed(row_id)

        p.store = ReadHooks(harness, {1000: workers_finish_the_window,
                                      2000: lambda: seen.append(set(harness.queued_job_ids()))})
        assert p.tick().expanded != []
        quiet_rows = {r.id for r in harness.rows(quiet)}
        assert len(seen[0] & quiet_rows - set(first)) == 10, "the quiet window refilled during the expansion"
    finally:
        harness.close()
