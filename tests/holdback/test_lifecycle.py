"""The request row's lifecycle: each declared move, its guard against rows in other statuses, the refused
illegal moves, and the database's own refusal of an unknown status (migration 0007), on both backends."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import inspect, text, update
from sqlalchemy.exc import IntegrityError

from holdback import lifecycle
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.lifecycle import IllegalTransition
from holdback.models import Batch, BatchStatus, RequestRow, RequestStatus, Tenant
from holdback.schema import alembic_config

S = RequestStatus
ALL = tuple(RequestStatus)


def _rows(factory, statuses):
    """One batch with a row in each of these statuses; returns (batch_id, row ids in the same order)."""
    with transaction(factory) as s:
        t = Tenant(name=f"t-{time.time_ns()}")
        s.add(t)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                  window_seconds=86400, status="in_progress", total=len(statuses))
        s.add(b)
        s.flush()
        rows = [RequestRow(batch_id=b.id, tenant_id=t.id, line=i + 1, custom_id=f"c{i}", url="/v1/chat/completions",
                           body="{}") for i in range(len(statuses))]
        s.add_all(rows)
        s.flush()
        for row, status in zip(rows, statuses):
            # Tests place rows in any status directly; the code under test never writes status but through lifecycle.
            s.execute(update(RequestRow).where(RequestRow.id == row.id).values(status=status.value))
        return b.id, [r.id for r in rows]


def _status(factory, row_id):
    with factory() as s:
        return s.get(RequestRow, row_id).status


@pytest.fixture
def factory(backend):
    engine = make_engine(backend.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


# Each move, called on one row in every status: (the call, the move it makes).
def _enqueue(s, row_id, batch_id):
    return row_id in lifecycle.enqueue(s, [row_id], time.time())


def _hand_back(s, row_id, batch_id):
    return lifecycle.hand_back(s, [row_id]) == 1


def _claim(s, row_id, batch_id):
    return lifecycle.claim(s.connection(), row_id, time.time()) is not None


def _park(s, row_id, batch_id):
    return lifecycle.park(s.connection(), row_id, time.time() + 60, time.time(), evicted=True, transient=False)


def _requeue_due(s, row_id, batch_id):
    return lifecycle.requeue_due(s, [row_id], time.time()) == [(row_id, batch_id)]


def _requeue_lost(s, row_id, batch_id):
    moved = False
    for source in lifecycle.REQUEUE_LOST.sources:
        moved |= bool(lifecycle.requeue_lost(s, [row_id], source, text("1 = 1"), time.time()))
    return moved


def _finisher(target):
    def finish(s, row_id, batch_id):
        return lifecycle.finish(s.connection(), row_id, target, time.time(), response_status=200, response_body="{}",
                                error_code=None, error_message=None, input_tokens=1, output_tokens=2,
                                cached_tokens=0, reasoning_tokens=0) == batch_id
    return finish


def _closer(target):
    def close(s, row_id, batch_id):
        return lifecycle.close_unfinished(s, batch_id, target, "closed", "closed by the test", time.time()) == 1
    return close


CALLS = {
    lifecycle.ENQUEUE: _enqueue, lifecycle.HAND_BACK: _hand_back, lifecycle.CLAIM: _claim, lifecycle.PARK: _park,
    lifecycle.REQUEUE_DUE: _requeue_due, lifecycle.REQUEUE_LOST: _requeue_lost,
    lifecycle.SUCCEED: _finisher(S.succeeded), lifecycle.FAIL: _finisher(S.failed),
    lifecycle.CANCEL: _closer(S.cancelled), lifecycle.EXPIRE: _closer(S.expired),
}


def test_every_declared_move_has_its_test():
    assert set(CALLS) == set(lifecycle.MOVES)


@pytest.mark.parametrize("move", lifecycle.MOVES, ids=lambda m: m.name)
def test_each_move_takes_its_sources_to_its_target_and_leaves_every_other_status_alone(factory, move):
    for status in ALL:  # one batch per status: close_unfinished works on a whole batch
        batch_id, (row_id,) = _rows(factory, [status])
        with transaction(factory) as s:
            moved = CALLS[move](s, row_id, batch_id)
        assert moved is (status in move.sources), (move.name, status)
        assert _status(factory, row_id) == (move.target if moved else status).value, (move.name, status)


def test_the_table_is_what_the_moves_declare():
    for status in lifecycle.FINAL:
        assert lifecycle.TRANSITIONS[status] == frozenset()
    assert lifecycle.TRANSITIONS[S.pending] == {S.queued, S.running, S.retry_wait, *lifecycle.FINAL}
    assert lifecycle.TRANSITIONS[S.queued] == {S.pending, S.queued, S.running, S.retry_wait, *lifecycle.FINAL}
    assert lifecycle.allowed("retry_wait", "queued") and not lifecycle.allowed("pending", "pending")


def test_an_illegal_move_is_refused_with_an_error_that_says_what_is_allowed(factory):
    with pytest.raises(IllegalTransition, match="cannot go from succeeded to running; .* nothing: it is final"):
        lifecycle.require(S.succeeded, S.running)
    with pytest.raises(IllegalTransition, match="from pending to pending; from pending it may go to cancelled"):
        lifecycle.require("pending", "pending")
    batch_id, (row_id,) = _rows(factory, [S.running])
    with transaction(factory) as s:
        with pytest.raises(IllegalTransition, match="running is not a status that ends a request row"):
            lifecycle.finish(s.connection(), row_id, S.running, time.time())
        with pytest.raises(IllegalTransition, match="closes a whole batch"):
            lifecycle.finish(s.connection(), row_id, S.cancelled, time.time())
        with pytest.raises(IllegalTransition, match="use cancelled or expired"):
            lifecycle.close_unfinished(s, batch_id, S.succeeded, "x", "y", time.time())
        with pytest.raises(IllegalTransition, match="cannot go from succeeded to queued"):
            lifecycle.requeue_lost(s, [row_id], S.succeeded, text("1 = 1"), time.time())
    assert _status(factory, row_id) == "running"


def test_a_final_row_never_moves_again(factory):
    """The race the guard exists for: a late caller's move on a row that became final matches nothing."""
    batch_id, ids = _rows(factory, list(lifecycle.FINAL))
    with transaction(factory) as s:
        for row_id in ids:
            assert not _claim(s, row_id, batch_id) and not _park(s, row_id, batch_id)
            assert not _finisher(S.succeeded)(s, row_id, batch_id)
        assert lifecycle.close_unfinished(s, batch_id, S.expired, "x", "y", time.time()) == 0
    assert [_status(factory, r) for r in ids] == [st.value for st in lifecycle.FINAL]


