"""How one batch request goes to the gateway and what its answer means.

Shared by the async workers and the processor's sync mode: the request headers, the outcome class of
an answer, the retry backoff, and the two transactions of an attempt — `begin` opens it, and
`record_outcome` closes it as exactly one of: a final result (through `holdback.results`' compare-and-set),
a retry, or a row left for the batch's expiry. Callers do the HTTP themselves and own the transactions.

Outcome classes: 2xx → success; 429 with any drop reason → retry with backoff
until the batch deadline, never counted against a budget; a failing path (gateway unreachable, 502/503,
no replica) → the same, never budgeted: an outage costs time, not results; a stream that broke after it
carried output (how an llm-d eviction reaches us: a bare reset) → the same, resuming from that output;
other 5xx (a failed stream's error event too) and transport errors → retry within a budget of transient
failures, then fail; other 4xx → final failure whose response goes to the error file.
"""

from __future__ import annotations

import email.utils
import enum
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from holdback.contract import (
    BATCH_OBJECTIVE,
    DEADLINE_HEADER,
    DROP_REASON_HEADER,
    FAIRNESS_HEADER,
    FAIRNESS_HEADER_ALIASES,
    OBJECTIVE_HEADER,
    OBJECTIVE_HEADER_ALIASES,
    REPLICA_HEADERS,
    REQUEST_ID_HEADER,
    is_eviction,
    is_no_endpoints,
)
from holdback.models import (
    REQUEST_TERMINAL_VALUES,
    Attempt,
    AttemptOutcome,
    Batch,
    RequestRow,
    RequestStatus,
)
from holdback.results import (AttemptFigures, FinalResult, Usage, begin_attempt, end_attempt, record_final,
                              schedule_retry)

# A proxy's own "nobody behind me answered" statuses: the path failed, not the request.
PATH_STATUSES = frozenset({502, 503})


def request_headers(
    request_id: str,
    tenant_id: str,
    deadline: float | None,
    gateway_key: str | None = None,
    objective: str = BATCH_OBJECTIVE,
) -> dict[str, str]:
    """The headers of every attempt: objective, fairness id, the row id (stable across attempts), deadline, key.

    Objective and fairness id go in llm-d's spelling and in the Gateway API Inference Extension's, so that
    every gateway in front of the replicas (ours, llm-d's, the extension's endpoint picker) reads them."""
    headers = {"content-type": "application/json"}
    for name in (OBJECTIVE_HEADER, *OBJECTIVE_HEADER_ALIASES):
        headers[name] = objective
    for name in (FAIRNESS_HEADER, *FAIRNESS_HEADER_ALIASES):
        headers[name] = tenant_id
    headers[REQUEST_ID_HEADER] = request_id
    if deadline is not None:
        headers[DEADLINE_HEADER] = str(int(deadline))
    if gateway_key:
        headers["authorization"] = f"Bearer {gateway_key}"
    return headers


# --- outcome classes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """The class of one attempt's answer; `kind` is what the Attempt row records."""

    kind: AttemptOutcome
    status: int | None = None
    drop_reason: str | None = None
    retry_after: float | None = None  # seconds the server asked us to wait, if it did
    path_failure: bool = False  # the way to a replica failed (see `is_path_failure`), not this request
    # A stream broke after it carried output with no word why. Behind llm-d an eviction looks exactly like this
    # (no 429, no event), and the retry resumes from the output, so it is not budgeted. A replica that crashes
    # on this request every time would loop: each such retry has made progress of its own, and the batch's
    # deadline ends the loop (the row is then closed with the batch, never retried past it).
    cut_after_output: bool = False

    @property
    def evicted(self) -> bool:
        return self.kind is AttemptOutcome.evicted

    @property
    def transient(self) -> bool:
        """5xx and transport errors the request may have caused: retried within the transient-failure budget."""
        return (self.kind in (AttemptOutcome.server_error, AttemptOutcome.transport_error)
                and not self.path_failure and not self.cut_after_output)

    @property
    def shed(self) -> bool:
        """429 from the gateway (evicted or rejected): retried until the deadline, never budgeted."""
        return self.kind in (AttemptOutcome.evicted, AttemptOutcome.rejected)


