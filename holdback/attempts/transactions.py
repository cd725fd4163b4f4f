"""The two transactions of an attempt: `open_attempt` opens it, and `record_outcome` closes it as exactly one of:
a final result (through `holdback.results`' compare-and-set), a retry, or a row left for the batch's expiry.

Callers do the HTTP themselves (`holdback.attempts.runner` for the async workers and the sync mode) and own
the transactions.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from holdback import lifecycle
from holdback.attempts.headers import request_headers
from holdback.attempts.outcomes import ReplyClass, Reply, classify
from holdback.attempts.resume import Carryover, Partial, resumable
from holdback.attempts.retry import RetryPolicy
from holdback.attempts.stream import TokenSums
from holdback.models import (
    REQUEST_TERMINAL_VALUES,
    Attempt,
    AttemptOutcome,
    Batch,
    RequestRow,
    RequestStatus,
)
from holdback.results import (
    AttemptFigures, FinalResult, TokenUsage, end_attempt, record_final, schedule_retry, unfinished_up_to,
)

# --- the attempt's first transaction --------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAttempt:
    """One open attempt of one request row: what sending it and recording its answer need from the row (read
    by the statement that opened it), and what the row's earlier attempts left for it to continue."""

    request_id: str
    batch_id: str
    tenant_id: str
    custom_id: str
    url: str
    body: str
    deadline: float | None  # the batch's expires_at
    attempt_id: int
    number: int  # 1-based attempt number
    transient_failures: int  # before this attempt
    carryover: Carryover = Carryover()  # read by `open_attempt` for a resumable request's later attempts
    evictions: int = 0  # earlier attempts the gateway evicted
    at_risk: bool = False  # its batch is marked at risk of missing its window (holdback.risk)

    def headers(self, gateway_key: str | None = None) -> dict[str, str]:
        return request_headers(self.request_id, self.tenant_id, self.deadline, gateway_key, at_risk=self.at_risk)


class Skip(str, enum.Enum):
    """Why `open_attempt` opened no attempt."""

    final = "final"  # the row is final or gone: drop the delivery
    closing = "closing"  # its batch is past its deadline or being cancelled: the processor will close it


# Hot-path statements, built once (Core, bound parameters): every attempt runs them.
# The request id binds as `row_id`: SQLAlchemy reserves a column's own name (`attempts.request_id`) for the
# values of an INSERT or UPDATE of its table.
_rows, _batches, _attempts = RequestRow.__table__, Batch.__table__, Attempt.__table__
_INSERT_ATTEMPT = (
    insert(_attempts)
    .values(request_id=bindparam("row_id"), batch_id=bindparam("batch_id"), number=bindparam("number"),
            worker=bindparam("worker"), started_at=bindparam("now"), evicted=False, input_tokens=0,
            output_tokens=0)
    .returning(_attempts.c.id)
)
_LOOKUP = (
    select(_rows.c.status)
    .select_from(_rows.join(_batches, _batches.c.id == _rows.c.batch_id))
    .where(_rows.c.id == bindparam("row_id"))
)
_CLOSE_SUPERSEDED = (
    update(_attempts)
    .where(_attempts.c.request_id == bindparam("row_id"), _attempts.c.ended_at.is_(None),
           _attempts.c.number < bindparam("new_number"))
    .values(ended_at=bindparam("closed_at"), outcome=AttemptOutcome.abandoned.value,
            error="superseded by a later delivery")
)
# An empty cut: the latest cut an attempt reads, which carries nothing over (a restart from the caller's body).
_RESTART_FROM_SCRATCH = (
    update(_attempts).where(_attempts.c.id == bindparam("attempt_id"))
    .values(partial_output="", partial_state=None, tokens_kept=0, input_tokens=0, output_tokens=0)
)
_LATEST_CUT = (
    select(_attempts.c.partial_output, _attempts.c.partial_state, _attempts.c.tokens_kept, _attempts.c.input_tokens,
           _attempts.c.output_tokens)
    .where(_attempts.c.request_id == bindparam("row_id"), _attempts.c.number < bindparam("number"),
           _attempts.c.partial_output.is_not(None))
    .order_by(_attempts.c.number.desc()).limit(1)
)
_SUMS = (
    select(func.coalesce(func.sum(_attempts.c.input_tokens), 0), func.coalesce(func.sum(_attempts.c.output_tokens), 0),
           func.coalesce(func.sum(_attempts.c.cached_tokens), 0))
    .where(_attempts.c.request_id == bindparam("row_id"), _attempts.c.number < bindparam("number"))
)
_ROW_STATUS = select(_rows.c.status).where(_rows.c.id == bindparam("row_id"))
_COUNT_TRANSIENT = (
    update(_rows).where(_rows.c.id == bindparam("row_id"))
    .values(transient_failures=_rows.c.transient_failures + 1)
)


