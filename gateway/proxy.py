"""The proxy: classify, pass flow control, forward to the picked replica, relay the answer byte for byte.

Requests go to the replicas over the lean HTTP/1.1 client of gateway/upstream.py (pooled keep-alive
connections driven by an asyncio Protocol). Non-streaming answers are read whole and returned; for event
streams the response headers are sent with the first body chunk, so an eviction before the first token still
gets a clean 429, and after it the replica's connection writes each body chunk straight to the caller's
transport from its `data_received` (no task wake per chunk; the handler waits for the end, an error, the
caller leaving or its transport draining). Eviction and client disconnects both arrive as cancellation of
the handler task: the upstream connection is dropped (never pooled), so the replica aborts the request.
With KV admission on, the body is parsed and its prompt counted before flow control, and the relay counts
streamed tokens (vLLM's running `usage.completion_tokens` when the stream carries it, else one per `data: {`
event) so the ledger's reservation follows the response. Until the first byte of an answer, a replica that
refuses the connection, dies with the request or refuses the gateway's key is taken out and the request moves
to another one (flow control moves its slot and KV reservation); a request that reached a replica which died
is sent once more, no further.
`controller` is any `FlowControl` (gateway/flow/interface.py): the FlowController in one process, or in a relay of
`--workers N` the RemoteFlowController that asks the flow-control process: the same calls, so this is the one
relay path.
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
from gateway.flow.interface import FlowControl, Outcome
from gateway.flow.ledger import Reservation
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.flow.request import DropReason, FlowRequest, Status
from gateway.replicas import UNAUTHORIZED, Replica
from gateway.responses import drop_response, embeddings_not_served, error_response, evicted_sse_event
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
# vLLM's running count in each chunk of a stream asked for `stream_options.continuous_usage_stats`.
_COMPLETION_TOKENS = b'"completion_tokens":'
EMBEDDINGS = "/v1/embeddings"


def _request_id(headers) -> str:
    return headers.get(REQUEST_ID_HEADER) or os.urandom(16).hex()


class Proxy:
    def __init__(self, controller: FlowControl, metrics: GatewayMetrics):
        self.controller = controller
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None  # /v1/models and the prompt counter's calls
        self.upstream: UpstreamPool | None = None  # inference requests (gateway/upstream.py)
        self.classifier = Classifier(controller.loaded)
        self.counter = self._counter()

    def _counter(self) -> PromptCounter:
        counter = PromptCounter(self.controller.loaded.config.admission, self._count_fallback, self._counted)
        self.controller.tokenizer_state = counter.state
        return counter

    def reconfigure(self) -> None:
        self.classifier = Classifier(self.controller.loaded)
        self.counter.close()  # its background tokenizer checks stop; the new counter checks again
        self.counter = self._counter()

    def _counted(self, source: str) -> None:
        self.metrics.child(self.metrics.prompt_counts, source).inc()

    def _count_fallback(self) -> None:
        self.controller.count_tokenizer_fallback()
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
        req.limit_param, req.sequences = count.limit_param, count.sequences
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
            log_event(logger, "refused", request_id=request_id, status=exc.status, code=exc.code)
            return error_response(exc.status, exc.message, exc.err_type, exc.code, request_id)
        controller = self.controller
        if request.path == EMBEDDINGS:
            healthy = controller.pool.healthy()
            if healthy and all(r.serves_no_embeddings() for r in healthy):
                return embeddings_not_served(healthy[0], request_id)
        raw = await request.read()
        doc = _document(raw)
        body = salted_body(raw, request.path, cls.cache_salt, doc)
        req = FlowRequest(request_id, cls.objective, cls.priority, cls.fairness_id, cls.tenant, arrived,
                          expires_at=arrived + cls.wait_limit, deadline=arrived + cls.deadline_in,
                          resumable=headers.get(RESUMABLE_HEADER, "").strip() == "1")
        if controller.admission_enabled:
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
                                        headers=self._upstream_headers(request, request_id, replica.url)) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data,
                                    headers=self._response_headers(resp, request_id))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._upstream_failure(replica, exc, request_id)

    # -- forwarding -----------------------------------------------------------------------------------------
    def _upstream_headers(self, request: web.Request, request_id: str, replica_url: str) -> CIMultiDict:
        out = CIMultiDict()
        for k, v in request.headers.items():
            if k.lower() not in _NOT_FORWARDED:
                out.add(k, v)
        out[REQUEST_ID_HEADER] = request_id
        tracing.inject(out)
        key = self.controller.loaded.replica_key(replica_url)
        if key:
            out["Authorization"] = f"Bearer {key}"
        return out

    @staticmethod
    def _response_headers(resp: aiohttp.ClientResponse, request_id: str) -> CIMultiDict:
        out = CIMultiDict()
        for k, v in resp.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                out.add(k, v)
        out[REQUEST_ID_HEADER] = request_id
        return out

    def _upstream_failure(self, replica, exc: BaseException, request_id: str, down: bool = False) -> web.Response:
        """Count and log a transport failure; take the replica out when its port refused the connection or
        (`down`) it closed a new connection before answering."""
        self.metrics.child(self.metrics.upstream_errors, replica.url).inc()
        if isinstance(exc, (aiohttp.ClientConnectorError, ConnectFailed)):
            self.controller.pool.mark_down(replica, f"connect: {exc.os_error or exc}")
        elif down:
            self.controller.pool.mark_down(replica, f"closed before answering: {exc}")
        log_event(logger, "upstream_error", level=logging.WARNING, request_id=request_id, replica=replica.url,
                  error=f"{type(exc).__name__}: {exc}")
        return error_response(502, f"The model replica failed: {type(exc).__name__}; retry the request.",
                              "upstream_error", "upstream_error", request_id)

    async def _move(self, req: FlowRequest, reason: str, failed: web.Response) -> web.Response | None:
        """Nothing of the answer has reached the caller and its replica is out: flow control hands the request to
        another healthy replica with room, moving its slot and KV reservation; `failed` is the answer (finished)
        when none is left."""
        old: Replica = req.replica  # type: ignore[assignment]
        replica = await self.controller.reassign(req)
        if replica is None:
            self.controller.finish(req, "error", time.monotonic())
            return failed
        self.metrics.child(self.metrics.upstream_moves, reason).inc()
        log_event(logger, "upstream_moved", request_id=req.request_id, replica=old.url,
                  to=replica.url, reason=reason)
        return None

    async def _exchange(self, request: web.Request, req: FlowRequest, body: bytes) -> UpstreamConnection | web.Response:
        """Send the request to its replica until the response headers are in: the connection, or the answer when
        no replica could take it (the request is finished then). Until the first byte of an answer, a failed
        replica is taken out and the request moves on (`_move`); a request that reached a replica which died is
        sent once more, no further. Raises the exchange's error (timeout, bad HTTP) with the connection closed."""
        pool = self.upstream
        assert pool is not None
        conn: UpstreamConnection | None = None
        fresh = False  # the next connection is a new one (the pooled one was closed while idle)
        resent = False
        try:
            while True:
                replica: Replica = req.replica  # type: ignore[assignment]
                try:
                    conn = await pool.open(replica.url, fresh=fresh)
                except ConnectFailed as exc:
                    # Nothing reached the replica, so another one may take the request.
                    failed = await self._move(req, "connect", self._upstream_failure(replica, exc, req.request_id))
                    if failed is not None:
                        return failed
                    fresh = False
                    continue
                except asyncio.TimeoutError as exc:
                    self.controller.finish(req, "error", time.monotonic())
                    return self._upstream_failure(replica, exc, req.request_id)
                conn.send(request.method, request.path_qs,
                          self._upstream_headers(request, req.request_id, replica.url), body)
                try:
                    while not conn.status:
                        await conn.wait()
                except UpstreamError as exc:
                    if not conn.unanswered():
                        raise
                    stale = conn.stale()
                    pool.put(conn)
                    conn = None
                    fresh = stale
                    if stale:
                        # The replica had closed this pooled connection while it was idle and read nothing of
                        # the request: send it once more on a new connection.
                        continue
                    # A new connection closed before one byte of an answer: the replica died with the request.
                    failed = self._upstream_failure(replica, exc, req.request_id, down=True)
                    if resent:
                        self.controller.finish(req, "error", time.monotonic())
                        return failed
                    resent = True
                    failed = await self._move(req, "closed", failed)
                    if failed is not None:
                        return failed
                    continue
                if conn.status not in UNAUTHORIZED:
                    return conn
                # The caller's key is never forwarded: the replica refuses the gateway's own.
                status = conn.status
                self.controller.pool.mark_unauthorized(replica, request.path, status)
                conn.close()
                pool.put(conn)
                conn = None
                self.metrics.child(self.metrics.upstream_errors, replica.url).inc()
                failed = await self._move(req, "unauthorized", error_response(
                    502, f"The model replica refused the gateway's own key (HTTP {status}); the gateway's operator "
                    "must set upstream.apiKey (or upstream.replicaKeys) to the replicas' --api-key.",
                    "upstream_error", "upstream_unauthorized", req.request_id))
                if failed is not None:
                    return failed
                fresh = False
        except BaseException:
            if conn is not None:  # cancelled (eviction, the caller left) or failed: never pooled
                conn.close()
                pool.put(conn)
            raise

    async def _forward(self, request: web.Request, req: FlowRequest, body: bytes) -> web.StreamResponse:
        pool = self.upstream
        assert pool is not None and req.replica is not None
        controller = self.controller
        request_id = req.request_id
        conn: UpstreamConnection | None = None
        stream: web.StreamResponse | None = None
        try:
            exchanged = await self._exchange(request, req, body)
            if isinstance(exchanged, web.Response):
                return exchanged
            conn = exchanged
            replica: Replica = req.replica  # type: ignore[assignment]
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
                if conn.status == 404 and request.path == EMBEDDINGS and _route_not_found(data):
                    # FastAPI's own 404: the replica has no /v1/embeddings route (a generation model).
                    if not replica.serves_no_embeddings():
                        log_event(logger, "replica_serves_no_embeddings", level=logging.WARNING, replica=replica.url,
                                  model=replica.model, hint="point /v1/embeddings at replicas started with an "
                                  "embedding model")
                    replica.no_embeddings_model = replica.model or ""
                    return embeddings_not_served(replica, request_id)
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
                    log_event(logger, "caller_left_stream", request_id=request_id)
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
                log_event(logger, "evicted_mid_stream", request_id=request_id)
                with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):  # caller gone
                    await stream.write(evicted_sse_event())
                    await stream.write_eof()
                return stream
            return drop_response(DropReason.EVICTED, request_id)
        except (UpstreamError, OSError) as exc:  # OSError includes asyncio.TimeoutError
            if conn is not None:
                conn.close()
            controller.finish(req, "error", time.monotonic())
            failed: Replica = req.replica  # type: ignore[assignment]
            if stream is not None and stream.prepared:
                # Status and part of the body are out; dropping the connection is the only honest signal.
                log_event(logger, "stream_broken", level=logging.WARNING, request_id=request_id,
                          replica=failed.url, error=f"{type(exc).__name__}: {exc}")
                raise
            return self._upstream_failure(failed, exc, request_id)
        finally:
            if conn is not None:
                pool.put(conn)