def is_path_failure(status: int | None, drop_reason: str | None = None, *, unreachable: bool = False) -> bool:
    """True when the answer says the way to a replica is down rather than anything about the request:
    no connection could be opened (`unreachable`), a 502/503 (the gateway or a proxy found nobody to
    answer), or a drop reason of the `rejected-no-endpoints` family (no healthy replica). Such a request
    never reached a model, so retrying it later costs time only; the workers' circuit breaker uses the same test."""
    if status is None:
        return unreachable
    return status in PATH_STATUSES or is_no_endpoints(drop_reason)


def classify(status: int | None, headers: Mapping[str, str] | None = None, *, now: float | None = None,
             unreachable: bool = False, cut_after_output: bool = False) -> Outcome:
    """Class an answer by its status and headers; `status=None` means no HTTP answer (a transport error),
    `unreachable` that not even a connection was made, `cut_after_output` that a stream broke after it
    carried output."""
    headers = headers or {}
    drop_reason = _header(headers, DROP_REASON_HEADER)
    retry_after = parse_retry_after(_header(headers, "retry-after"), now=now)
    path = is_path_failure(status, drop_reason, unreachable=unreachable)
    if status is None:
        return Outcome(AttemptOutcome.transport_error, path_failure=path, cut_after_output=cut_after_output)
    if 200 <= status < 300:
        return Outcome(AttemptOutcome.success, status)
    if status == 429:
        kind = AttemptOutcome.evicted if is_eviction(drop_reason) else AttemptOutcome.rejected
        return Outcome(kind, status, drop_reason, retry_after)
    if 400 <= status < 500:
        return Outcome(AttemptOutcome.client_error, status, drop_reason)
    # 5xx, and anything else a proxy might answer (1xx/3xx): transient, or a failing path.
    return Outcome(AttemptOutcome.server_error, status, drop_reason, retry_after, path_failure=path)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        # Plain dicts are case-sensitive; multidicts and httpx headers are not.
        lowered = name.lower()
        for key, v in headers.items():
            if key.lower() == lowered:
                return v
    return value


# --- backoff ------------------------------------------------------------------------------------------


class Jitter(str, enum.Enum):
    full = "full"  # uniform in [0, x)
    equal = "equal"  # uniform in [x/2, x): never retries sooner than half the step


