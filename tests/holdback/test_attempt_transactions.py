"""holdback.attempts: outcome classes, backoff, and the two transactions of an attempt on a real database."""

import json
import time

import pytest

from holdback.attempts.headers import request_headers
from holdback.attempts.outcomes import Reply, classify, parse_retry_after
from holdback.attempts.retry import Jitter, RetryPolicy, backoff
from holdback.attempts.transactions import Disposition, Skip, open_attempt, record_outcome
from holdback.contract import DEADLINE_HEADER
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, AttemptOutcome, Batch, RequestRow, RequestStatus, Tenant
from holdback.results import output_line

OK_BODY = json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}).encode()


def test_classify_covers_every_outcome_class():
    assert classify(200, {}).kind is AttemptOutcome.success
    evicted = classify(429, {"X-LLM-D-Request-Dropped-Reason": "evicted", "Retry-After": "3"})
    assert (evicted.kind, evicted.evicted, evicted.shed, evicted.retry_after) == (AttemptOutcome.evicted, True, True, 3)
    saturated = classify(429, {"x-llm-d-request-dropped-reason": "rejected-saturated"})
    assert (saturated.kind, saturated.evicted, saturated.drop_reason) == (
        AttemptOutcome.rejected, False, "rejected-saturated")
    assert classify(500, {}).transient and classify(500, {}).kind is AttemptOutcome.server_error
    assert classify(504, {}).transient and classify(None, {}).transient
    assert classify(None, {}).kind is AttemptOutcome.transport_error
    assert classify(400, {}).kind is AttemptOutcome.client_error
    assert classify(404, {}).kind is AttemptOutcome.client_error


def test_retry_after_reads_seconds_and_http_dates():
    assert parse_retry_after("2.5") == 2.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_backoff_doubles_to_the_cap_with_jitter_and_honours_retry_after():
    low, high = (lambda: 0.0), (lambda: 0.999999)
    assert backoff(1, base=2, cap=60, rand=low) == 1.0  # equal jitter: at least half the step
    assert backoff(3, base=2, cap=60, rand=high) == pytest.approx(8.0)
    assert backoff(10, base=2, cap=60, rand=high) == pytest.approx(60.0)
    assert backoff(1, base=2, cap=60, jitter=Jitter.full, rand=low) == 0.0
    assert backoff(1, 30.0, base=2, cap=60) == 30.0  # Retry-After is a floor
    assert backoff(6, 0.5, base=2, cap=60, rand=low) == 30.0


def test_headers_carry_identity_deadline_and_key():
    h = request_headers("batch_req_1", "tnt_1", 1700000000.7, "k")
    assert h["x-request-id"] == "batch_req_1" and h["x-llm-d-inference-fairness-id"] == "tnt_1"
    assert h["x-llm-d-inference-objective"] == "batch" and h[DEADLINE_HEADER] == "1700000000"
    assert h["authorization"] == "Bearer k"
    assert "authorization" not in request_headers("r", "t", None)


@pytest.fixture
def db(backend):
    engine = make_engine(backend.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _rows(factory, n=1, expires_in=3600.0):
    with transaction(factory) as s:
        t = Tenant(name=f"t{time.time_ns()}")
        s.add(t)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                  window_seconds=86400, status="in_progress", total=n, expires_at=int(time.time() + expires_in))
        s.add(b)
        s.flush()
        rows = [RequestRow(batch_id=b.id, tenant_id=t.id, line=i + 1, custom_id=f"c{i}", url="/v1/chat/completions",
                           body="{}", status="queued") for i in range(n)]
        s.add_all(rows)
        s.flush()
        return b.id, [r.id for r in rows]


def _attempt(factory, row_id, reply, policy=RetryPolicy(base=0.1, cap=1.0), now=None):
    with transaction(factory) as s:
        d = open_attempt(s, row_id, "w-test")
        assert not isinstance(d, Skip), d
    with transaction(factory) as s:
        return d, record_outcome(s, d, reply, policy, now=now)


