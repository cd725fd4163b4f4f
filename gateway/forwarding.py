"""One dispatched request on its way through the proxy (gateway/proxy.py): its connection to the replica, the
caller's stream, and how it ended, which the proxy tells flow control once before the rest of the answer goes out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.flow.request import End

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.flow.interface import FlowControl
    from gateway.flow.request import FlowRequest
    from gateway.responses_stream import RelayedResponseEvents
    from gateway.stored_responses import Turn
    from gateway.upstream import UpstreamConnection


class Forwarding:
    """One dispatched request on its way: its connection, the caller's stream, and how it ended."""

    __slots__ = ("request", "flow", "req", "conn", "stream", "cause", "at", "answer", "error", "evicted", "turn",
                 "events")

    def __init__(self, request: web.Request, flow: FlowControl, req: FlowRequest, turn: Turn | None = None):
        self.request, self.flow, self.req, self.turn = request, flow, req, turn  # turn: a /v1/responses request's
        self.conn: UpstreamConnection | None = None
        self.stream: web.StreamResponse | None = None
        # A streamed /v1/responses answer, read as it is relayed: an eviction ends it with Responses events.
        self.events: RelayedResponseEvents | None = None
        # How it ended, for flow control (finish's cause and when it was seen), and what is left to answer.
        self.cause = End.END
        self.at: float | None = None
        self.answer: web.StreamResponse | None = None
        self.error: BaseException | None = None
        self.evicted = False

    def ended(self, cause: End, at: float | None, *, answer: web.StreamResponse | None = None,
              error: BaseException | None = None) -> None:
        """`cause` and `at` (monotonic; None: flow control times it, an eviction from its decision) for finish."""
        self.cause, self.at = cause, at
        self.answer, self.error = answer, error

    def close_upstream(self) -> None:
        if self.conn is not None:
            self.conn.close()
