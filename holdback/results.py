"""Result recording: attempts' ends, retries, and the one compare-and-set that makes a request final.

Both hand-off paths (async workers and the processor's sync mode) record through these functions, by way of
`holdback.attempts` (which opens the attempts), so a duplicate delivery, a worker killed after recording, or a
retry racing a late answer can never produce a second final result: the terminal UPDATE matches only a
non-terminal row, and the batch counters move in the same transaction as the row that won. The row's status
moves themselves are `holdback.lifecycle`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from holdback import lifecycle
from holdback.models import REQUEST_TERMINAL_VALUES, Attempt, Batch, RequestRow, RequestStatus


@dataclass(frozen=True)
class TokenUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def from_body(cls, body: dict | None) -> "TokenUsage":
        """Read an OpenAI response's `usage`: chat, completions and embeddings (`prompt_tokens`,
        `prompt_tokens_details`, ...) or /v1/responses (`input_tokens`, `input_tokens_details`, ...)."""
        usage = (body or {}).get("usage") or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
        return cls(
            input_tokens=int(prompt),
            output_tokens=int(completion),
            cached_tokens=int(details.get("cached_tokens") or 0),
            reasoning_tokens=int(out_details.get("reasoning_tokens") or 0),
        )


@dataclass(frozen=True)
class FinalResult:
    status: RequestStatus  # succeeded | failed (a batch's cancel and expiry close rows with close_unfinished)
    response_status: int | None = None
    response_body: dict | str | None = None
    error_code: str | None = None
    error_message: str | None = None
    usage: TokenUsage = TokenUsage()


_attempts = Attempt.__table__


@dataclass(frozen=True)
class AttemptFigures:
    """A streamed attempt's own token figures, written with its end (one UPDATE for both)."""

    prompt: int
    output: int
    cached: int
    kept: int  # output tokens carried in from earlier attempts
    recomputed: int  # earlier attempts' work (prompt + output) computed again by this one
    partial: str | None  # the answer's text so far (every attempt's), when this attempt's stream was cut
    partial_state: dict | None = None  # what else continuing that text needs (reasoning, token ids), if anything


def end_attempt(
    session: Session,
    attempt_id: int,
    outcome: str,
    *,
    status_code: int | None = None,
    replica: str | None = None,
    drop_reason: str | None = None,
    evicted: bool = False,
    usage: TokenUsage = TokenUsage(),
    error: str | None = None,
    figures: AttemptFigures | None = None,
) -> None:
    """Close an attempt. With `figures` (a streamed attempt) its tokens are the stream's own, not the
    assembled body's usage (which sums every attempt of the request)."""
    params = {"attempt_id": attempt_id, "ended_at": time.time(), "outcome": outcome, "status_code": status_code,
              "replica": replica, "drop_reason": drop_reason, "evicted": evicted, "error": error}
    if figures is None:
        params.update(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)
        session.connection().execute(_END_ATTEMPT, params)
        return
    params.update(input_tokens=figures.prompt, output_tokens=figures.output, cached_tokens=figures.cached,
                  partial_output=figures.partial, partial_state=figures.partial_state, tokens_kept=figures.kept,
                  tokens_recomputed=figures.recomputed)
    session.connection().execute(_END_STREAMED_ATTEMPT, params)


_END_COLUMNS = ("ended_at", "outcome", "status_code", "replica", "drop_reason", "evicted", "input_tokens",
                "output_tokens", "error")
_END_ATTEMPT = (
    update(_attempts).where(_attempts.c.id == bindparam("attempt_id"))
    .values(**{name: bindparam(name) for name in _END_COLUMNS})
)
_END_STREAMED_ATTEMPT = (
    update(_attempts).where(_attempts.c.id == bindparam("attempt_id"))
    .values(**{name: bindparam(name) for name in (*_END_COLUMNS, "cached_tokens", "partial_output", "partial_state",
                                                  "tokens_kept", "tokens_recomputed")})
)


def schedule_retry(session: Session, row_id: str, next_attempt_at: float, *, evicted: bool, transient: bool) -> bool:
    """Park a non-final row until next_attempt_at. Returns False if it became final meanwhile."""
    return lifecycle.park(session.connection(), row_id, next_attempt_at, time.time(), evicted=evicted,
                          transient=transient)


def record_final(session: Session, row_id: str, result: FinalResult) -> bool:
    """The compare-and-set: True if this call made the row final, False (and counted) if it already was."""
    body = result.response_body
    if body is not None and not isinstance(body, str):
        body = json.dumps(body, separators=(",", ":"))
    now = time.time()
    conn = session.connection()
    batch_id = lifecycle.finish(
        conn, row_id, result.status, now, response_status=result.response_status, response_body=body,
        error_code=result.error_code, error_message=result.error_message,
        input_tokens=result.usage.input_tokens, output_tokens=result.usage.output_tokens,
        cached_tokens=result.usage.cached_tokens, reasoning_tokens=result.usage.reasoning_tokens)
    if batch_id is None:
        conn.execute(_COUNT_DUPLICATE, {"row_id": row_id})
        return False
    succeeded = result.status is RequestStatus.succeeded
    count_final(session, batch_id, BatchCounts(
        completed=1 if succeeded else 0, failed=0 if succeeded else 1,
        cancelled=1 if result.status is RequestStatus.cancelled else 0,
        input_tokens=result.usage.input_tokens, output_tokens=result.usage.output_tokens,
        cached_tokens=result.usage.cached_tokens, reasoning_tokens=result.usage.reasoning_tokens))
    return True