def test_success_records_usage_and_a_second_delivery_is_a_counted_duplicate(db):
    batch_id, (row_id,) = _rows(db)
    with transaction(db) as s:
        first = open_attempt(s, row_id, "w1")
    with transaction(db) as s:
        second = open_attempt(s, row_id, "w2")  # a duplicate delivery while the first is still out
    assert (first.number, second.number) == (1, 2)
    with transaction(db) as s:
        rec = record_outcome(s, second, Reply(200, {"x-sim-replica": "r0"}, OK_BODY), RetryPolicy())
    with transaction(db) as s:
        late = record_outcome(s, first, Reply(200, {}, OK_BODY), RetryPolicy())
    assert rec.disposition is Disposition.final and rec.final_status is RequestStatus.succeeded
    assert late.disposition is Disposition.duplicate
    with transaction(db) as s:
        assert open_attempt(s, row_id, "w3") is Skip.final
    with db() as s:
        row, batch = s.get(RequestRow, row_id), s.get(Batch, batch_id)
        assert (row.status, row.input_tokens, row.output_tokens, row.duplicates) == ("succeeded", 7, 3, 1)
        assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens) == (1, 0, 7, 3)
        attempts = s.query(Attempt).filter_by(request_id=row_id).order_by(Attempt.number).all()
        assert [a.outcome for a in attempts] == ["success", "success"]
        assert attempts[1].replica == "r0" and attempts[1].output_tokens == 3


def test_eviction_retries_without_budget_and_keeps_the_drop_reason(db):
    _, (row_id,) = _rows(db)
    now = time.time()
    for _ in range(8):  # far past the transient budget: evictions are never budgeted
        d, rec = _attempt(db, row_id, Reply(429, {"x-llm-d-request-dropped-reason": "evicted"}, b"{}"), now=now)
        assert rec.disposition is Disposition.retry and rec.outcome.evicted
        # An eviction is the gateway's scheduling, not a failure: back in line at once, however often it came.
        assert (rec.delay, rec.wake_at) == (0.0, now)
    with db() as s:
        row = s.get(RequestRow, row_id)
        assert (row.status, row.evictions, row.transient_failures, row.attempts) == ("retry_wait", 8, 0, 8)
        a = s.query(Attempt).filter_by(request_id=row_id, number=8).one()
        assert (a.outcome, a.evicted, a.drop_reason, a.status_code) == ("evicted", True, "evicted", 429)


def test_an_eviction_waits_only_for_the_gateways_retry_after(db):
    _, (row_id,) = _rows(db)
    now = time.time()
    reply = Reply(429, {"x-llm-d-request-dropped-reason": "evicted", "Retry-After": "3"}, b"{}")
    _, rec = _attempt(db, row_id, reply, RetryPolicy(base=10.0, cap=60.0), now=now)
    assert (rec.disposition, rec.delay, rec.wake_at) == (Disposition.retry, 3.0, now + 3.0)


def test_a_rejection_after_evictions_backs_off_as_a_first_try_would(db):
    """The backoff counts the attempts that were not evicted: four evictions do not make the next rejection
    wait 2**4 steps."""
    _, (row_id,) = _rows(db)
    now = time.time()
    policy = RetryPolicy(base=1.0, cap=60.0)
    for _ in range(4):
        _attempt(db, row_id, Reply(429, {"x-llm-d-request-dropped-reason": "evicted"}, b"{}"), policy, now=now)
    d, rec = _attempt(db, row_id, Reply(429, {"x-llm-d-request-dropped-reason": "saturated"}, b"{}"), policy, now=now)
    assert (d.number, d.evictions, rec.outcome.evicted) == (5, 4, False)
    assert 0.5 <= rec.delay <= 1.0  # the first step's equal jitter: [base/2, base)
    d, rec = _attempt(db, row_id, Reply(429, {"x-llm-d-request-dropped-reason": "saturated"}, b"{}"), policy, now=now)
    assert 1.0 <= rec.delay <= 2.0  # the second


def test_transient_failures_fail_the_row_when_the_budget_is_spent(db):
    batch_id, (row_id,) = _rows(db)
    policy = RetryPolicy(base=0.1, cap=1.0, transient_budget=3)
    replies = [Reply(504, {}, b'{"error": {"message": "slow"}}'), Reply.transport_error("connection reset"),
               Reply(500, {}, b'{"error": {"message": "boom"}}')]
    dispositions = [_attempt(db, row_id, r, policy)[1].disposition for r in replies]
    assert dispositions == [Disposition.retry, Disposition.retry, Disposition.final]
    with db() as s:
        row = s.get(RequestRow, row_id)
        assert (row.status, row.error_code, row.response_status, row.transient_failures) == (
            "failed", "server_error", 500, 3)
        assert "budget 3" in row.error_message
        assert s.get(Batch, batch_id).failed == 1
        assert output_line(row)["response"]["status_code"] == 500


