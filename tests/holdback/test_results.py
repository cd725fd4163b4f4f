"""The compare-and-set that makes a request final: exactly one winner, counters moved once."""

import json

from holdback.attempts.transactions import begin_attempt
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch, RequestRow, RequestStatus, Tenant
from holdback.results import (
    FinalResult,
    TokenUsage,
    close_unfinished,
    any_unfinished,
    deferred_batch_counts,
    output_line,
    record_final,
)


def _batch_with_rows(factory, n, tenant="t1"):
    with transaction(factory) as s:
        t = Tenant(name=tenant)
        s.add(t)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint="/v1/chat/completions", input_file_id="file-x",
                  completion_window="24h", window_seconds=86400, status="in_progress", total=n)
        s.add(b)
        s.flush()
        rows = [RequestRow(batch_id=b.id, tenant_id=t.id, line=i + 1, custom_id=f"c{i}",
                           url="/v1/chat/completions", body="{}") for i in range(n)]
        s.add_all(rows)
        s.flush()
        return b.id, [r.id for r in rows]


def _ok(tokens=3):
    return FinalResult(RequestStatus.succeeded, 200, {"usage": {"prompt_tokens": 5, "completion_tokens": tokens}},
                       usage=TokenUsage(5, tokens))


def test_second_final_result_is_a_counted_noop(backend):
    factory = make_sessionmaker(make_engine(backend.database_url))
    batch_id, (row_id,) = _batch_with_rows(factory, 1)
    with transaction(factory) as s:
        assert begin_attempt(s, row_id, "w1").number == 1
        assert record_final(s, row_id, _ok(3)) is True
    with transaction(factory) as s:
        assert record_final(s, row_id, _ok(9)) is False
        assert begin_attempt(s, row_id, "w2") is None
    with factory() as s:
        row, batch = s.get(RequestRow, row_id), s.get(Batch, batch_id)
        assert (row.status, row.output_tokens, row.duplicates, row.attempts) == ("succeeded", 3, 1, 1)
        assert (batch.completed, batch.failed, batch.output_tokens, batch.input_tokens) == (1, 0, 3, 5)
        line = output_line(row)
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert json.dumps(line)


def test_cancel_closes_only_unfinished_rows_and_a_late_success_loses(backend):
    factory = make_sessionmaker(make_engine(backend.database_url))
    batch_id, rows = _batch_with_rows(factory, 3)
    with transaction(factory) as s:
        record_final(s, rows[0], _ok())
    with transaction(factory) as s:
        assert any_unfinished(s, batch_id)
        closed = close_unfinished(s, batch_id, RequestStatus.cancelled, "batch_cancelled", "cancelled by the user")
        assert closed == 2
        assert not any_unfinished(s, batch_id)
    with transaction(factory) as s:
        assert record_final(s, rows[1], _ok()) is False
    with factory() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.completed, batch.failed) == (1, 2)
        line = output_line(s.get(RequestRow, rows[2]))
        assert line["response"] is None and line["error"]["code"] == "batch_cancelled"


def _counters(factory, batch_id):
    with factory() as s:
        b = s.get(Batch, batch_id)
        return b.completed, b.failed, b.input_tokens, b.output_tokens


def test_deferred_counters_land_once_per_batch_at_the_end_of_the_block(backend):
    factory = make_sessionmaker(make_engine(backend.database_url))
    first, rows = _batch_with_rows(factory, 3)
    second, (other,) = _batch_with_rows(factory, 1, tenant="t2")
    with transaction(factory) as s, deferred_batch_counts(s):
        assert record_final(s, rows[0], _ok(3)) and record_final(s, rows[1], _ok(4))
        assert record_final(s, rows[2], FinalResult(RequestStatus.failed, 400, {"error": {"message": "no"}}))
        assert record_final(s, other, _ok(7))
        with deferred_batch_counts(s):  # nested: still applied once, by the outer block
            assert record_final(s, rows[0], _ok()) is False
        assert s.get(Batch, first).completed == 0  # nothing applied before the block ends
    assert _counters(factory, first) == (2, 1, 10, 7)
    assert _counters(factory, second) == (1, 0, 5, 7)


def test_deferred_counters_are_not_applied_when_the_block_fails(backend):
    factory = make_sessionmaker(make_engine(backend.database_url))
    batch_id, (row_id,) = _batch_with_rows(factory, 1)
    try:
        with transaction(factory) as s, deferred_batch_counts(s):
            record_final(s, row_id, _ok())
            raise RuntimeError("the group failed")
    except RuntimeError:
        pass
    assert _counters(factory, batch_id) == (0, 0, 0, 0)
    with factory() as s:
        assert s.get(RequestRow, row_id).status == "pending"  # rolled back with it


def test_begin_attempt_of_an_open_batch_only_skips_a_closing_batch(backend):
    factory = make_sessionmaker(make_engine(backend.database_url))
    batch_id, (row_id,) = _batch_with_rows(factory, 1)
    with transaction(factory) as s:
        batch = s.get(Batch, batch_id)
        batch.status, batch.expires_at = "cancelling", 4_000_000_000
    with transaction(factory) as s:
        assert begin_attempt(s, row_id, "w1", open_batch_only=True) is None
        opened = begin_attempt(s, row_id, "w1")
        assert (opened.number, opened.batch_id, opened.custom_id, opened.deadline) == (1, batch_id, "c0", 4_000_000_000)
    with factory() as s:
        assert (s.get(RequestRow, row_id).status, s.get(RequestRow, row_id).attempts) == ("running", 1)


def test_usage_reads_the_token_details_of_chat_and_of_responses_bodies():
    chat = {"usage": {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32},
                      "completion_tokens_details": {"reasoning_tokens": 4}}}
    responses = {"usage": {"input_tokens": 40, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 32},
                           "output_tokens_details": {"reasoning_tokens": 4}}}
    assert TokenUsage.from_body(chat) == TokenUsage.from_body(responses) == TokenUsage(40, 9, 32, 4)
    no_details = {"usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}
    assert TokenUsage.from_body(no_details) == TokenUsage(3, 0, 0, 0)
    assert TokenUsage.from_body(None) == TokenUsage()
