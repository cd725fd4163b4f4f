"""The request row's lifecycle in one place: its statuses, the moves between them, and the statement of each move.

Every change of a request row's status goes through a function of this module; no other module writes
`request_rows.status`. Each move is declared once in `MOVES` (its name, the statuses it may start from, the
status it ends in), `TRANSITIONS` is the table those declarations make, and each move's UPDATE matches only
rows in its sources (`WHERE status IN (...)`), so a race can never make a move the table does not allow: the
row that changed meanwhile is simply not matched, and the caller learns it from the row count. Asking for a
move the table does not have (`require`, `finish` to a status that is not final, `close_unfinished` to one
that is not a closing status) raises `IllegalTransition`. The database refuses a status outside
`RequestStatus` (a CHECK constraint, migration 0007).

    pending ─enqueue─▶ queued ─claim─▶ running ─park─▶ retry_wait ─requeue_due─▶ queued
    queued ─hand_back─▶ pending                      queued | retry_wait | running ─requeue_lost─▶ queued
    any unfinished ─succeed | fail | cancel | expire─▶ succeeded | failed | cancelled | expired (final, for good)

Claim, park and the final moves start from any unfinished status because deliveries are at least once: a
retry's job runs while its row is `retry_wait`, a second delivery finds it `running`, a late answer finds it
requeued by reconciliation. The final moves are the compare-and-set of `holdback.results`: whichever comes
first wins, the others match nothing.

The batch's own statuses have their named moves too (`BATCH_MOVES`, each setting its `*_at` stamp), and
`BATCH_TRANSITIONS` is the table they make; every batch status change is `move_batch` with one of them:

    validating ─start─▶ in_progress ─begin_finalizing─▶ finalizing ─complete─▶ completed
    validating ─fail─▶ failed        validating | in_progress ─request_cancel─▶ cancelling ─cancel─▶ cancelled
    validating | in_progress ─expire─▶ expired
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, or_, select, update
from sqlalchemy.orm import Session

from holdback.models import REQUEST_TERMINAL, Batch, BatchStatus, RequestRow, RequestStatus

P, Q, RUN, WAIT = RequestStatus.pending, RequestStatus.queued, RequestStatus.running, RequestStatus.retry_wait
INITIAL = P  # every row is created pending (batch_processor.ingest inserts them so)
UNFINISHED = frozenset({P, Q, RUN, WAIT})
FINAL = frozenset(REQUEST_TERMINAL)


class IllegalTransition(ValueError):
    """A status change the lifecycle's table does not allow."""


@dataclass(frozen=True)
class Move:
    name: str
    sources: frozenset[RequestStatus]
    target: RequestStatus

    @property
    def source_values(self) -> tuple[str, ...]:
        return tuple(sorted(s.value for s in self.sources))


ENQUEUE = Move("enqueue", frozenset({P}), Q)  # the processor pushes the row's job (or hands it to sync dispatch)
HAND_BACK = Move("hand_back", frozenset({Q}), P)  # sync dispatch stopped before sending it
CLAIM = Move("claim", UNFINISHED, RUN)  # an attempt opens
PARK = Move("park", UNFINISHED, WAIT)  # the attempt failed in a way worth retrying later
REQUEUE_DUE = Move("requeue_due", frozenset({WAIT}), Q)  # sync dispatch: its retry time has come
REQUEUE_LOST = Move("requeue_lost", frozenset({Q, WAIT, RUN}), Q)  # reconciliation: nothing will run it
SUCCEED = Move("succeed", UNFINISHED, RequestStatus.succeeded)
FAIL = Move("fail", UNFINISHED, RequestStatus.failed)
CANCEL = Move("cancel", UNFINISHED, RequestStatus.cancelled)
EXPIRE = Move("expire", UNFINISHED, RequestStatus.expired)

MOVES: tuple[Move, ...] = (ENQUEUE, HAND_BACK, CLAIM, PARK, REQUEUE_DUE, REQUEUE_LOST, SUCCEED, FAIL, CANCEL, EXPIRE)


def _table(moves: Iterable[Move]) -> dict[RequestStatus, frozenset[RequestStatus]]:
    targets: dict[RequestStatus, set[RequestStatus]] = {s: set() for s in RequestStatus}
    for move in moves:
        for source in move.sources:
            targets[source].add(move.target)
    return {s: frozenset(t) for s, t in targets.items()}


# status -> the statuses a row in it may move to; final statuses move nowhere.
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = _table(MOVES)
_FINISH = {m.target: m for m in (SUCCEED, FAIL, CANCEL, EXPIRE)}