def begin_attempt(session: Session, request_id: str, worker: str, *, open_batch_only: bool = False,
                  now: float | None = None) -> OpenAttempt | None:
    """Mark the row running and open its next attempt (two statements); None if the row is already final
    or gone — or, with `open_batch_only`, if its batch is closing or past its deadline."""
    now = time.time() if now is None else now
    conn = session.connection()
    row = lifecycle.claim(conn, request_id, now, open_batch_only=open_batch_only)
    if row is None:
        return None
    number, batch_id, tenant_id, custom_id, url, body, transient_failures, evictions, deadline = row
    attempt_id = conn.execute(_INSERT_ATTEMPT, {"row_id": request_id, "batch_id": batch_id, "number": number,
                                                "worker": worker, "now": now}).scalar_one()
    return OpenAttempt(request_id, batch_id, tenant_id, custom_id, url, body, deadline, attempt_id, number,
                       transient_failures, evictions=evictions)


def open_attempt(session: Session, request_id: str, worker: str, *, now: float | None = None) -> OpenAttempt | Skip:
    """Open the row's next attempt (row → running), unless the row is final or its batch is closing; a later
    attempt of a resumable request carries what the earlier ones left (`OpenAttempt.carryover`).

    A first attempt costs two statements: the row's move (which also checks the batch and returns its
    deadline) and the attempt's INSERT; why nothing opened is looked up only when nothing did.
    """
    now = time.time() if now is None else now
    conn = session.connection()
    attempt = begin_attempt(session, request_id, worker, open_batch_only=True, now=now)
    if attempt is None:
        found = conn.execute(_LOOKUP, {"row_id": request_id}).one_or_none()
        return Skip.final if found is None or found[0] in REQUEST_TERMINAL_VALUES else Skip.closing
    if attempt.number == 1:
        return attempt
    # An earlier delivery's attempt may still be open: its worker died (or is a racing duplicate, whose
    # own end_attempt will overwrite this). Close it so the history stays truthful.
    conn.execute(_CLOSE_SUPERSEDED, {"row_id": request_id, "new_number": attempt.number, "closed_at": now})
    if not resumable(attempt.url, json.loads(attempt.body)):
        return attempt
    return dataclasses.replace(attempt, carryover=_carryover(conn, request_id, attempt.number))


def _carryover(conn: Connection, request_id: str, number: int) -> Carryover:
    """What attempt `number`'s predecessors left: the latest cut stream's output and the usage so far."""
    params = {"row_id": request_id, "number": number}
    prompt, output, cached = conn.execute(_SUMS, params).one()
    earlier = TokenSums(int(prompt), int(output), int(cached))
    cut = conn.execute(_LATEST_CUT, params).one_or_none()
    if cut is None:
        return Carryover(earlier=earlier)
    text, state, kept, cut_prompt, cut_output = cut
    partial = Partial.read(text, state)
    return Carryover(partial.text, max(0, kept + cut_output - partial.untold), cut_prompt + cut_output,
                     earlier, partial.reasoning, partial.reasoning_fields, partial.context_ids)


# --- the attempt's second transaction -------------------------------------------------------------------


class Disposition(str, enum.Enum):
    """What became of the row after one attempt."""

    final = "final"  # this attempt made the row final (succeeded or failed)
    duplicate = "duplicate"  # the row was already final: a counted no-op
    retry = "retry"  # row → retry_wait; run the job again at `wake_at`
    closing = "closing"  # the next try would land past the deadline: left for the batch's expiry
    cancelled = "cancelled"  # aborted because the batch was cancelled or expired


