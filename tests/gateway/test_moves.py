"""A gateway request's status has one writer, `gateway/flow/moves.py`, and each move starts only where its row says.

The guard walks every module of the gateway: an assignment to `<request>.status` anywhere but in moves.py (a
second writer put back) fails here, naming the file and the line.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from gateway.flow import moves
from gateway.flow.request import Ask, DropReason, FlowRequest, Lease, Status
from gateway.replicas import Replica

pytestmark = pytest.mark.unit

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
WRITER = GATEWAY / "flow" / "moves.py"


def _status_writes(tree: ast.AST) -> list[int]:
    """Lines that assign a `.status` other than an object's own (`self.status = ...` in its class), or set it
    through setattr."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                               else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr == "status"
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "status"):
            lines.append(node.lineno)
    return lines


def test_only_moves_writes_a_requests_status():
    writers = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        if path != WRITER:
            lines = _status_writes(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                writers[str(path.relative_to(GATEWAY.parent))] = lines
    assert not writers, f"a request's status is written outside gateway/flow/moves.py: {writers}"


def test_the_guard_sees_a_second_writer():
    assert _status_writes(ast.parse("req.status = Status.FINISHED")) == [1]
    assert _status_writes(ast.parse("a, req.status = 1, Status.QUEUED")) == [1]
    assert _status_writes(ast.parse("setattr(req, 'status', Status.QUEUED)")) == [1]
    assert _status_writes(ast.parse("self.status = resp.status")) == []  # an object's own, not a request's
    assert _status_writes(ast.parse(WRITER.read_text()))  # where they belong


def _request() -> FlowRequest:
    return FlowRequest(Ask(request_id="r", objective="batch", priority=-10, fairness_id="t", tenant="t",
                           arrived=0.0))


def test_each_move_starts_only_where_its_row_says():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        req = _request()
        with pytest.raises(moves.IllegalMove, match="finish: request r is new, not dispatched"):
            moves.finish(req)
        moves.queue(req, 1.0, loop.create_future())
        assert (req.status, req.enqueued_at) == (Status.QUEUED, 1.0)
        with pytest.raises(moves.IllegalMove):
            moves.queue(req, 2.0, loop.create_future())
        moves.dispatch(req, Lease(Replica("http://r"), 2.0))
        assert req.status is Status.DISPATCHED and req.replica is not None and req.dispatched_at == 2.0
        with pytest.raises(moves.IllegalMove):
            moves.withdraw(req)
        moves.evict(req, 3.0)
        assert req.status is Status.DISPATCHED and req.drop_reason is DropReason.EVICTED
        assert moves.finish(req) is True and req.status is Status.EVICTED

        queued = _request()
        moves.queue(queued, 1.0, loop.create_future())
        moves.withdraw(queued)
        assert (queued.status, queued.drop_reason) == (Status.WITHDRAWN, DropReason.CONTEXT_CANCELLED)
        refused = _request()
        moves.reject(refused, DropReason.SATURATED, "full")
        assert (refused.status, refused.drop_message) == (Status.REJECTED, "full")
        with pytest.raises(moves.IllegalMove):
            moves.dispatch(refused, Lease(Replica("http://r"), 2.0))

    asyncio.run(main())


def test_a_request_has_no_replica_before_its_lease():
    req = _request()
    assert req.replica is None and req.reservation is None and req.dispatched_at == 0.0
    with pytest.raises(RuntimeError, match="never dispatched"):
        req.leased()
