"""The only writer of a gateway request's status: one named move per transition.

    move        from                 to
    queue       NEW                  QUEUED       no room now: it waits in its band
    dispatch    NEW, QUEUED          DISPATCHED   a replica and its KV reservation: the lease
    reject      NEW, QUEUED          REJECTED     with a drop reason (saturated, expired, ...)
    withdraw    QUEUED               WITHDRAWN    the caller left while it waited
    evict       DISPATCHED           DISPATCHED   marked: its task is cancelled, its finish follows
    stop        DISPATCHED           DISPATCHED   marked: its process is at its drain deadline before the answer
                                                  began; its task is cancelled and answers 503, its finish follows
    finish      DISPATCHED           FINISHED     or EVICTED, when it was marked by `evict`

Flow control (gateway/flow/controller.py, eviction_control.py) and a relay's mirror of it
(gateway/relays/remote_flow.py) apply the same moves; `tests/gateway/test_moves.py` fails if anything else
assigns `.status`. A move from a status not in its row raises `IllegalMove`: callers check first, so one means
a bug, not a race.
"""

from __future__ import annotations

import asyncio

from gateway.flow.request import DropReason, FlowRequest, Lease, Status


class IllegalMove(RuntimeError):
    """A move was asked of a request in a status it does not start from."""


def _from(req: FlowRequest, move: str, *allowed: Status) -> None:
    if req.status not in allowed:
        raise IllegalMove(f"{move}: request {req.request_id} is {req.status.value}, not "
                          + " or ".join(s.value for s in allowed))


def queue(req: FlowRequest, now: float, waiter: asyncio.Future) -> None:
    _from(req, "queue", Status.NEW)
    req.status = Status.QUEUED
    req.enqueued_at = now
    req.waiter = waiter


def dispatch(req: FlowRequest, lease: Lease) -> None:
    _from(req, "dispatch", Status.NEW, Status.QUEUED)
    req.status = Status.DISPATCHED
    req.lease = lease


def reject(req: FlowRequest, reason: DropReason, message: str | None = None) -> None:
    _from(req, "reject", Status.NEW, Status.QUEUED)
    req.status = Status.REJECTED
    req.drop_reason, req.drop_message = reason, message


def withdraw(req: FlowRequest) -> None:
    _from(req, "withdraw", Status.QUEUED)
    req.status = Status.WITHDRAWN
    req.drop_reason = DropReason.CONTEXT_CANCELLED


def evict(req: FlowRequest, now: float) -> None:
    """Mark a running request evicted; it ends (EVICTED) when its upstream closes and `finish` is applied."""
    _from(req, "evict", Status.DISPATCHED)
    req.drop_reason = DropReason.EVICTED
    req.evicted_at = now


def stop(req: FlowRequest, reason: DropReason) -> None:
    """Mark a running request whose answer has not begun refused with `reason`: its process is at its drain
    deadline (gateway/relays/drain.py). Its handler closes the upstream and answers; it ends FINISHED."""
    _from(req, "stop", Status.DISPATCHED)
    req.drop_reason = reason


def finish(req: FlowRequest) -> bool:
    """The dispatched request let go of its replica; True when it ended evicted."""
    _from(req, "finish", Status.DISPATCHED)
    evicted = req.drop_reason is DropReason.EVICTED
    req.status = Status.EVICTED if evicted else Status.FINISHED
    return evicted