# A final result counts its batch's unfinished rows up to this many. Below it, the batch is near its end and the
# runner counts again once the result is committed: on PostgreSQL the last rows, ending at once, each see the
# others unfinished inside their own transactions, but whichever commits last sees every other after it.
NEAR_END = 64


@dataclass(frozen=True)
class Recorded:
    disposition: Disposition
    outcome: ReplyClass
    final_status: RequestStatus | None = None  # set when disposition is final
    wake_at: float | None = None  # when the job should run again (retry, closing)
    delay: float | None = None  # the backoff chosen (retry)
    usage: TokenUsage = TokenUsage()
    reason: str | None = None  # why the row failed (final failed): what RQ's failed job shows
    # Final: the rows of its batch still unfinished, counted up to NEAR_END (`batch_done`).
    batch_left: int = NEAR_END


    @property
    def batch_done(self) -> bool:
        """This row's final result left no row of its batch unfinished: the processors can finalize the batch
        now (the worker says so on `holdback.contract.wake_channel`)."""
        return self.disposition is Disposition.final and self.batch_left == 0


def record_outcome(
    session: Session,
    attempt: OpenAttempt,
    reply: Reply,
    policy: RetryPolicy,
    *,
    now: float | None = None,
    rand: Callable[[], float] = random.random,
    figures: AttemptFigures | None = None,
) -> Recorded:
    """Close the attempt and move the row: final result, retry, or left for expiry. One transaction.

    `figures`: a streamed attempt's own token figures, written on its attempt row by the same UPDATE."""
    now = time.time() if now is None else now
    if reply.aborted:
        return _record_abort(session, attempt, reply, policy, now, figures)

    outcome = classify(reply.status, reply.headers, now=now, unreachable=reply.unreachable,
                       cut_after_output=reply.cut_after_output)
    body: dict | str | None = None
    usage = TokenUsage()
    error = reply.error
    if reply.body:
        try:
            body = json.loads(reply.body)
        except ValueError:
            body = reply.body.decode("utf-8", errors="replace")
    if outcome.kind is AttemptOutcome.success:
        if not isinstance(body, dict):
            # A 2xx whose body is not one JSON object was cut short or is not an OpenAI answer.
            outcome = ReplyClass(AttemptOutcome.transport_error, reply.status)
            error = "truncated or invalid response body from a 2xx answer"
        else:
            usage = TokenUsage.from_body(body)

    end_attempt(
        session, attempt.attempt_id, outcome.kind.value, status_code=outcome.status, replica=reply.replica,
        drop_reason=outcome.drop_reason, evicted=outcome.evicted, usage=usage,
        error=error if outcome.kind is not AttemptOutcome.success else None, figures=figures,
    )

    if outcome.kind is AttemptOutcome.success:
        return _final(session, attempt, outcome, FinalResult(RequestStatus.succeeded, outcome.status, body,
                                                              usage=usage), usage)
    if outcome.kind is AttemptOutcome.client_error and attempt.carryover.tokens > 0:
        # Refused as resumed, not as sent: the kept output made the prompt too long (text with U+FFFD in it
        # tokenizes longer than the tokens that made it), or the template cannot continue a message. Start again
        # from the caller's own body, once: this attempt's empty cut means the next one resumes nothing, and a
        # 4xx of that fresh attempt is final.
        session.connection().execute(_RESTART_FROM_SCRATCH, {"attempt_id": attempt.attempt_id})
        return _retry(session, attempt, outcome, policy, now, rand)
    if outcome.kind is AttemptOutcome.client_error:
        return _final(session, attempt, outcome, FinalResult(RequestStatus.failed, outcome.status, body))
    if outcome.transient and attempt.transient_failures + 1 >= policy.transient_budget:
        session.connection().execute(_COUNT_TRANSIENT, {"row_id": attempt.request_id})
        code = outcome.kind.value  # server_error | transport_error
        what = f"HTTP {outcome.status}" if outcome.status else (error or "no answer")
        message = (f"gave up after {attempt.transient_failures + 1} transient failures "
                   f"(budget {policy.transient_budget}); last: {what}")
        return _final(session, attempt, outcome, FinalResult(
            RequestStatus.failed, outcome.status, body if outcome.status else None,
            error_code=code, error_message=message))
    return _retry(session, attempt, outcome, policy, now, rand)