class _TokenCount:
    """The KV ledger's view of a relayed stream, revised only when the reservation's blocks change
    (KvLedger.revision_due) or the generation finished. The tokens are vLLM's own running count when the stream
    carries one (`usage.completion_tokens` in every chunk: several tokens may come in one event, and a token
    whose bytes are not yet a whole character comes as an empty one), else one per `data: {` event."""

    __slots__ = ("controller", "req", "res", "ledger", "tokens", "due", "usage")

    def __init__(self, controller: FlowControl, req: FlowRequest, res: Reservation):
        self.controller, self.req, self.res = controller, req, res
        self.ledger = controller.ledger
        self.tokens = 0
        self.due = self.ledger.revision_due(res)
        self.usage = False  # the stream carries usage: events are not counted any more

    def count(self, chunk: bytes) -> None:
        reported = _completion_tokens(chunk)
        if reported is not None:
            self.usage = True
            self.tokens = max(self.tokens, reported)
        elif not self.usage:
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


def _completion_tokens(chunk: bytes) -> int | None:
    """The last `"completion_tokens": N` in `chunk` (None when there is none, or its digits are cut off)."""
    at = chunk.rfind(_COMPLETION_TOKENS)
    if at < 0:
        return None
    start = at + len(_COMPLETION_TOKENS)
    while start < len(chunk) and chunk[start] == 0x20:
        start += 1
    end = start
    while end < len(chunk) and 0x30 <= chunk[end] <= 0x39:
        end += 1
    if end == start or end == len(chunk):  # no digits, or the number may go on in the next chunk
        return None
    return int(chunk[start:end])


def _route_not_found(body: bytes) -> bool:
    """FastAPI's answer for a path it has no route for, `{"detail":"Not Found"}` (vLLM's own 404s, such as an
    unknown model, are OpenAI error envelopes)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("detail") == "Not Found" and "error" not in doc


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
