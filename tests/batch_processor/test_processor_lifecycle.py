"""Finalization, cancel and expiry: files with exactly one line per custom_id, partial output kept."""

from __future__ import annotations

import json
import time

from sqlalchemy import func, select

from batch_processor.finalize import finalize_batch, result_file_id
from holdback.db import transaction
from holdback.models import BatchStatus, File, RequestStatus
from holdback.results import close_unfinished
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401


def _lines_by_custom_id(harness: Harness, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = harness.read_file(file_id)
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in one file"
    return by_id


def _file_rows(harness: Harness) -> int:
    with harness.factory() as s:
        return s.scalar(select(func.count()).select_from(File).where(File.purpose == "batch_output"))


def test_finalize_writes_one_line_per_custom_id(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(7)]))
    p = harness.processor(window=10)
    p.tick()
    rows = harness.rows(batch_id)
    for row in rows[:5]:
        harness.succeed(row.id, tokens=4)
    harness.fail(rows[5].id, status=400)
    harness.fail(rows[6].id, status=404)

    done = p.tick()

    assert done.finished == {batch_id: "completed"}
    batch = harness.batch(batch_id)
    assert batch.status == "completed" and batch.finalizing_at and batch.completed_at
    assert (batch.total, batch.completed, batch.failed) == (7, 5, 2)
    assert (batch.input_tokens, batch.output_tokens) == (25, 20)
    assert batch.claimed_by is None
    output = _lines_by_custom_id(harness, batch.output_file_id)
    errors = _lines_by_custom_id(harness, batch.error_file_id)
    assert sorted(output) == [f"req-{i}" for i in range(5)]
    assert sorted(errors) == ["req-5", "req-6"]
    assert output["req-0"]["response"]["status_code"] == 200 and output["req-0"]["error"] is None
    assert output["req-0"]["id"] == rows[0].id and output["req-0"]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert errors["req-5"]["response"]["status_code"] == 400 and errors["req-5"]["error"] is None
    with harness.factory() as s:
        out_file = s.get(File, batch.output_file_id)
        assert (out_file.purpose, out_file.tenant_id, out_file.status) == ("batch_output", batch.tenant_id, "processed")
        assert out_file.bytes == harness.store.size(out_file.storage_key) and out_file.expires_at > time.time()


def test_an_answer_holding_unicode_line_separators_stays_on_one_line_for_any_splitter(harness: Harness):
    # A real model's text holds any character. Python's str.splitlines (which our example client uses) also ends
    # a line at U+0085, U+2028, U+2029 and the C0 separators; the file escapes them so every reader sees one line
    # per row, and the text comes back exact.
    text = "before\u2028mid\u2029after\x85next\x0bvt\x0cff\x1cfs\x1dgs\x1ers \u00e9\u4e2d\U0001f600"
    batch_id = harness.submit(jsonl([chat(i) for i in range(2)]))
    p = harness.processor(window=10)
    p.tick()
    for row in harness.rows(batch_id):
        harness.succeed(row.id, content=text)
    assert p.tick().finished == {batch_id: "completed"}
    with harness.factory() as s:
        key = s.get(File, harness.batch(batch_id).output_file_id).storage_key
    raw = b"".join(harness.store.iter_chunks(key)).decode()
    lines = raw.splitlines()
    assert len(lines) == 2, lines
    assert [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] for line in lines] == [text] * 2
    assert "\u00e9\u4e2d" in raw, "UTF-8 stays UTF-8: only the line breaks are escaped"


def test_no_output_file_without_successes_and_no_error_file_without_errors(harness: Harness):
    all_failed = harness.submit(jsonl([chat(i) for i in range(2)]))
    all_ok = harness.submit(jsonl([chat(i) for i in range(2)]))
    p = harness.processor()
    p.tick()
    for row in harness.rows(all_failed):
        harness.fail(row.id)
    for row in harness.rows(all_ok):
        harness.succeed(row.id)
    p.tick()
    failed, ok = harness.batch(all_failed), harness.batch(all_ok)
    assert failed.status == ok.status == "completed"
    assert failed.output_file_id is None and failed.error_file_id is not None
    assert ok.output_file_id is not None and ok.error_file_id is None


def test_finalize_after_a_crash_produces_the_same_files_once(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(4)]))
    p = harness.processor()
    p.tick()
    rows = harness.rows(batch_id)
    for row in rows[:3]:
        harness.succeed(row.id)
    harness.fail(rows[3].id)
    # A processor died mid-finalize: the batch says finalizing, and a half-written output file is on disk.
    harness.set_batch(batch_id, status="finalizing", finalizing_at=int(time.time()))
    with harness.store.open_writer(result_file_id(batch_id, "output")) as w:
        w.write(b'{"custom_id": "req-0", "trunc')
        w.commit()

    done = p.tick()

    assert done.finished == {batch_id: "completed"}
    batch = harness.batch(batch_id)
    assert batch.output_file_id == result_file_id(batch_id, "output")
    assert sorted(_lines_by_custom_id(harness, batch.output_file_id)) == ["req-0", "req-1", "req-2"]
    assert sorted(_lines_by_custom_id(harness, batch.error_file_id)) == ["req-3"]
    assert _file_rows(harness) == 2
    # Finalizing again (a second processor that also thought it held the batch) is a no-op.
    again = finalize_batch(harness.factory, harness.store, batch_id, to_status=BatchStatus.completed,
                           from_statuses=(BatchStatus.finalizing,), owner=None)
    assert again is None and _file_rows(harness) == 2