def allowed(source: RequestStatus | str, target: RequestStatus | str) -> bool:
    return RequestStatus(target) in TRANSITIONS[RequestStatus(source)]


def require(source: RequestStatus | str, target: RequestStatus | str) -> None:
    """Raise IllegalTransition unless a row may go from `source` to `target`."""
    source, target = RequestStatus(source), RequestStatus(target)
    if target not in TRANSITIONS[source]:
        can = ", ".join(sorted(t.value for t in TRANSITIONS[source])) or "nothing: it is final"
        raise IllegalTransition(f"a request row cannot go from {source.value} to {target.value}; "
                                f"from {source.value} it may go to {can}")


def final_move(target: RequestStatus | str, *, closing: bool = False) -> Move:
    """The move that makes a row final with `target`; `closing`: only cancel or expire (a batch closing)."""
    target = RequestStatus(target)
    move = _FINISH.get(target)
    if move is None or (closing and move not in (CANCEL, EXPIRE)):
        wanted = "cancelled or expired" if closing else "succeeded, failed, cancelled or expired"
        raise IllegalTransition(f"{target.value} is not a status that ends a request row here; use {wanted}")
    return move


_rows, _batches = RequestRow.__table__, Batch.__table__


def row_update(move: Move):
    """`UPDATE request_rows SET status = <target> WHERE status IN (<sources>)`, for further WHERE and SET."""
    return update(_rows).where(_rows.c.status.in_(move.source_values)).values(status=move.target.value)


# --- the per-attempt moves (hot path: built once, Core, bound parameters) ----------------------------------

_CLOSED_BATCH_VALUES = tuple(s.value for s in (BatchStatus.cancelling, BatchStatus.cancelled, BatchStatus.expired,
                                               BatchStatus.failed, BatchStatus.completed))
# The row moves to running and its attempt number is taken in one statement (the row lock orders racing
# deliveries: each gets the next number), returning what the request needs, its batch's deadline included
# (a subquery in RETURNING: PostgreSQL and SQLite both allow it) — no SELECT before or after.
_CLAIM = (
    row_update(CLAIM)
    .where(_rows.c.id == bindparam("row_id"))
    .values(attempts=_rows.c.attempts + 1, updated_at=bindparam("now"), next_attempt_at=None)
    .returning(_rows.c.attempts, _rows.c.batch_id, _rows.c.tenant_id, _rows.c.custom_id, _rows.c.url,
               _rows.c.body, _rows.c.transient_failures, _rows.c.evictions,
               select(_batches.c.expires_at).where(_batches.c.id == _rows.c.batch_id).scalar_subquery())
)
# The same, only while the row's batch is open and before its deadline (the worker's `begin`).
_CLAIM_IN_OPEN_BATCH = _CLAIM.where(
    select(_batches.c.id)
    .where(_batches.c.id == _rows.c.batch_id, _batches.c.status.not_in(_CLOSED_BATCH_VALUES),
           or_(_batches.c.expires_at.is_(None), _batches.c.expires_at > bindparam("now")))
    .exists()
)
_PARK = (
    row_update(PARK)
    .where(_rows.c.id == bindparam("row_id"))
    .values(next_attempt_at=bindparam("next_attempt_at"), updated_at=bindparam("now"),
            evictions=_rows.c.evictions + bindparam("evicted"),
            transient_failures=_rows.c.transient_failures + bindparam("transient"))
)
_FINISH_ONE = {
    move.target: (
        row_update(move)
        .where(_rows.c.id == bindparam("row_id"))
        .values(response_status=bindparam("response_status"), response_body=bindparam("response_body"),
                error_code=bindparam("error_code"), error_message=bindparam("error_message"),
                input_tokens=bindparam("input_tokens"), output_tokens=bindparam("output_tokens"),
                cached_tokens=bindparam("cached_tokens"), reasoning_tokens=bindparam("reasoning_tokens"),
                finished_at=bindparam("now"), updated_at=bindparam("now"), next_attempt_at=None)
        .returning(_rows.c.batch_id)
    )
    for move in (SUCCEED, FAIL)
}


def claim(conn: Connection, row_id: str, now: float, *, open_batch_only: bool = False) -> tuple | None:
    """unfinished → running, counting the attempt; returns (attempt number, batch_id, tenant_id, custom_id,
    url, body, transient_failures, evictions, the batch's expires_at), or None if the row is final or gone — or, with
    `open_batch_only`, if its batch is closing or past its deadline."""
    statement = _CLAIM_IN_OPEN_BATCH if open_batch_only else _CLAIM
    return conn.execute(statement, {"row_id": row_id, "now": now}).one_or_none()