def test_batch_moves_are_checked_against_the_batch_table():
    assert lifecycle.batch_sources((BatchStatus.validating, BatchStatus.in_progress), BatchStatus.expired) == (
        "validating", "in_progress")
    with pytest.raises(IllegalTransition, match="a batch cannot go from completed to in_progress"):
        lifecycle.batch_update((BatchStatus.completed,), BatchStatus.in_progress)
    with pytest.raises(IllegalTransition, match="from finalizing to cancelling; from finalizing it may go to completed"):
        lifecycle.batch_sources((BatchStatus.finalizing,), BatchStatus.cancelling)


def test_the_database_refuses_a_status_the_lifecycle_does_not_know(factory):
    batch_id, (row_id,) = _rows(factory, [S.pending])
    with pytest.raises(IntegrityError, match="ck_request_rows_status"):
        with transaction(factory) as s:
            s.execute(update(RequestRow).where(RequestRow.id == row_id).values(status="done"))
    with pytest.raises(IntegrityError, match="ck_request_rows_status"):
        with transaction(factory) as s:
            s.add(RequestRow(batch_id=batch_id, tenant_id="t", line=9, custom_id="c9", url="/v1/x", body="{}",
                             status="Pending"))
    assert _status(factory, row_id) == "pending"


def _migrate(engine, fn, revision):
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        fn(cfg, revision)