def test_cancel_keeps_partial_output_and_removes_queued_jobs(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(10)]))
    other = harness.submit(jsonl([chat(i) for i in range(3)]), tenant="t2")
    p = harness.processor(window=5)
    p.tick()
    rows = harness.rows(batch_id)
    harness.succeed(rows[0].id)
    harness.succeed(rows[1].id)
    p.tick()  # the window refills: 5 of this batch and 3 of the other are queued
    assert len(harness.queued_job_ids()) == 8
    pubsub = harness.redis.pubsub()
    pubsub.subscribe(f"{harness.settings.redis_namespace}:cancel")
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"

    harness.set_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))  # what the API does
    done = p.tick()

    assert done.finished == {batch_id: "cancelled"}
    batch = harness.batch(batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.completed_at is None
    assert (batch.total, batch.completed, batch.failed) == (10, 2, 8)
    output = _lines_by_custom_id(harness, batch.output_file_id)
    errors = _lines_by_custom_id(harness, batch.error_file_id)
    assert sorted(output) == ["req-0", "req-1"]
    assert sorted(errors) == [f"req-{i}" for i in range(2, 10)]
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert all(e["response"] is None for e in errors.values())
    # Only the other batch's jobs remain, and the cancelled batch's job hashes are gone.
    assert sorted(harness.queued_job_ids()) == sorted(r.id for r in harness.rows(other))
    assert not any(harness.redis.exists(f"rq:job:{r.id}") for r in rows[2:])
    message = pubsub.get_message(timeout=2)
    assert message["type"] == "message" and message["data"].decode() == batch_id
    pubsub.close()
    assert harness.batch(other).status == "in_progress"


def test_cancel_while_validating_goes_straight_to_cancelled(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(3)]), status="cancelling")
    harness.processor().tick()
    batch = harness.batch(batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.in_progress_at is None
    assert batch.output_file_id is None and batch.error_file_id is None and harness.rows(batch_id) == []


def test_expiry_keeps_partial_output_with_batch_expired_lines(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(6)]))
    p = harness.processor(window=4)
    p.tick()
    rows = harness.rows(batch_id)
    harness.succeed(rows[0].id)
    harness.fail(rows[1].id)
    harness.set_batch(batch_id, expires_at=int(time.time()) - 1)  # the completion window ran out

    done = p.tick()

    assert done.finished == {batch_id: "expired"}
    batch = harness.batch(batch_id)
    assert batch.status == "expired" and batch.expired_at and batch.completed_at is None
    assert (batch.total, batch.completed, batch.failed) == (6, 1, 5)
    assert sorted(_lines_by_custom_id(harness, batch.output_file_id)) == ["req-0"]
    errors = _lines_by_custom_id(harness, batch.error_file_id)
    assert sorted(errors) == [f"req-{i}" for i in range(1, 6)]
    assert errors["req-1"]["response"]["status_code"] == 400
    expired = [errors[f"req-{i}"]["error"] for i in range(2, 6)]
    assert {e["code"] for e in expired} == {"batch_expired"}
    assert "completion window expired" in expired[0]["message"]
    assert harness.queued_job_ids() == []


def test_a_validating_batch_past_its_window_expires(harness: Harness):
    batch_id = harness.submit(jsonl([chat(0)]), expires_in=-5)
    harness.processor().tick()
    batch = harness.batch(batch_id)
    assert batch.status == "expired" and batch.expired_at and harness.rows(batch_id) == []


def test_an_expiry_a_dead_processor_left_half_way_is_finished(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(3)]))
    p = harness.processor()
    p.tick()
    harness.succeed(harness.rows(batch_id)[0].id)
    # The dead processor closed the rows as expired, then died before writing files.
    with transaction(harness.factory) as s:
        close_unfinished(s, batch_id, RequestStatus.expired, "batch_expired", "window expired")
    done = p.tick()
    assert done.finished == {batch_id: "expired"}
    assert harness.batch(batch_id).completed == 1


def test_a_batch_that_finished_in_time_completes_even_if_finalized_late(harness: Harness):
    batch_id = harness.submit(jsonl([chat(i) for i in range(2)]))
    p = harness.processor()
    p.tick()
    for row in harness.rows(batch_id):
        harness.succeed(row.id)
    harness.set_batch(batch_id, expires_at=int(time.time()) - 1)  # the processor only looks after the window
    p.tick()
    batch = harness.batch(batch_id)
    assert batch.status == "completed" and batch.expired_at is None and batch.completed == 2
