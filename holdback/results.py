"""Result recording: attempts, retries, and the one compare-and-set that makes a request final.

Both dispatch paths (async workers and the processor's sync mode) record through these functions,
so a duplicate delivery, a worker killed after recording, or a retry racing a late answer can
never produce a second final result: the terminal UPDATE matches only a non-terminal row, and the
batch counters move in the same transaction as the row that won.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from holdback.models import (
    REQUEST_TERMINAL_VALUES,
    Attempt,
    Batch,
    RequestRow,
    RequestStatus,
)


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def from_body(cls, body: dict | None) -> "Usage":
        """Read an OpenAI response's `usage` (chat/completions/embeddings shapes)."""
        usage = (body or {}).get("usage") or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        details = usage.get("prompt_tokens_details") or {}
        out_details = usage.get("completion_tokens_details") or {}
        return cls(
            input_tokens=int(prompt),
            output_tokens=int(completion),
            cached_tokens=int(details.get("cached_tokens") or 0),
            reasoning_tokens=int(out_details.get("reasoning_tokens") or 0),
        )


@dataclass(frozen=True)
class FinalResult:
    status: RequestStatus  # succeeded | failed | cancelled | expired
    response_status: int | None = None
    response_body: dict | str | None = None
    error_code: str | None = None
    error_message: str | None = None
    usage: Usage = Usage()


def begin_attempt(session: Session, row_id: str, worker: str) -> Attempt | None:
    """Mark the row running and open its next attempt; None if the row is already final or gone."""
    row = session.get(RequestRow, row_id, with_for_update=True)
    if row is None or row.status in REQUEST_TERMINAL_VALUES:
        return None
    number = row.attempts + 1
    now = time.time()
    moved = session.execute(
        update(RequestRow)
        .where(RequestRow.id == row_id, RequestRow.attempts == row.attempts,
               RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
        .values(status=RequestStatus.running.value, attempts=number, updated_at=now, next_attempt_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount
    if moved != 1:
        return None  # another delivery of the same job won the race for this attempt number
    attempt = Attempt(request_id=row_id, batch_id=row.batch_id, number=number, worker=worker, started_at=now)
    session.add(attempt)
    session.flush()
    return attempt


def end_attempt(
    session: Session,
    attempt_id: int,
    outcome: str,
    *,
    status_code: int | None = None,
    replica: str | None = None,
    drop_reason: str | None = None,
    evicted: bool = False,
    usage: Usage = Usage(),
    error: str | None = None,
) -> None:
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id)
        .values(
            ended_at=time.time(), outcome=outcome, status_code=status_code, replica=replica,
            drop_reason=drop_reason, evicted=evicted, input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens, error=error,
        )
    )


def schedule_retry(session: Session, row_id: str, next_attempt_at: float, *, evicted: bool, transient: bool) -> bool:
    """Park a non-final row until next_attempt_at. Returns False if it became final meanwhile."""
    values: dict = {"status": RequestStatus.retry_wait.value, "next_attempt_at": next_attempt_at, "updated_at": time.time()}
    if evicted:
        values["evictions"] = RequestRow.evictions + 1
    if transient:
        values["transient_failures"] = RequestRow.transient_failures + 1
    return session.execute(
        update(RequestRow)
        .where(RequestRow.id == row_id, RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
        .values(**values)
        .execution_options(synchronize_session=False)
    ).rowcount == 1


def record_final(session: Session, row_id: str, result: FinalResult) -> bool:
    """The compare-and-set: True if this call made the row final, False (and counted) if it already was."""
    body = result.response_body
    if body is not None and not isinstance(body, str):
        body = json.dumps(body, separators=(",", ":"))
    now = time.time()
    won = session.execute(
        update(RequestRow)
        .where(RequestRow.id == row_id, RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
        .values(
            status=result.status.value, response_status=result.response_status, response_body=body,
            error_code=result.error_code, error_message=result.error_message,
            input_tokens=result.usage.input_tokens, output_tokens=result.usage.output_tokens,
            cached_tokens=result.usage.cached_tokens, reasoning_tokens=result.usage.reasoning_tokens,
            finished_at=now, updated_at=now, next_attempt_at=None,
        )
        .execution_options(synchronize_session=False)
    ).rowcount == 1
    if not won:
        session.execute(
            update(RequestRow).where(RequestRow.id == row_id).values(duplicates=RequestRow.duplicates + 1)
            .execution_options(synchronize_session=False)
        )
        return False
    batch_id = session.scalar(select(RequestRow.batch_id).where(RequestRow.id == row_id))
    succeeded = result.status is RequestStatus.succeeded
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            completed=Batch.completed + (1 if succeeded else 0),
            failed=Batch.failed + (0 if succeeded else 1),
            input_tokens=Batch.input_tokens + result.usage.input_tokens,
            output_tokens=Batch.output_tokens + result.usage.output_tokens,
            cached_tokens=Batch.cached_tokens + result.usage.cached_tokens,
            reasoning_tokens=Batch.reasoning_tokens + result.usage.reasoning_tokens,
        )
        .execution_options(synchronize_session=False)
    )
    return True


def close_unfinished(session: Session, batch_id: str, status: RequestStatus, code: str, message: str) -> int:
    """Make every non-final row of a batch final with `status` (cancel, expiry); returns how many.

    One UPDATE, so a worker's late success either landed before it (and is kept as partial output)
    or loses the compare-and-set after it.
    """
    now = time.time()
    closed = session.execute(
        update(RequestRow)
        .where(RequestRow.batch_id == batch_id, RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
        .values(status=status.value, error_code=code, error_message=message, finished_at=now, updated_at=now,
                next_attempt_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount
    if closed:
        session.execute(
            update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + closed)
            .execution_options(synchronize_session=False)
        )
    return closed


def count_unfinished(session: Session, batch_id: str) -> int:
    return session.scalar(
        select(func.count()).select_from(RequestRow)
        .where(RequestRow.batch_id == batch_id, RequestRow.status.not_in(REQUEST_TERMINAL_VALUES))
    ) or 0


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