_rows, _batches = RequestRow.__table__, Batch.__table__
_COUNT_DUPLICATE = update(_rows).where(_rows.c.id == bindparam("row_id")).values(duplicates=_rows.c.duplicates + 1)


# --- batch counters ------------------------------------------------------------------------------------


@dataclass
class BatchCounts:
    """What final rows add to their batch's counters."""

    completed: int = 0
    failed: int = 0  # OpenAI's request_counts.failed: cancelled and expired rows too
    cancelled: int = 0  # of failed, the rows a cancel closed
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, other: "BatchCounts") -> None:
        for name in _COUNTER_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_COUNTER_NAMES = tuple(BatchCounts.__dataclass_fields__)
_ADD_TO_BATCH = (
    update(_batches).where(_batches.c.id == bindparam("batch_id"))
    .values(**{name: _batches.c[name] + bindparam(f"d_{name}") for name in _COUNTER_NAMES})
)
_LEDGER = "holdback.batch_counts"  # session.info key of the deferred counters


def count_final(session: Session, batch_id: str, counts: BatchCounts) -> None:
    """Add to a batch's counters: at once, or at the end of the transaction when counters are deferred."""
    ledger = session.info.get(_LEDGER)
    if ledger is None:
        _add_to_batches(session, {batch_id: counts})
    else:
        ledger.setdefault(batch_id, BatchCounts()).add(counts)


@contextmanager
def deferred_batch_counts(session: Session) -> Iterator[None]:
    """Batch counter updates inside this block become one UPDATE per batch at its end.

    A worker's group transaction records many final rows of the same batch: adding to the batch row as each
    lands would hold that one row's lock from the first result to the commit, serialising every other
    process's transaction behind it. Deferred, the lock is taken once, just before the commit; batches
    are updated in id order, so two processes never wait on each other in a cycle.
    """
    if _LEDGER in session.info:  # nested: the outer block applies everything
        yield
        return
    ledger: dict[str, BatchCounts] = {}
    session.info[_LEDGER] = ledger
    try:
        yield
    finally:
        session.info.pop(_LEDGER, None)
    _add_to_batches(session, ledger)


def _add_to_batches(session: Session, ledger: dict[str, BatchCounts]) -> None:
    conn = session.connection()
    for batch_id in sorted(ledger):
        counts = ledger[batch_id]
        conn.execute(_ADD_TO_BATCH, {"batch_id": batch_id,
                                     **{f"d_{name}": getattr(counts, name) for name in _COUNTER_NAMES}})


def close_unfinished(session: Session, batch_id: str, status: RequestStatus, code: str, message: str,
                     ids: list[str] | None = None) -> int:
    """Make every non-final row of a batch (or of those of `ids`) final with `status` (cancel, expiry);
    returns how many.

    One UPDATE, each row only while unfinished, so a worker's late success either landed before it (and is
    kept as partial output) or loses the compare-and-set after it.
    """
    closed = lifecycle.close_unfinished(session, batch_id, status, code, message, time.time(), ids)
    if closed:
        count_final(session, batch_id, BatchCounts(failed=closed,
                                                   cancelled=closed if status is RequestStatus.cancelled else 0))
    return closed


_UNFINISHED_VALUES = tuple(s.value for s in RequestStatus if s.value not in REQUEST_TERMINAL_VALUES)


def unfinished_up_to(session: Session, batch_id: str, cap: int) -> int:
    """How many rows of the batch are not final yet, counted up to `cap`: seeks of the (batch_id, status) index,
    at most `cap` of them, at any batch size."""
    first = (select(RequestRow.id).where(RequestRow.batch_id == batch_id, RequestRow.status.in_(_UNFINISHED_VALUES))
             .limit(cap).subquery())
    return session.scalar(select(func.count()).select_from(first)) or 0


def any_unfinished(session: Session, batch_id: str) -> bool:
    """Whether a row of the batch is not final yet: one index seek, not a count of them all."""
    return unfinished_up_to(session, batch_id, 1) > 0


def output_line(row: RequestRow) -> dict:
    """The OpenAI batch output/error line for a final row."""
    if row.response_status is not None:
        try:
            body = json.loads(row.response_body) if row.response_body else None
        except ValueError:
            body = {"error": {"message": row.response_body, "type": "invalid_response", "param": None, "code": None}}
        return {
            "id": row.id,
            "custom_id": row.custom_id,
            "response": {"status_code": row.response_status, "request_id": row.id, "body": body},
            "error": None,
        }
    return {
        "id": row.id,
        "custom_id": row.custom_id,
        "response": None,
        "error": {"code": row.error_code or "request_failed", "message": row.error_message or ""},
    }