def backoff(
    attempt: int,
    retry_after: float | None = None,
    *,
    base: float = 2.0,
    cap: float = 60.0,
    jitter: Jitter | str = Jitter.equal,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based): base doubling to cap, jittered.

    A server's `Retry-After` is a floor: we never come back sooner than it asked.
    """
    step = min(cap, base * (2 ** max(0, attempt - 1)))
    if Jitter(jitter) is Jitter.full:
        delay = step * rand()
    else:
        delay = step / 2 + (step / 2) * rand()
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay


@dataclass(frozen=True)
class RetryPolicy:
    """How retries are paced and bounded; defaults: 2 s doubling to 60 s with jitter, 5 transient failures."""

    base: float = 2.0
    cap: float = 60.0
    jitter: Jitter = Jitter.equal
    transient_budget: int = 5  # the row fails on its N-th transient failure (5xx or transport error)
    # A row whose batch is past its deadline (or being cancelled) waits this long for the processor to
    # close it before its job looks again.
    closing_recheck: float = 30.0

    def __post_init__(self) -> None:
        if self.base <= 0 or self.cap < self.base:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={self.base} cap={self.cap}")
        if self.transient_budget < 1:
            raise ValueError(f"transient_budget must be at least 1, got {self.transient_budget}")
        if self.closing_recheck <= 0:
            raise ValueError(f"closing_recheck must be positive, got {self.closing_recheck}")

    def delay(self, attempt: int, retry_after: float | None = None, rand: Callable[[], float] = random.random) -> float:
        return backoff(attempt, retry_after, base=self.base, cap=self.cap, jitter=self.jitter, rand=rand)


# --- the attempt's first transaction --------------------------------------------------------------------


@dataclass(frozen=True)
class Dispatch:
    """One open attempt: everything needed to send it and to record its answer."""

    row_id: str
    batch_id: str
    tenant_id: str
    custom_id: str
    url: str
    body: str
    deadline: float | None  # the batch's expires_at
    attempt_id: int
    attempt: int  # 1-based attempt number
    transient_failures: int  # before this attempt

    def headers(self, gateway_key: str | None = None) -> dict[str, str]:
        return request_headers(self.row_id, self.tenant_id, self.deadline, gateway_key)


class Skip(str, enum.Enum):
    """Why `begin` opened no attempt."""

    final = "final"  # the row is final or gone: drop the delivery
    closing = "closing"  # its batch is past its deadline or being cancelled: the processor will close it


# Hot-path statements, built once (Core, bound parameters): every attempt runs them.
_rows, _batches, _attempts = RequestRow.__table__, Batch.__table__, Attempt.__table__
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
_ROW_STATUS = select(_rows.c.status).where(_rows.c.id == bindparam("row_id"))
_COUNT_TRANSIENT = (
    update(_rows).where(_rows.c.id == bindparam("row_id"))
    .values(transient_failures=_rows.c.transient_failures + 1)
)


def begin(session: Session, row_id: str, worker: str, *, now: float | None = None) -> Dispatch | Skip:
    """Open the row's next attempt (row → running), unless the row is final or its batch is closing.

    A first attempt costs two statements: the row's move (which also checks the batch and returns its
    deadline) and the attempt's INSERT; why nothing opened is looked up only when nothing did.
    """
    now = time.time() if now is None else now
    conn = session.connection()
    attempt = begin_attempt(session, row_id, worker, open_batch_only=True, now=now)
    if attempt is None:
        found = conn.execute(_LOOKUP, {"row_id": row_id}).one_or_none()
        return Skip.final if found is None or found[0] in REQUEST_TERMINAL_VALUES else Skip.closing
    if attempt.number > 1:
        # An earlier delivery's attempt may still be open: its worker died (or is a racing duplicate, whose
        # own end_attempt will overwrite this). Close it so the history stays truthful.
        conn.execute(_CLOSE_SUPERSEDED, {"row_id": row_id, "new_number": attempt.number, "closed_at": now})
    return Dispatch(
        row_id=row_id, batch_id=attempt.batch_id, tenant_id=attempt.tenant_id, custom_id=attempt.custom_id,
        url=attempt.url, body=attempt.body, deadline=attempt.deadline, attempt_id=attempt.id, attempt=attempt.number,
        transient_failures=attempt.transient_failures,
    )


# --- the attempt's second transaction -------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What one attempt got back: an HTTP answer, a transport error, or an abort by us."""

    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    error: str | None = None  # transport error, what a stream's error event said, or why we aborted
    aborted: bool = False  # we closed the connection: the batch was cancelled or expired
    unreachable: bool = False  # no connection could be opened: the request never left
    cut_after_output: bool = False  # a stream broke after it carried output (see `Outcome.cut_after_output`)

    @classmethod
    def transport_error(cls, error: str, *, unreachable: bool = False, cut_after_output: bool = False) -> "Reply":
        return cls(error=error, unreachable=unreachable, cut_after_output=cut_after_output)

    @classmethod
    def cancelled(cls, reason: str = "batch cancelled or expired") -> "Reply":
        return cls(error=reason, aborted=True)

    @property
    def replica(self) -> str | None:
        for name in REPLICA_HEADERS:
            value = _header(self.headers, name)
            if value:
                return value[:256]
        return None


class Disposition(str, enum.Enum):
    """What became of the row after one attempt."""

    final = "final"  # this attempt made the row final (succeeded or failed)
    duplicate = "duplicate"  # the row was already final: a counted no-op
    retry = "retry"  # row → retry_wait; run the job again at `wake_at`
    closing = "closing"  # the next try would land past the deadline: left for the batch's expiry
    cancelled = "cancelled"  # aborted because the batch was cancelled or expired


@dataclass(frozen=True)
class Recorded:
    disposition: Disposition
    outcome: Outcome
    final_status: RequestStatus | None = None  # set when disposition is final
    wake_at: float | None = None  # when the job should run again (retry, closing)
    delay: float | None = None  # the backoff chosen (retry)
    usage: Usage = Usage()
    reason: str | None = None  # why the row failed (final failed): what RQ's failed job shows