def park(conn: Connection, row_id: str, next_attempt_at: float, now: float, *, evicted: bool,
         transient: bool) -> bool:
    """unfinished → retry_wait until `next_attempt_at`; False if the row became final meanwhile."""
    return conn.execute(_PARK, {"row_id": row_id, "next_attempt_at": next_attempt_at, "now": now,
                                "evicted": 1 if evicted else 0, "transient": 1 if transient else 0}).rowcount == 1


def finish(conn: Connection, row_id: str, target: RequestStatus, now: float, **result) -> str | None:
    """unfinished → succeeded | failed with the result's columns (see `_FINISH_ONE`); returns the row's
    batch_id, or None if the row was already final (the compare-and-set lost)."""
    move = final_move(target)
    statement = _FINISH_ONE.get(move.target)
    if statement is None:
        raise IllegalTransition(f"a single row ends as succeeded or failed; {target.value} closes a whole batch "
                                "(close_unfinished)")
    return conn.execute(statement, {"row_id": row_id, "now": now, **result}).scalar_one_or_none()


# --- the processor's moves over many rows -----------------------------------------------------------------


def enqueue(session: Session, row_ids: list[str], now: float) -> set[str]:
    """pending → queued; returns the ids that moved (a row no longer pending is left as it is)."""
    return set(session.scalars(
        row_update(ENQUEUE).where(_rows.c.id.in_(row_ids))
        .values(enqueued_at=now, updated_at=now).returning(_rows.c.id)
    ))


def hand_back(session: Session, row_ids: list[str]) -> int:
    """queued → pending: rows sync dispatch took but never started go back to the processor's plan."""
    return session.execute(
        row_update(HAND_BACK).where(_rows.c.id.in_(row_ids)).values(enqueued_at=None)
    ).rowcount


def requeue_due(session: Session, row_ids: list[str], now: float) -> list[tuple[str, str]]:
    """retry_wait → queued; returns (row_id, batch_id) of the rows that moved."""
    return [tuple(r) for r in session.execute(
        row_update(REQUEUE_DUE).where(_rows.c.id.in_(row_ids))
        .values(enqueued_at=now, updated_at=now, next_attempt_at=None)
        .returning(_rows.c.id, _rows.c.batch_id)
    )]


def requeue_lost(session: Session, row_ids: list[str], source: RequestStatus, still, now: float) -> list[tuple]:
    """queued | retry_wait | running → queued for rows nothing will run (reconciliation), while `still` (a
    WHERE clause) holds; returns (row_id, batch_id, attempts) of the rows that moved. A lost row keeps its
    retry time only when it was running (its attempt is abandoned; the next one starts at once)."""
    require(source, REQUEUE_LOST.target)
    values = dict(enqueued_at=now, updated_at=now)
    if source is not RUN:
        values["next_attempt_at"] = None
    return [tuple(r) for r in session.execute(
        row_update(REQUEUE_LOST).where(_rows.c.id.in_(row_ids), _rows.c.status == source.value, still)
        .values(**values)
        .returning(_rows.c.id, _rows.c.batch_id, _rows.c.attempts)
    )]


def close_unfinished(session: Session, batch_id: str, target: RequestStatus, code: str, message: str,
                     now: float, ids: list[str] | None = None) -> int:
    """unfinished → cancelled | expired for every such row of a batch, or of those of `ids` (one UPDATE, each
    row only while it is unfinished); returns how many."""
    move = final_move(target, closing=True)
    statement = row_update(move).where(_rows.c.batch_id == batch_id)
    if ids is not None:
        statement = statement.where(_rows.c.id.in_(ids))
    return session.execute(
        statement.values(error_code=code, error_message=message, finished_at=now, updated_at=now, next_attempt_at=None)
    ).rowcount


# --- the batch's statuses -----------------------------------------------------------------------------------

_B = BatchStatus


@dataclass(frozen=True)
class BatchMove:
    name: str
    sources: frozenset[BatchStatus]
    target: BatchStatus
    stamp: str  # the `*_at` column the move sets (unix seconds)


BATCH_START = BatchMove("start", frozenset({_B.validating}), _B.in_progress, "in_progress_at")  # expanded into rows
BATCH_FAIL = BatchMove("fail", frozenset({_B.validating}), _B.failed, "failed_at")  # invalid input
BATCH_BEGIN_FINALIZING = BatchMove("begin_finalizing", frozenset({_B.in_progress}), _B.finalizing, "finalizing_at")
BATCH_COMPLETE = BatchMove("complete", frozenset({_B.finalizing}), _B.completed, "completed_at")
BATCH_REQUEST_CANCEL = BatchMove("request_cancel", frozenset({_B.validating, _B.in_progress}), _B.cancelling,
                                 "cancelling_at")  # the API asks; the processor closes the rows
