"""Sending a dispatched request to its replica until the response headers are in, and failing over.

Until the first byte of an answer a failed replica is taken out and the request moves to another healthy one
with room (flow control's `reassign` moves its slot and its KV reservation): a replica that refuses the
connection, one that closes a new connection before answering (it died with the request, which is then sent once
more, no further) and one that answers 401/403 (it refuses the gateway's own key). A replica that answers 503
without Retry-After (vLLM's own queue limits) stays in: the request moves on, or is answered 429 `saturated`. A pooled connection the
replica had closed while it sat idle read nothing of the request: it is sent again on a new connection. With no
replica left the answer is the last failure (502).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from aiohttp import web
from multidict import CIMultiDict

from gateway.cache_salt import PRIORITY_HEADER, replica_priority, with_priority
from gateway.flow.interface import FlowControl
from gateway.flow.request import DropReason, FlowRequest
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.replicas import UNAUTHORIZED
from gateway.responses import drop_response, error_response
from gateway.upstream import ConnectFailed, UpstreamConnection, UpstreamError, UpstreamPool
from holdback.contract import inference_endpoint

logger = logging.getLogger("gateway.proxy")


class Failover:
    def __init__(self, metrics: GatewayMetrics, headers: Callable[[web.Request, str, str], CIMultiDict],
                 failure: Callable[..., web.Response]):
        self.metrics = metrics
        # The request headers for a replica (request, request id, replica url), and the proxy's count, log and
        # answer for a transport failure (replica, exc, request id, down=).
        self.headers = headers
        self.failure = failure

    async def exchange(self, pool: UpstreamPool, flow: FlowControl, request: web.Request, req: FlowRequest,
                       body: bytes) -> UpstreamConnection | web.Response:
        """The connection with the response headers in, or the answer when no replica could take the request.
        `flow`: the flow control of the request's model pool. Raises the exchange's error (timeout, bad HTTP)
        with the connection closed."""
        sends = _Sends(pool, flow, request, req, body)
        while True:
            sent = await self._send(sends)
            if sent is not None:
                return sent

    async def _send(self, s: _Sends) -> UpstreamConnection | web.Response | None:
        """One send to the request's replica: its connection with the response headers in, the answer when no
        replica is left, or None to send again (to another replica, or on a new connection)."""
        req = s.req
        replica = req.leased().replica
        try:
            conn = await s.pool.open(replica.url, fresh=s.fresh)
        except ConnectFailed as exc:
            # Nothing reached the replica, so another one may take the request.
            s.fresh = False
            return await self._move(s, "connect", self.failure(replica, exc, req.request_id))
        except asyncio.TimeoutError as exc:
            return self.failure(replica, exc, req.request_id)
        headers = self.headers(s.request, req.request_id, replica.url)
        body = s.body
        if s.flow.loaded.config.engine.priority_scheduling(replica.url):
            # Whatever waits inside the replica waits in the gateway's order (never sent to an fcfs replica).
            # vLLM's generation endpoints read the header; its pooling ones (embeddings) only the body's field.
            endpoint = inference_endpoint(s.request.path)
            if endpoint is None or endpoint.generates:
                headers[PRIORITY_HEADER] = str(replica_priority(req.priority))
            else:
                body = with_priority(body, replica_priority(req.priority))
        try:
            conn.send(s.request.method, s.request.path_qs, headers, body)
            lost = await _headers_in(conn)
        except BaseException:  # cancelled (eviction, the caller left) or failed: never pooled
            conn.close()
            s.pool.put(conn)
            raise
        if lost is not None:
            return await self._unanswered(s, conn, lost)
        if conn.status in UNAUTHORIZED:
            return await self._refused_key(s, conn)
        if conn.status == 503 and not any(name.lower() == b"retry-after" for name, _ in conn.headers):
            return await self._replica_full(s, conn)
        return conn

    async def _unanswered(self, s: _Sends, conn: UpstreamConnection, exc: UpstreamError) -> web.Response | None:
        """The connection closed before one byte of an answer."""
        stale = conn.stale()
        s.pool.put(conn)
        s.fresh = stale
        if stale:
            # The replica had closed this pooled connection while it was idle and read nothing of the request:
            # send it once more on a new connection.
            return None
        # A new connection closed before one byte of an answer: the replica died with the request.
        failed = self.failure(s.req.leased().replica, exc, s.req.request_id, down=True)
        if s.resent:
            return failed
        s.resent = True
        return await self._move(s, "closed", failed)

    async def _refused_key(self, s: _Sends, conn: UpstreamConnection) -> web.Response | None:
        """The replica answered 401/403: the caller's key is never forwarded, so it refuses the gateway's own."""
        replica = s.req.leased().replica
        status = conn.status
        s.flow.pool.mark_unauthorized(replica, s.request.path, status)
        conn.close()
        s.pool.put(conn)
        self.metrics.child(self.metrics.upstream_errors, replica.url).inc()
        s.fresh = False
        return await self._move(s, "unauthorized", error_response(
            502, f"The model replica refused the gateway's own key (HTTP {status}); the gateway's operator "
            "must set upstream.apiKey (or upstream.replicaKeys) to the replicas' --api-key.",
            "upstream_error", "upstream_unauthorized", s.req.request_id))

    async def _replica_full(self, s: _Sends, conn: UpstreamConnection) -> web.Response | None:
        """503 without Retry-After: vLLM's own queue is full (--max-num-queued-reqs / --max-num-queued-tokens)
        or it could not start the request. The replica is up and nothing of the answer went out: another replica
        with room takes it; with none (or every one answered so), the caller is told to come back, as for a full
        gateway queue (429 `saturated`, Retry-After), never a failure of the replica or of the path to it."""
        replica = s.req.leased().replica
        conn.close()
        s.pool.put(conn)
        s.full.add(replica.url)
        log_event(logger, "replica_full", request_id=s.req.request_id, replica=replica.url)
        busy = drop_response(DropReason.SATURATED, s.req.request_id,
                             "Every model replica that could take this request answered that its own queue is full "
                             "(HTTP 503); retry later.")
        if len(s.full) >= len(s.flow.pool.healthy()):
            return busy
        s.fresh = False
        return await self._move(s, "replica_full", busy)

    async def _move(self, s: _Sends, reason: str, failed: web.Response) -> web.Response | None:
        """Nothing of the answer has reached the caller and its replica is out: flow control hands the request to
        another healthy replica with room, moving its slot and KV reservation (None: send it there); `failed` is
        the answer when none is left."""
        req = s.req
        old = req.leased().replica
        replica = await s.flow.reassign(req)
        if replica is None:
            return failed
        self.metrics.child(self.metrics.upstream_moves, reason).inc()
        log_event(logger, "upstream_moved", request_id=req.request_id, replica=old.url,
                  to=replica.url, reason=reason)
        return None


class _Sends:
    """The sends of one request: what to send where, whether the next needs a new connection, whether it was
    sent once more after its replica died."""

    __slots__ = ("pool", "flow", "request", "req", "body", "fresh", "resent", "full")

    def __init__(self, pool: UpstreamPool, flow: FlowControl, request: web.Request, req: FlowRequest, body: bytes):
        self.pool, self.flow, self.request, self.req, self.body = pool, flow, request, req, body
        self.fresh = False  # the next connection is a new one (the pooled one was closed while idle)
        self.resent = False
        self.full: set[str] = set()  # replicas that answered their queue is full


async def _headers_in(conn: UpstreamConnection) -> UpstreamError | None:
    """Wait for the response headers; the error when the connection closed before one byte of an answer came."""
    try:
        while not conn.status:
            await conn.wait()
    except UpstreamError as exc:
        if conn.unanswered():
            return exc
        raise
    return None