def record_outcome(
    session: Session,
    dispatch: Dispatch,
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
        return _record_abort(session, dispatch, reply, policy, now, figures)

    outcome = classify(reply.status, reply.headers, now=now, unreachable=reply.unreachable,
                       cut_after_output=reply.cut_after_output)
    body: dict | str | None = None
    usage = Usage()
    error = reply.error
    if reply.body:
        try:
            body = json.loads(reply.body)
        except ValueError:
            body = reply.body.decode("utf-8", errors="replace")
    if outcome.kind is AttemptOutcome.success:
        if not isinstance(body, dict):
            # A 2xx whose body is not one JSON object was cut short or is not an OpenAI answer.
            outcome = Outcome(AttemptOutcome.transport_error, reply.status)
            error = "truncated or invalid response body from a 2xx answer"
        else:
            usage = Usage.from_body(body)

    end_attempt(
        session, dispatch.attempt_id, outcome.kind.value, status_code=outcome.status, replica=reply.replica,
        drop_reason=outcome.drop_reason, evicted=outcome.evicted, usage=usage,
        error=error if outcome.kind is not AttemptOutcome.success else None, figures=figures,
    )

    if outcome.kind is AttemptOutcome.success:
        return _final(session, dispatch, outcome, FinalResult(RequestStatus.succeeded, outcome.status, body,
                                                               usage=usage), usage)
    if outcome.kind is AttemptOutcome.client_error:
        return _final(session, dispatch, outcome, FinalResult(RequestStatus.failed, outcome.status, body))
    if outcome.transient and dispatch.transient_failures + 1 >= policy.transient_budget:
        session.connection().execute(_COUNT_TRANSIENT, {"row_id": dispatch.row_id})
        code = outcome.kind.value  # server_error | transport_error
        what = f"HTTP {outcome.status}" if outcome.status else (error or "no answer")
        message = (f"gave up after {dispatch.transient_failures + 1} transient failures "
                   f"(budget {policy.transient_budget}); last: {what}")
        return _final(session, dispatch, outcome, FinalResult(
            RequestStatus.failed, outcome.status, body if outcome.status else None,
            error_code=code, error_message=message))
    return _retry(session, dispatch, outcome, policy, now, rand)


def _final(session: Session, dispatch: Dispatch, outcome: Outcome, result: FinalResult,
           usage: Usage = Usage()) -> Recorded:
    if record_final(session, dispatch.row_id, result):
        return Recorded(Disposition.final, outcome, final_status=result.status, usage=usage,
                        reason=None if result.status is RequestStatus.succeeded else failure_reason(result))
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


def _retry(session: Session, dispatch: Dispatch, outcome: Outcome, policy: RetryPolicy, now: float,
           rand: Callable[[], float]) -> Recorded:
    delay = policy.delay(dispatch.attempt, outcome.retry_after, rand)
    next_at = now + delay
    closing = dispatch.deadline is not None and next_at >= dispatch.deadline
    if closing:
        # Never past the deadline, and never failed for it: the row waits for the batch's expiry.
        next_at = dispatch.deadline
    parked = schedule_retry(session, dispatch.row_id, next_at, evicted=outcome.evicted, transient=outcome.transient)
    if not parked:
        return Recorded(Disposition.duplicate, outcome)
    if closing:
        return Recorded(Disposition.closing, outcome, wake_at=next_at + policy.closing_recheck, delay=delay)
    return Recorded(Disposition.retry, outcome, wake_at=next_at, delay=delay)


def _record_abort(session: Session, dispatch: Dispatch, reply: Reply, policy: RetryPolicy, now: float,
                  figures: AttemptFigures | None) -> Recorded:
    outcome = Outcome(AttemptOutcome.cancelled)
    end_attempt(session, dispatch.attempt_id, outcome.kind.value, error=reply.error, figures=figures)
    status = session.connection().execute(_ROW_STATUS, {"row_id": dispatch.row_id}).scalar()
    if status is None or status in REQUEST_TERMINAL_VALUES:
        return Recorded(Disposition.cancelled, outcome)
    # Aborted although nobody closed the row: park it rather than strand it.
    wake_at = now + policy.closing_recheck
    schedule_retry(session, dispatch.row_id, wake_at, evicted=False, transient=False)
    return Recorded(Disposition.closing, outcome, wake_at=wake_at)
