"""The proxy: classify, pass flow control, forward to the picked replica, relay the answer byte for byte.

Requests go to the replicas over the lean HTTP/1.1 client of gateway/upstream.py (pooled keep-alive
connections driven by an asyncio Protocol). Non-streaming answers are read whole and returned; for event
streams the response headers are sent with the first body chunk, so an eviction before the first token still
gets a clean 429, and after it the replica's connection writes each body chunk straight to the caller's
transport from its `data_received` (no task wake per chunk; the handler waits for the end, an error, the
caller leaving or its transport draining). Eviction and client disconnects both arrive as cancellation of
the handler task: the upstream connection is dropped (never pooled), so the replica aborts the request.
With KV admission on, the body is parsed and its prompt counted before flow control, and the relay counts
streamed tokens (one per `data: {` event) so the ledger's reservation follows the response.
`controller` is the FlowController in one process, or in a relay of `--workers N` the RemoteFlowController
that asks the flow-control process (gateway/remote_flow.py): the same calls, so this is the one relay path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.cache_salt import salted_body
from gateway.classification import ClassificationError, Classifier
from gateway.flow_control import FlowController, Outcome
from gateway.kv_ledger import Reservation
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.request import DropReason, FlowRequest, Status
from gateway.responses import drop_response, error_response, evicted_sse_event
from gateway.tokenization import PromptCounter
from gateway.upstream import ConnectFailed, UpstreamConnection, UpstreamError, UpstreamPool, response_headers
from holdback import tracing
from holdback.contract import (DROP_REASON_HEADER, QUEUE_MS_HEADER, REPLICA_HEADER, REQUEST_ID_HEADER,
                               RESUMABLE_HEADER)

logger = logging.getLogger("gateway.proxy")

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
# Our own request headers are not forwarded (the gateway key is ours, not the replica's).
_NOT_FORWARDED = _HOP_BY_HOP | {"authorization"}
_EVENT = b"data: {"
_FINISHED, _FINISHED_SPACED = b'"finish_reason":"', b'"finish_reason": "'


def _request_id(headers) -> str:
    return headers.get(REQUEST_ID_HEADER) or os.urandom(16).hex()


class Proxy:
    def __init__(self, controller: FlowController, metrics: GatewayMetrics):
        self.controller = controller
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None  # /v1/models and the prompt counter's calls
        self.upstream: UpstreamPool | None = None  # inference requests (gateway/upstream.py)
        self.classifier = Classifier(controller.loaded)
        self.upstream_api_key = controller.loaded.upstream_api_key
        self.counter = self._counter()

    def _counter(self) -> PromptCounter:
        counter = PromptCounter(self.controller.loaded.config.admission, self._count_fallback, self._counted)
        self.controller.tokenizer_state = counter.state
        return counter

    def reconfigure(self) -> None:
        self.classifier = Classifier(self.controller.loaded)
        self.upstream_api_key = self.controller.loaded.upstream_api_key
        self.counter.close()  # its background tokenizer checks stop; the new counter checks again
        self.counter = self._counter()

    def _counted(self, source: str) -> None:
        self.metrics.child(self.metrics.prompt_counts, source).inc()

    def _count_fallback(self) -> None:
        self.controller.tokenizer_fallbacks += 1
        self.metrics.tokenizer_fallbacks.inc()

    async def _count_tokens(self, req: FlowRequest, doc: object, path: str) -> web.Response | None:
        """Fill the request's prompt and output-limit tokens; an answer when the body is not a JSON object."""
        if not isinstance(doc, dict):
            return error_response(400, "The request body must be a JSON object.", "invalid_request_error",
                                  "invalid_json", req.request_id)
        healthy = self.controller.pool.healthy()
        replica = min(healthy, key=lambda r: r.in_flight) if healthy else None
        count = await self.counter.count(doc, path, self.session, replica)
        req.prompt_tokens, req.max_new_tokens = count.prompt_tokens, count.max_new_tokens
        return None

    # -- routes ---------------------------------------------------------------------------------------------
    async def inference(self, request: web.Request) -> web.StreamResponse:
        if not tracing.enabled():
            return await self._inference(request)
        # A server span continuing the caller's `traceparent`; the replica gets this span's (holdback.tracing).
        with tracing.span(f"gateway {request.method} {request.path}", parent=request.headers, kind="server",
                          attributes={"request_id": request.headers.get(REQUEST_ID_HEADER)}) as span:
            response = await self._inference(request)
            span.set_attribute("http.response.status_code", response.status)
            for attribute, header in (("holdback.replica", REPLICA_HEADER),
                                      ("holdback.drop_reason", DROP_REASON_HEADER)):
                if header in response.headers:
                    span.set_attribute(attribute, response.headers[header])
            return response

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        headers = request.headers
        request_id = _request_id(headers)
        try:
            cls = self.classifier.classify(headers)
        except ClassificationError as exc:
            log_event(logger, logging.INFO, "refused", request_id=request_id, status=exc.status, code=exc.code)
            return error_response(exc.status, exc.message, exc.err_type, exc.code, request_id)
        raw = await request.read()
        doc = _document(raw)
        body = salted_body(raw, request.path, cls.cache_salt, doc)
        controller = self.controller
        req = FlowRequest(request_id, cls.objective, cls.priority, cls.fairness_id, cls.tenant, arrived,
                          expires_at=arrived + cls.wait_limit, deadline=arrived + cls.deadline_in,
                          resumable=headers.get(RESUMABLE_HEADER, "").strip() == "1")
        if controller.admission is not None:
            refused = await self._count_tokens(req, doc, request.path)
            if refused is not None:
                return refused
        req.task = asyncio.current_task()
        outcome = controller.submit(req)
        if outcome is Outcome.REJECTED:
            return drop_response(req.drop_reason, request_id, req.drop_message)  # type: ignore[arg-type]
        try:
            if outcome is Outcome.QUEUED:
                outcome = await req.waiter  # type: ignore[misc]
                if outcome is Outcome.REJECTED:
                    return drop_response(req.drop_reason, request_id, req.drop_message)  # type: ignore[arg-type]
            return await self._forward(request, req, body)
        except asyncio.CancelledError:
            if req.status is Status.QUEUED:
                controller.withdraw(req)
                raise
            if req.drop_reason is DropReason.EVICTED and req.status is Status.DISPATCHED:
                # Evicted before the upstream call started: nothing to close.
                _uncancel()
                controller.finish(req)
                return drop_response(DropReason.EVICTED, request_id)
            controller.finish(req, "disconnect", time.monotonic())
            raise

    async def models(self, request: web.Request) -> web.StreamResponse:
        request_id = _request_id(request.headers)
        try:
            self.classifier.caller(request.headers.get("Authorization"))
        except ClassificationError as exc:
            return error_response(exc.status, exc.message, exc.err_type, exc.code, request_id)
        healthy = self.controller.pool.healthy()
        if not healthy:
            return drop_response(DropReason.NO_ENDPOINTS, request_id)
        replica = min(healthy, key=lambda r: r.in_flight)
        assert self.session is not None
        try:
            async with self.session.get(replica.url + request.path_qs,
                                        headers=self._upstream_headers(request, request_id)) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data,
                                    headers=self._response_headers(resp, request_id))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._upstream_failure(replica, exc, request_id)

    # -- forwarding -----------------------------------------------------------------------------------------
    def _upstream_headers(self, request: web.Request, request_id: str) -> CIMultiDict:
        out = CIMultiDict()
        for k, v in request.headers.items():
            if k.lower() not in _NOT_FORWARDED:
                out.add(k, v)
        out[REQUEST_ID_HEADER] = request_id
        tracing.inject(out)
        if self.upstream_api_key:
            out["Authorization"] = f"Bearer {self.upstream_api_key}"
        return out

    @staticmethod
    def _response_headers(resp: aiohttp.ClientResponse, request_id: str) -> CIMultiDict:
        out = CIMultiDict()
        for k, v in resp.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                out.add(k, v)
        out[REQUEST_ID_HEADER] = request_id
        return out

    def _upstream_failure(self, replica, exc: BaseException, request_id: str) -> web.Response:
        self.metrics.child(self.metrics.upstream_errors, replica.url).inc()
        if isinstance(exc, (aiohttp.ClientConnectorError, ConnectFailed)):
            self.controller.pool.mark_down(replica, f"connect: {exc.os_error or exc}")
        log_event(logger, logging.WARNING, "upstream_error", request_id=request_id, replica=replica.url,
                  error=f"{type(exc).__name__}: {exc}")
        return error_response(502, f"The model replica failed: {type(exc).__name__}; retry the request.",
                              "upstream_error", "upstream_error", request_id)

    async def _forward(self, request: web.Request, req: FlowRequest, body: bytes) -> web.StreamResponse:
        replica = req.replica
        pool = self.upstream
        assert pool is not None and replica is not None
        controller = self.controller
        request_id = req.request_id
        conn: UpstreamConnection | None = None
        stream: web.StreamResponse | None = None
        timer: asyncio.TimerHandle | None = None
        try:
            upstream_headers = self._upstream_headers(request, request_id)
            while conn is None:
                try:
                    conn = await pool.open(replica.url)
                except ConnectFailed as exc:
                    # Nothing reached the replica, so another one may take the request (once per replica).
                    failed = self._upstream_failure(replica, exc, request_id)
                    replica = await controller.reassign(req)
                    if replica is None:
                        controller.finish(req)
                        return failed
                except asyncio.TimeoutError as exc:
                    controller.finish(req)
                    return self._upstream_failure(replica, exc, request_id)
            if pool.total_timeout:
                timer = asyncio.get_running_loop().call_later(pool.total_timeout, conn.expire)
            conn.send(request.method, request.path_qs, upstream_headers, body)
            while not conn.status:
                try:
                    await conn.wait()
                except UpstreamError:
                    if not conn.stale():
                        raise
                    # The replica had closed this pooled connection while it was idle and read nothing of the
                    # request: send it once more on a new connection.
                    pool.put(conn)
                    conn = None
                    conn = await pool.open(replica.url, fresh=True)
                    if timer is not None:
                        timer.cancel()
                        timer = asyncio.get_running_loop().call_later(pool.total_timeout, conn.expire)
                    conn.send(request.method, request.path_qs, upstream_headers, body)
            headers = response_headers(conn.headers, _HOP_BY_HOP)
            headers[REQUEST_ID_HEADER] = request_id
            headers[REPLICA_HEADER] = replica.url  # the worker records which replica served each attempt
            if req.enqueued_at:  # it waited in a queue
                headers[QUEUE_MS_HEADER] = f"{(req.dispatched_at - req.arrived) * 1000:.2f}"
            content_type = headers.get("Content-Type", "")
            if not content_type.startswith("text/event-stream") and conn.sized:
                while not conn.complete:
                    await conn.wait()
                data = conn.take()
                self.metrics.child(self.metrics.ttft, req.objective, "false").observe(time.monotonic() - req.arrived)
                controller.finish(req, "end", time.monotonic())
                return web.Response(status=conn.status, body=data, headers=headers)
            stream = web.StreamResponse(status=conn.status, headers=headers)
            conn.streaming = True
            while not conn.pieces and not conn.complete:
                await conn.wait()
            chunk = conn.take()
            if chunk:
                # Only an event stream's first chunk is its first token; a chunked plain answer is end to end.
                streamed = "true" if content_type.startswith("text/event-stream") else "false"
                self.metrics.child(self.metrics.ttft, req.objective, streamed).observe(time.monotonic() - req.arrived)
                await stream.prepare(request)
                controller.started_streaming(req)
                res = req.reservation if isinstance(req.reservation, Reservation) else None
                counter = _TokenCount(controller, req, res).count if res is not None else None
                try:
                    # The first chunk carries the headers; then the connection relays the rest by itself,
                    # waking this task only at the end, on an error, when the caller left or must drain.
                    while chunk:
                        if counter is not None:
                            counter(chunk)
                        await stream.write(chunk)
                        chunk = conn.take()
                    client = request.transport
                    if client is None or client.is_closing():
                        raise ConnectionResetError("the caller closed the connection")
                    conn.relay(client, request.protocol,
                               stream.headers.get("Transfer-Encoding", "").lower() == "chunked", counter)
                    while not conn.complete:
                        await conn.wait()
                        if conn.left:
                            raise ConnectionResetError("the caller closed the connection")
                        if conn.paused:
                            await _drained(request)
                            conn.resume()
                except ConnectionError:  # the caller closed the stream: a cancel, not a replica failure
                    conn.close()
                    controller.finish(req, "cancel", time.monotonic())
                    log_event(logger, logging.INFO, "caller_left_stream", request_id=request_id)
                    return stream
            controller.finish(req, "end", time.monotonic())
            if not stream.prepared:
                await stream.prepare(request)
            # The whole answer was relayed; a caller that left before the final chunk is no error.
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                await stream.write_eof()
            return stream
        except asyncio.CancelledError:
            seen = time.monotonic()
            if conn is not None:
                conn.close()
            if req.drop_reason is not DropReason.EVICTED or req.status is not Status.DISPATCHED:
                # The caller left: the closed upstream frees the replica's slot. Mid-stream it is a cancel.
                controller.finish(req, "cancel" if req.streaming_started else "disconnect", seen)
                raise
            _uncancel()
            controller.finish(req)
            if stream is not None and stream.prepared:
                controller.count_mid_stream_eviction()
                log_event(logger, logging.INFO, "evicted_mid_stream", request_id=request_id)
                with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):  # caller gone
                    await stream.write(evicted_sse_event())
                    await stream.write_eof()
                return stream
            return drop_response(DropReason.EVICTED, request_id)
        except (UpstreamError, OSError) as exc:  # OSError includes asyncio.TimeoutError
            if conn is not None:
                conn.close()
            controller.finish(req, "error", time.monotonic())
            if stream is not None and stream.prepared:
                # Status and part of the body are out; dropping the connection is the only honest signal.
                log_event(logger, logging.WARNING, "stream_broken", request_id=request_id,
                          replica=replica.url, error=f"{type(exc).__name__}: {exc}")
                raise
            return self._upstream_failure(replica, exc, request_id)
        finally:
            if timer is not None:
                timer.cancel()
            if conn is not None:
                pool.put(conn)