def test_a_failing_path_is_classed_apart_from_a_failing_request():
    refused = classify(None, {}, unreachable=True)
    no_replica = classify(503, {"x-llm-d-request-dropped-reason": "rejected-no-endpoints"})
    for outcome in (refused, no_replica, classify(502, {}), classify(503, {})):
        assert outcome.path_failure and not outcome.transient and not outcome.shed
    assert refused.kind is AttemptOutcome.transport_error and no_replica.kind is AttemptOutcome.server_error
    assert no_replica.drop_reason == "rejected-no-endpoints"
    for outcome in (classify(500, {}), classify(504, {}), classify(None, {}), classify(429, {}), classify(200, {})):
        assert not outcome.path_failure


def test_a_failing_path_retries_without_spending_the_budget(db):
    _, (row_id,) = _rows(db)
    policy = RetryPolicy(base=0.1, cap=1.0, transient_budget=2)
    replies = [Reply.transport_error("ClientConnectorError: refused", unreachable=True), Reply(502, {}, b"{}"),
               Reply(503, {"x-llm-d-request-dropped-reason": "rejected-no-endpoints"}, b"{}"), Reply(503, {}, b"")]
    for reply in replies * 3:  # six times the budget
        assert _attempt(db, row_id, reply, policy)[1].disposition is Disposition.retry
    with db() as s:
        row = s.get(RequestRow, row_id)
        assert (row.status, row.transient_failures, row.attempts) == ("retry_wait", 0, 12)
        outcomes = {a.outcome for a in s.query(Attempt).filter_by(request_id=row_id)}
        assert outcomes == {"transport_error", "server_error"}
    # The request's own failures still count: a 500 and a reset spend the budget of 2.
    assert _attempt(db, row_id, Reply(500, {}, b"{}"), policy)[1].disposition is Disposition.retry
    rec = _attempt(db, row_id, Reply.transport_error("connection reset"), policy)[1]
    assert rec.disposition is Disposition.final and rec.final_status is RequestStatus.failed


def test_transport_failure_at_the_budget_fails_with_an_error_line(db):
    _, (row_id,) = _rows(db)
    _, rec = _attempt(db, row_id, Reply.transport_error("connection reset"), RetryPolicy(transient_budget=1))
    assert rec.disposition is Disposition.final and rec.final_status is RequestStatus.failed
    with db() as s:
        line = output_line(s.get(RequestRow, row_id))
        assert line["response"] is None and line["error"]["code"] == "transport_error"
        assert "connection reset" in line["error"]["message"]


def test_client_error_is_final_and_keeps_the_response(db):
    _, (row_id,) = _rows(db)
    body = b'{"error": {"message": "model not found", "type": "invalid_request_error"}}'
    _, rec = _attempt(db, row_id, Reply(404, {}, body))
    assert rec.disposition is Disposition.final and rec.final_status is RequestStatus.failed
    with db() as s:
        line = output_line(s.get(RequestRow, row_id))
        assert line["response"]["status_code"] == 404
        assert line["response"]["body"]["error"]["message"] == "model not found"


def test_truncated_2xx_body_is_a_transport_error(db):
    _, (row_id,) = _rows(db)
    _, rec = _attempt(db, row_id, Reply(200, {}, OK_BODY[:20]))
    assert rec.disposition is Disposition.retry and rec.outcome.kind is AttemptOutcome.transport_error


def test_retry_that_would_land_past_the_deadline_is_left_for_expiry(db):
    _, (row_id,) = _rows(db, expires_in=5.0)
    now = time.time()
    d, rec = _attempt(db, row_id, Reply(429, {"retry-after": "30"}, b""), now=now)
    assert rec.disposition is Disposition.closing
    with db() as s:
        row = s.get(RequestRow, row_id)
        assert row.status == "retry_wait" and row.next_attempt_at == pytest.approx(d.deadline)
    # Retry-After within the deadline is honoured.
    _, (row2,) = _rows(db, expires_in=3600.0)
    _, rec2 = _attempt(db, row2, Reply(429, {"retry-after": "30"}, b""), now=now)
    assert rec2.disposition is Disposition.retry and rec2.wake_at >= now + 30


def test_begin_skips_batches_past_deadline_or_cancelling(db):
    batch_id, (row_id,) = _rows(db, expires_in=-1.0)
    with transaction(db) as s:
        assert open_attempt(s, row_id, "w") is Skip.closing
    batch_id, (row_id,) = _rows(db)
    with transaction(db) as s:
        s.get(Batch, batch_id).status = "cancelling"
    with transaction(db) as s:
        assert open_attempt(s, row_id, "w") is Skip.closing
    with transaction(db) as s:
        assert open_attempt(s, "batch_req_missing", "w") is Skip.final