def _final(session: Session, attempt: OpenAttempt, outcome: ReplyClass, result: FinalResult,
           usage: TokenUsage = TokenUsage()) -> Recorded:
    if record_final(session, attempt.request_id, result):
        return Recorded(Disposition.final, outcome, final_status=result.status, usage=usage,
                        reason=None if result.status is RequestStatus.succeeded else failure_reason(result),
                        batch_left=unfinished_up_to(session, attempt.batch_id, NEAR_END))
    return Recorded(Disposition.duplicate, outcome)


def failure_reason(result: FinalResult) -> str:
    """One line saying why a row failed: our own message, else the upstream's error message and status."""
    if result.error_message:
        return f"{result.error_code or result.status.value}: {result.error_message}"
    body = result.response_body
    message = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
    elif isinstance(body, str):
        message = body[:500]
    return f"HTTP {result.response_status}: {message or 'no error message in the response'}"


def _retry(session: Session, attempt: OpenAttempt, outcome: ReplyClass, policy: RetryPolicy, now: float,
           rand: Callable[[], float]) -> Recorded:
    delay = retry_delay(attempt, outcome, policy, rand)
    next_at = now + delay
    closing = attempt.deadline is not None and next_at >= attempt.deadline
    if closing:
        # Never past the deadline, and never failed for it: the row waits for the batch's expiry.
        next_at = attempt.deadline
    parked = schedule_retry(session, attempt.request_id, next_at, evicted=outcome.evicted, transient=outcome.transient)
    if not parked:
        return Recorded(Disposition.duplicate, outcome)
    if closing:
        return Recorded(Disposition.closing, outcome, wake_at=next_at + policy.closing_recheck, delay=delay)
    return Recorded(Disposition.retry, outcome, wake_at=next_at, delay=delay)


def retry_delay(attempt: OpenAttempt, outcome: ReplyClass, policy: RetryPolicy,
                rand: Callable[[], float] = random.random) -> float:
    """Seconds until the row's next attempt. An eviction is the gateway's own scheduling decision, not a failure:
    the row goes back in line at once, or when the gateway's `Retry-After` says room comes back. Everything else
    backs off exponentially (a `Retry-After` as its floor), counting only the attempts that were not evicted, so a
    row evicted four times waits on its first rejection as a row tried once would."""
    if outcome.evicted:
        return outcome.retry_after or 0.0
    return policy.delay(max(1, attempt.number - attempt.evictions), outcome.retry_after, rand)


def _record_abort(session: Session, attempt: OpenAttempt, reply: Reply, policy: RetryPolicy, now: float,
                  figures: AttemptFigures | None) -> Recorded:
    outcome = ReplyClass(AttemptOutcome.cancelled)
    end_attempt(session, attempt.attempt_id, outcome.kind.value, error=reply.error, figures=figures)
    status = session.connection().execute(_ROW_STATUS, {"row_id": attempt.request_id}).scalar()
    if status is None or status in REQUEST_TERMINAL_VALUES:
        return Recorded(Disposition.cancelled, outcome)
    if reply.resend:  # taken back unanswered to go out again with what changed: back in line at once
        if schedule_retry(session, attempt.request_id, now, evicted=False, transient=False):
            return Recorded(Disposition.retry, outcome, wake_at=now, delay=0.0)
        return Recorded(Disposition.duplicate, outcome)
    # Aborted although nobody closed the row: park it rather than strand it.
    wake_at = now + policy.closing_recheck
    schedule_retry(session, attempt.request_id, wake_at, evicted=False, transient=False)
    return Recorded(Disposition.closing, outcome, wake_at=wake_at)


def record_attempt(session: Session, attempt: OpenAttempt, reply: Reply, policy: RetryPolicy,
                   figures: AttemptFigures | None) -> Recorded:
    """`record_outcome` with this attempt's own token figures on its attempt row (positional, for a lane)."""
    return record_outcome(session, attempt, reply, policy, figures=figures)