def test_migration_0007_keeps_rows_and_attempts_and_refuses_unknown_statuses(backend):
    engine = make_engine(backend.database_url)
    factory = make_sessionmaker(engine)
    try:
        # Written through the models before going down: they map today's columns (batches.cancelled, 0009).
        batch_id, ids = _rows(factory, [S.running, S.succeeded])
        _migrate(engine, command.downgrade, "0006")
        with engine.connect() as conn:
            assert inspect(conn).get_check_constraints("request_rows") == []
        with transaction(factory) as s:
            for row_id in ids:
                s.execute(text("INSERT INTO attempts (request_id, batch_id, number, started_at, evicted, input_tokens,"
                               " output_tokens) VALUES (:r, :b, 1, 0, false, 0, 0)"), {"r": row_id, "b": batch_id})
            s.execute(update(RequestRow).where(RequestRow.id == ids[1]).values(status="done"))  # no check at 0006
        with pytest.raises(RuntimeError, match=r"statuses the lifecycle does not know: 'done' \(1 rows\)"):
            _migrate(engine, command.upgrade, "head")
        with transaction(factory) as s:
            s.execute(update(RequestRow).where(RequestRow.id == ids[1]).values(status="succeeded"))
        _migrate(engine, command.upgrade, "head")
        with engine.connect() as conn:
            names = [c["name"] for c in inspect(conn).get_check_constraints("request_rows")]
            attempts = conn.execute(text("SELECT request_id FROM attempts ORDER BY request_id")).scalars().all()
        assert names == ["ck_request_rows_status"]
        assert attempts == sorted(ids)  # the SQLite rebuild of request_rows did not cascade them away
        assert [_status(factory, r) for r in ids] == ["running", "succeeded"]
        with pytest.raises(IntegrityError):
            with transaction(factory) as s:
                s.execute(update(RequestRow).where(RequestRow.id == ids[0]).values(status="done"))
    finally:
        engine.dispose()


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("holdback", "batch_api", "batch_processor", "async_processor", "bench")
STATUS_TABLES = {"RequestRow", "Batch", "_rows", "_batches"}


def _status_writes(tree: ast.AST) -> list[int]:
    """Lines that set a request row's or a batch's status: `update(<those tables>)...values(status=...)`, or
    an assignment of a RequestStatus to some `.status`."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values"
                and any(k.arg == "status" for k in node.keywords)):
            root = node.func.value
            while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute):
                root = root.func.value
            if isinstance(root, ast.Call) and getattr(root.func, "id", None) == "update" and root.args:
                table = root.args[0]
                name = table.id if isinstance(table, ast.Name) else getattr(table.value, "id", None)
                if name in STATUS_TABLES:
                    lines.append(node.lineno)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "status"
                                                for t in node.targets):
            if "RequestStatus" in ast.unparse(node.value):
                lines.append(node.lineno)
    return lines


def test_no_module_but_the_lifecycle_writes_a_status():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "holdback" / "lifecycle.py":
                continue
            lines = _status_writes(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}, f"status changes outside holdback/lifecycle.py; call its moves instead: {found}"


def test_the_status_write_finder_sees_one():
    assert _status_writes(ast.parse("update(RequestRow).where(x).values(status='queued', a=1)")) == [1]
    assert _status_writes(ast.parse("row.status = RequestStatus.failed.value")) == [1]
    assert _status_writes(ast.parse("update(File).values(status='deleted')")) == []
    assert _status_writes(ast.parse((ROOT / "holdback" / "lifecycle.py").read_text()))  # where they belong


def _batch_stamp_writes(tree: ast.AST) -> list[int]:
    """Lines that set a batch move's `*_at` stamp in some `.values(...)`: the batch moves set their own."""
    stamps = {move.stamp for move in lifecycle.BATCH_MOVES}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values"
            and any(k.arg in stamps for k in node.keywords)]


def test_no_module_but_the_lifecycle_stamps_a_batch_move():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "holdback" / "lifecycle.py":
                continue
            lines = _batch_stamp_writes(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}, f"batch *_at stamps set outside holdback/lifecycle.py; call its batch moves: {found}"
    assert _batch_stamp_writes(ast.parse("update(Batch).values(cancelling_at=1)")) == [1]


def test_every_batch_move_is_in_the_batch_table_and_sets_its_stamp():
    for move in lifecycle.BATCH_MOVES:
        assert all(move.target in lifecycle.BATCH_TRANSITIONS[s] for s in move.sources)
        assert move.stamp == f"{move.target.value}_at" and hasattr(Batch, move.stamp)
    assert lifecycle.closing_move(BatchStatus.expired) is lifecycle.BATCH_EXPIRE
    with pytest.raises(IllegalTransition, match="in_progress is not a status finalization ends a batch in"):
        lifecycle.closing_move(BatchStatus.in_progress)