def test_abort_after_the_processor_closed_the_row_is_cancelled(db):
    from holdback.results import close_unfinished

    batch_id, (row_id,) = _rows(db)
    with transaction(db) as s:
        d = open_attempt(s, row_id, "w")
    with transaction(db) as s:
        close_unfinished(s, batch_id, RequestStatus.cancelled, "batch_cancelled", "cancelled")
    with transaction(db) as s:
        rec = record_outcome(s, d, Reply.cancelled(), RetryPolicy())
    assert rec.disposition is Disposition.cancelled
    with db() as s:
        a = s.query(Attempt).filter_by(request_id=row_id).one()
        assert a.outcome == "cancelled" and a.ended_at is not None


def test_a_later_delivery_closes_the_dead_workers_open_attempt(db):
    _, (row_id,) = _rows(db)
    with transaction(db) as s:
        open_attempt(s, row_id, "dead-worker")
    _attempt(db, row_id, Reply(200, {}, OK_BODY))
    with db() as s:
        first = s.query(Attempt).filter_by(request_id=row_id, number=1).one()
        assert first.outcome == "abandoned" and first.ended_at is not None


def test_a_streamed_attempts_figures_are_written_by_the_update_that_ends_it(db):
    # One UPDATE of the attempt row carries its end and its own token figures (the stream's, not the assembled
    # body's, which sums every attempt), on both backends.
    from sqlalchemy import event

    from holdback.results import AttemptFigures

    _, (row_id,) = _rows(db)
    with transaction(db) as s:
        d = open_attempt(s, row_id, "w-test")
    statements: list[str] = []
    engine = db.kw["bind"]
    listener = lambda _c, _cur, statement, *_a: statements.append(statement)  # noqa: E731
    event.listen(engine, "before_cursor_execute", listener)
    try:
        with transaction(db) as s:
            rec = record_outcome(s, d, Reply(200, {}, OK_BODY), RetryPolicy(),
                                 figures=AttemptFigures(prompt=5, output=2, cached=4, kept=1, recomputed=1, partial=None))
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert rec.disposition is Disposition.final
    assert sum(1 for st in statements if st.lstrip().upper().startswith("UPDATE ATTEMPTS")) == 1, statements
    with transaction(db) as s:
        a = s.get(Attempt, d.attempt_id)
        assert (a.input_tokens, a.output_tokens, a.cached_tokens, a.tokens_kept, a.tokens_recomputed) == (5, 2, 4, 1, 1)
        assert a.outcome == "success" and a.ended_at is not None


def test_a_resumed_attempt_refused_with_4xx_starts_again_from_scratch_once(db):
    """The kept output can make a resumed prompt too long for the context (text with U+FFFD tokenizes longer
    than the tokens that made it): the row starts again from the caller's body, and only that attempt's 4xx is final."""
    _, (row_id,) = _rows(db)
    with transaction(db) as s:
        s.query(RequestRow).filter_by(id=row_id).update({"body": json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40})})
    _attempt(db, row_id, Reply(429, {"x-llm-d-request-dropped-reason": "evicted"}, b"{}"))
    with transaction(db) as s:  # what a cut stream leaves: its text and tokens
        s.query(Attempt).filter_by(request_id=row_id, number=1).update(
            {"partial_output": "kept \ufffd text", "tokens_kept": 5, "output_tokens": 5})
    refused = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'
    resumed, rec = _attempt(db, row_id, Reply(400, {}, refused))
    assert resumed.carryover.tokens > 0 and rec.disposition is Disposition.retry
    fresh, rec = _attempt(db, row_id, Reply(400, {}, refused))
    assert fresh.carryover.tokens == 0 and fresh.carryover.text == "", "nothing is carried over"
    assert rec.disposition is Disposition.final and rec.final_status is RequestStatus.failed


def test_the_final_result_of_a_batch_s_last_unfinished_row_says_the_batch_is_done(db):
    # What a worker publishes on the processors' wake channel: only the last row to end says so, whatever order
    # the rows end in and however they end (a failure and a retry in between included).
    _, (first, second, third) = _rows(db, n=3)
    _, rec = _attempt(db, second, Reply(200, {}, OK_BODY))
    assert rec.disposition is Disposition.final and not rec.batch_done
    _, rec = _attempt(db, first, Reply(400, {}, b'{"error": {"message": "bad"}}'))
    assert rec.final_status is RequestStatus.failed and not rec.batch_done
    _, rec = _attempt(db, third, Reply(500, {}, b"{}"))
    assert rec.disposition is Disposition.retry and not rec.batch_done  # the row waits for its retry
    _, rec = _attempt(db, third, Reply(200, {}, OK_BODY), now=time.time() + 60)
    assert rec.disposition is Disposition.final and rec.batch_done