BATCH_CANCEL = BatchMove("cancel", frozenset({_B.cancelling}), _B.cancelled, "cancelled_at")
BATCH_EXPIRE = BatchMove("expire", frozenset({_B.validating, _B.in_progress}), _B.expired, "expired_at")

BATCH_MOVES: tuple[BatchMove, ...] = (BATCH_START, BATCH_FAIL, BATCH_BEGIN_FINALIZING, BATCH_COMPLETE,
                                      BATCH_REQUEST_CANCEL, BATCH_CANCEL, BATCH_EXPIRE)


def _batch_table(moves: Iterable[BatchMove]) -> dict[BatchStatus, frozenset[BatchStatus]]:
    targets: dict[BatchStatus, set[BatchStatus]] = {s: set() for s in BatchStatus}
    for move in moves:
        for source in move.sources:
            targets[source].add(move.target)
    return {s: frozenset(t) for s, t in targets.items()}


# status -> the statuses a batch in it may move to; final statuses move nowhere.
BATCH_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = _batch_table(BATCH_MOVES)
# The move finalization ends a batch with, by the status it ends in.
_BATCH_CLOSE = {m.target: m for m in (BATCH_COMPLETE, BATCH_CANCEL, BATCH_EXPIRE)}


def batch_sources(sources: Iterable[BatchStatus], target: BatchStatus) -> tuple[str, ...]:
    """The status values a batch move's guarded UPDATE may match; IllegalTransition if the table lacks one."""
    values = []
    for source in sources:
        if target not in BATCH_TRANSITIONS[source]:
            can = ", ".join(sorted(t.value for t in BATCH_TRANSITIONS[source])) or "nothing: it is final"
            raise IllegalTransition(f"a batch cannot go from {source.value} to {target.value}; "
                                    f"from {source.value} it may go to {can}")
        values.append(source.value)
    return tuple(values)


def batch_update(sources: Iterable[BatchStatus], target: BatchStatus):
    """`UPDATE batches SET status = <target> WHERE status IN (<sources>)`, checked against the table."""
    return update(_batches).where(_batches.c.status.in_(batch_sources(sources, target))).values(status=target.value)


def closing_move(target: BatchStatus) -> BatchMove:
    """The move that closes a batch with `target` once its files are written: complete, cancel or expire."""
    move = _BATCH_CLOSE.get(BatchStatus(target))
    if move is None:
        raise IllegalTransition(f"{BatchStatus(target).value} is not a status finalization ends a batch in; "
                                "use completed, cancelled or expired")
    return move


def move_batch(session: Session, move: BatchMove, batch_id: str, now: int, *where,
               sources: Iterable[BatchStatus] | None = None, **values) -> bool:
    """One batch move: from its sources (or these of them) to its target, setting its stamp to `now` and `values`,
    while every clause in `where` holds. False if the batch was in none of them (or `where` failed): a race the
    caller learns from, never a move the table does not allow."""
    statement = (
        batch_update(move.sources if sources is None else sources, move.target)
        .where(_batches.c.id == batch_id, *where)
        .values(**{move.stamp: now}, **values)
        .execution_options(synchronize_session=False)
    )
    return session.execute(statement).rowcount == 1


def start_batch(session: Session, batch_id: str, now: int, *where, **values) -> bool:
    """validating → in_progress: every line was valid and its rows are in."""
    return move_batch(session, BATCH_START, batch_id, now, *where, **values)


def fail_batch(session: Session, batch_id: str, now: int, *where, **values) -> bool:
    """validating → failed: the input is invalid (`values` carries the errors)."""
    return move_batch(session, BATCH_FAIL, batch_id, now, *where, **values)


def begin_finalizing(session: Session, batch_id: str, now: int, *where) -> bool:
    """in_progress → finalizing: every row is final."""
    return move_batch(session, BATCH_BEGIN_FINALIZING, batch_id, now, *where)


def request_cancel(session: Session, batch_id: str, now: int) -> bool:
    """validating | in_progress → cancelling: a tenant or the operator asked to cancel."""
    return move_batch(session, BATCH_REQUEST_CANCEL, batch_id, now)


def close_batch(session: Session, target: BatchStatus, sources: Iterable[BatchStatus], batch_id: str, now: int,
                *where, **values) -> bool:
    """finalizing → completed, cancelling → cancelled, or validating | in_progress → expired (`closing_move`),
    from those of `sources` only, once the batch's files are written (`values` names them)."""
    return move_batch(session, closing_move(target), batch_id, now, *where, sources=sources, **values)