class _TokenCount:
    """The KV ledger's view of a relayed stream: one token per `data: {` event, revised only when the
    reservation's blocks change (KvLedger.revision_due) or the generation finished."""

    __slots__ = ("controller", "req", "res", "ledger", "tokens", "due")

    def __init__(self, controller: FlowController, req: FlowRequest, res: Reservation):
        self.controller, self.req, self.res = controller, req, res
        self.ledger = controller.ledger
        self.tokens = 0
        self.due = self.ledger.revision_due(res)

    def count(self, chunk: bytes) -> None:
        self.tokens += chunk.count(_EVENT)
        done = _FINISHED in chunk or _FINISHED_SPACED in chunk
        if done or self.tokens >= self.due:
            self.controller.revise(self.req, self.tokens, done=done)
            self.due = self.ledger.revision_due(self.res)


async def _drained(request: web.Request) -> None:
    """Until the caller's transport is below its low-water mark again (aiohttp's own wait for it)."""
    protocol = request.protocol
    if protocol.writing_paused:
        await protocol._drain_helper()


def _document(body: bytes) -> object:
    """The request body parsed once, for the cache salt and KV admission: {} when empty, None when not JSON."""
    if not body:
        return {}
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _uncancel() -> None:
    """We answered a cancellation ourselves (eviction): later awaits in this task must run normally."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()
