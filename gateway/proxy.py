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
event, gateway/stream_tokens.py) so the ledger's reservation follows the response. Until the first byte of an
answer, a replica that refuses the connection, dies with the request or refuses the gateway's key is taken out
and the request moves to another one (gateway/failover.py). However a forwarded request ends, `_forward` tells
flow control once, the moment it ended, before the rest of the answer (an eof, the evicted event) goes out.
`controller` is any `FlowControl` (gateway/flow/interface.py): the FlowController in one process, or in a relay of
`--workers N` the RemoteFlowController that asks the flow-control process: the same calls, so this is the one
relay path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.bodies import document, responses_as_chat, route_not_found
from gateway.cache_salt import salted_body
from gateway.classification import ClassificationError, Classifier
from gateway.failover import Failover
from gateway.flow.cached_first import request_prefix
from gateway.flow.interface import FlowControl, FlowPools, Outcome
from gateway.flow.request import Ask, DropReason, End, FlowRequest, Status
from gateway.forwarded_headers import HOP_BY_HOP, to_caller, to_replica
from gateway.forwarding import Forwarding
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.responses import (drop_response, embeddings_not_served, endpoint_not_served, error_response,
                               evicted_message, evicted_sse_event, model_not_found, models_union)
from gateway.responses_stream import RelayedResponseEvents
from gateway.stored_responses import StoredResponses, Turn
from gateway.stream_tokens import StreamTokenCount
from gateway.tokenization import PromptCounter
from gateway.upstream import ConnectFailed, UpstreamError, UpstreamPool, response_headers
from holdback import tracing
from holdback.contract import (CHAT_ENDPOINT, DROP_REASON_HEADER, EMBEDDINGS_ENDPOINT, QUEUE_MS_HEADER,
                               REPLICA_HEADER, REQUEST_ID_HEADER, RESPONSES_ENDPOINT, RESUMABLE_HEADER,
                               InferenceEndpoint, inference_endpoint)

logger = logging.getLogger("gateway.proxy")


def _request_id(headers) -> str:
    return headers.get(REQUEST_ID_HEADER) or os.urandom(16).hex()


class Proxy:
    def __init__(self, pools: FlowPools, metrics: GatewayMetrics):
        # Each request goes to the flow control of its model's pool.
        self.pools = pools
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None  # /v1/models and the prompt counter's calls
        self.upstream: UpstreamPool | None = None  # inference requests (gateway/upstream.py)
        self.classifier = Classifier(pools.loaded)
        self.counter = self._counter()
        self.failover = Failover(metrics, self._upstream_headers, self._upstream_failure)
        self.stored = StoredResponses(pools, lambda: self.session, lambda: self.classifier)
        # The inference requests this process's handlers hold now, by id (drain.py `refuse_unanswered`).
        self.handling: dict[int, FlowRequest] = {}

    def _counter(self) -> PromptCounter:
        counter = PromptCounter(self.pools.loaded.config.admission, self._count_fallback, self._counted)
        self.pools.tokenizer_state = counter.state
        return counter

    def reconfigure(self) -> None:
        self.classifier = Classifier(self.pools.loaded)
        self.counter.close()  # its background tokenizer checks stop; the new counter checks again
        self.counter = self._counter()
        self.stored.reconfigure()

    def _counted(self, source: str) -> None:
        self.metrics.child(self.metrics.prompt_counts, source).inc()

    def _count_fallback(self) -> None:
        self.pools.flows()[0].count_tokenizer_fallback()
        self.metrics.tokenizer_fallbacks.inc()

    async def _count_tokens(self, flow: FlowControl, ask: Ask, doc: object,
                            endpoint: InferenceEndpoint) -> Ask | web.Response:
        """The ask with its prompt and output-limit tokens counted (on a replica of its pool: its model's
        tokenizer); an answer when the body is not a JSON object."""
        if not isinstance(doc, dict):
            return error_response(400, "The request body must be a JSON object.", "invalid_request_error",
                                  "invalid_json", ask.request_id)
        healthy = flow.pool.healthy()
        replica = min(healthy, key=lambda r: r.in_flight) if healthy else None
        counted_doc, counted_path = responses_as_chat(doc) if endpoint.rendered_as_chat else (doc, endpoint.path)
        count = await self.counter.count(counted_doc, counted_path, self.session, replica)
        limit_param = count.limit_param
        if endpoint.rendered_as_chat and limit_param is not None:
            limit_param = endpoint.limit_params[0]  # the body's own field, as the answer to a refusal names it
        return dataclasses.replace(ask, prompt_tokens=count.prompt_tokens, max_new_tokens=count.max_new_tokens,
                                   limit_param=limit_param, sequences=count.sequences, prompt_exact=count.exact)

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
        raw = await request.read()
        doc = document(raw)
        endpoint = inference_endpoint(request.path) or CHAT_ENDPOINT  # only inference paths are routed here
        routing = self.pools.routing()
        model = doc.get("model") if isinstance(doc, dict) else None
        pool = routing.route(model)
        if pool is None:  # answered here, as vLLM answers a name it does not serve: no replica is asked
            return model_not_found(model, routing.served(), request_id)
        controller = self.pools.flow(pool)
        endpoints = routing.endpoints(pool)
        if endpoints is not None and request.path not in endpoints:
            if not endpoint.generates:
                return embeddings_not_served(None, request_id, pool)
            return endpoint_not_served(request.path, pool, endpoints, request_id)
        if not endpoint.generates:
            healthy = controller.pool.healthy()
            if healthy and all(r.serves_no_embeddings() for r in healthy):
                return embeddings_not_served(healthy[0], request_id)
        body = salted_body(raw, request.path, cls.cache_salt, doc)
        turn = None
        if endpoint is RESPONSES_ENDPOINT:  # named, pinned to the replica storing what it continues, or answered
            turn = await self.stored.arrive(doc, body, cls.tenant, controller, request_id)
            if isinstance(turn, web.Response):
                return turn
            body = turn.body
        prefix, share = request_prefix(controller.loaded.config, cls.priority, doc, request.path, cls.cache_salt)
        ask = Ask(request_id=request_id, objective=cls.objective, priority=cls.priority,
                  fairness_id=cls.fairness_id, tenant=cls.tenant, arrived=arrived, pool=pool,
                  expires_at=arrived + cls.wait_limit, deadline=arrived + cls.deadline_in,
                  resumable=headers.get(RESUMABLE_HEADER, "").strip() == "1",
                  streamed=isinstance(doc, dict) and doc.get("stream") is True,
                  at_risk=cls.at_risk and cls.priority < 0, home=turn.home if turn is not None else None,
                  prefix=prefix, prefix_share=share)
        if controller.admission_enabled:
            counted = await self._count_tokens(controller, ask, doc, endpoint)
            if isinstance(counted, web.Response):
                return counted
            ask = counted
        req = FlowRequest(ask)
        req.task = asyncio.current_task()
        self.handling[id(req)] = req
        try:
            return await self._decided(request, controller, req, body, turn)
        finally:
            del self.handling[id(req)]

    async def _decided(self, request: web.Request, controller: FlowControl, req: FlowRequest, body: bytes,
                       turn: Turn | None) -> web.StreamResponse:
        outcome = controller.submit(req)
        try:
            if outcome is Outcome.QUEUED and req.waiter is not None:
                outcome = await req.waiter
        except asyncio.CancelledError as exc:
            if req.status is Status.QUEUED:  # the caller left while it waited: nothing was dispatched
                controller.withdraw(req)
                raise
            # Decided meanwhile (dispatched, maybe evicted already): nothing sent yet, it ends as any cancel does.
            return await self._forward(request, controller, req, body, turn, cancelled=exc)
        if outcome is Outcome.REJECTED:
            return drop_response(req.drop_reason or DropReason.SATURATED, req.request_id, req.drop_message)
        return await self._forward(request, controller, req, body, turn)

    async def models(self, request: web.Request) -> web.StreamResponse:
        request_id = _request_id(request.headers)
        try:
            self.classifier.caller(request.headers.get("Authorization"))
        except ClassificationError as exc:
            return error_response(exc.status, exc.message, exc.err_type, exc.code, request_id)
        # One replica of each pool that has a healthy one; with one pool its answer is relayed as it is.
        asked = [min(healthy, key=lambda r: r.in_flight) for healthy in
                 (flow.pool.healthy() for flow in self.pools.flows()) if healthy]
        if not asked:
            return drop_response(DropReason.NO_ENDPOINTS, request_id)
        assert self.session is not None
        answers = []
        for replica in asked:
            try:
                async with self.session.get(replica.url + request.path_qs,
                                            headers=self._upstream_headers(request, request_id, replica.url)) as resp:
                    answers.append((resp.status, await resp.read(), to_caller(resp.headers.items(), request_id)))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                if len(asked) == 1:
                    return self._upstream_failure(replica, exc, request_id)
                self._upstream_failure(replica, exc, request_id)
        if len(asked) == 1:
            status, data, headers = answers[0]
            return web.Response(status=status, body=data, headers=headers)
        return models_union(answers, request_id)

    # -- forwarding -----------------------------------------------------------------------------------------
    def _upstream_headers(self, request: web.Request, request_id: str, replica_url: str) -> CIMultiDict:
        return to_replica(request.headers.items(), request_id, self.pools.loaded.replica_key(replica_url))

    def _upstream_failure(self, replica, exc: BaseException, request_id: str, down: bool = False) -> web.Response:
        """Count and log a transport failure; take the replica out when its port refused the connection or
        (`down`) it closed a new connection before answering."""
        self.metrics.child(self.metrics.upstream_errors, replica.url).inc()
        if isinstance(exc, (aiohttp.ClientConnectorError, ConnectFailed)):
            self.pools.replicas.mark_down(replica, f"connect: {exc.os_error or exc}")
        elif down:
            self.pools.replicas.mark_down(replica, f"closed before answering: {exc}")
        log_event(logger, "upstream_error", level=logging.WARNING, request_id=request_id, replica=replica.url,
                  error=f"{type(exc).__name__}: {exc}")
        return error_response(502, f"The model replica failed: {type(exc).__name__}; retry the request.",
                              "upstream_error", "upstream_error", request_id)

    # -- forwarding: the answer, and the one place a request is finished -------------------------------------
    async def _forward(self, request: web.Request, flow: FlowControl, req: FlowRequest, body: bytes,
                       turn: Turn | None = None, cancelled: asyncio.CancelledError | None = None
                       ) -> web.StreamResponse:
        """Send a dispatched request to its replica and relay the answer (`_relay`). Each step records how the
        request ended; flow control is told here, once, the moment it ended, and then the rest of the answer
        goes out (`_conclude`): the end of a stream, the evicted answer, or the failure. `cancelled`: the handler
        was cancelled (evicted, or the caller left) before anything was sent."""
        fw = Forwarding(request, flow, req, turn)
        try:
            try:
                if cancelled is not None:
                    raise cancelled
                await self._relay(fw, body)
            except asyncio.CancelledError as exc:
                self._cancelled(fw, exc)
            except (UpstreamError, OSError) as exc:  # OSError includes asyncio.TimeoutError
                fw.close_upstream()
                fw.ended(End.ERROR, time.monotonic(), error=exc)
            # A background response goes on after its answer: finished when its replica reports it ended.
            if not self.stored.hold(turn, flow, req, fw.cause, fw.conn.status if fw.conn is not None else 0):
                flow.finish(req, fw.cause, fw.at)
            return await self._conclude(fw)
        finally:
            if fw.conn is not None:
                self.upstream.put(fw.conn)  # type: ignore[union-attr]

    async def _relay(self, fw: Forwarding, body: bytes) -> None:
        """The exchange, then the answer: read whole when sized and not an event stream, else relayed."""
        request, req = fw.request, fw.req
        exchanged = await self.failover.exchange(self.upstream, fw.flow, request, req, body)  # type: ignore[arg-type]
        if isinstance(exchanged, web.Response):  # no replica could take it
            fw.ended(End.ERROR, time.monotonic(), answer=exchanged)
            return
        fw.conn = conn = exchanged
        replica = req.leased().replica
        self.stored.answered(fw.turn, replica.url, conn.status, req.tenant)
        headers = response_headers(conn.headers, HOP_BY_HOP)
        headers[REQUEST_ID_HEADER] = req.request_id
        headers[REPLICA_HEADER] = replica.url  # the worker records which replica served each attempt
        if req.enqueued_at:  # it waited in a queue
            headers[QUEUE_MS_HEADER] = f"{(req.dispatched_at - req.arrived) * 1000:.2f}"
        event_stream = headers.get("Content-Type", "").startswith("text/event-stream")
        if not event_stream and conn.sized:
            await self._read_whole(fw, headers)
        else:
            await self._relay_stream(fw, headers, event_stream)

    async def _read_whole(self, fw: Forwarding, headers: CIMultiDict) -> None:
        conn, req = fw.conn, fw.req
        assert conn is not None
        while not conn.complete:
            await conn.wait()
        data = conn.take()
        self.metrics.child(self.metrics.ttft, req.pool, req.objective, "false").observe(
            time.monotonic() - req.arrived)
        fw.ended(End.END, time.monotonic())
        replica = req.leased().replica
        if conn.status == 404 and fw.request.path == EMBEDDINGS_ENDPOINT.path and route_not_found(data):
            # FastAPI's own 404: the replica has no /v1/embeddings route (a generation model).
            if not replica.serves_no_embeddings():
                log_event(logger, "replica_serves_no_embeddings", level=logging.WARNING, replica=replica.url,
                          model=replica.model, hint="point /v1/embeddings at replicas started with an "
                          "embedding model")
            replica.no_embeddings_model = replica.model or ""
            fw.answer = embeddings_not_served(replica, req.request_id)
        else:
            fw.answer = web.Response(status=conn.status, body=data, headers=headers)

    async def _relay_stream(self, fw: Forwarding, headers: CIMultiDict, event_stream: bool) -> None:
        """Headers go out with the first body chunk (an eviction before it is still a clean 429); then the
        connection relays the rest by itself."""
        request, req, conn = fw.request, fw.req, fw.conn
        assert conn is not None
        fw.stream = stream = web.StreamResponse(status=conn.status, headers=headers)
        if event_stream and fw.turn is not None:  # a Responses stream: read, so an eviction can end it in kind
            fw.events = RelayedResponseEvents(fw.turn.response_id)
        conn.streaming = True
        while not conn.pieces and not conn.complete:
            await conn.wait()
        chunk = conn.take()
        if chunk:
            # Only an event stream's first chunk is its first token; a chunked plain answer is end to end.
            self.metrics.child(self.metrics.ttft, req.pool, req.objective,
                               "true" if event_stream else "false").observe(time.monotonic() - req.arrived)
            await stream.prepare(request)
            fw.flow.started_streaming(req)
            try:
                await self._relay_body(fw, chunk)
            except ConnectionError:  # the caller closed the stream: a cancel, not a replica failure
                conn.close()
                fw.ended(End.CANCEL, time.monotonic(), answer=stream)
                log_event(logger, "caller_left_stream", request_id=req.request_id)
                return
        fw.ended(End.END, time.monotonic())

    async def _relay_body(self, fw: Forwarding, chunk: bytes) -> None:
        """The first chunk carries the headers; then the connection relays the rest by itself, waking this task
        only at the end, on an error, when the caller left or must drain."""
        request, req, conn, stream = fw.request, fw.req, fw.conn, fw.stream
        assert conn is not None and stream is not None
        res = req.reservation
        counter = StreamTokenCount(fw.flow, req, res).count if res is not None else None
        if fw.events is not None:
            counter = fw.events.tap(counter)
        while chunk:
            if counter is not None:
                counter(chunk)
            await stream.write(chunk)
            chunk = conn.take()
        client = request.transport
        if client is None or client.is_closing():
            raise ConnectionResetError("the caller closed the connection")
        conn.relay(client, request.protocol, stream.headers.get("Transfer-Encoding", "").lower() == "chunked",
                   counter)
        while not conn.complete:
            await conn.wait()
            if conn.left:
                raise ConnectionResetError("the caller closed the connection")
            if conn.paused:
                await _drained(request)
                conn.resume()

    def _cancelled(self, fw: Forwarding, exc: asyncio.CancelledError) -> None:
        """The handler was cancelled: the request was evicted, or its caller left."""
        seen = time.monotonic()
        fw.close_upstream()
        req = fw.req
        if req.drop_reason is DropReason.SHUTTING_DOWN and req.status is Status.DISPATCHED \
                and not (fw.stream is not None and fw.stream.prepared):
            _uncancel()  # refused at the drain deadline before its answer began (drain.py): we answer
            fw.ended(End.DISCONNECT, seen, answer=drop_response(DropReason.SHUTTING_DOWN, req.request_id))
            log_event(logger, "refused_at_drain_deadline", request_id=req.request_id, band=req.priority)
            return
        if req.drop_reason is not DropReason.EVICTED or req.status is not Status.DISPATCHED:
            # The caller left: the closed upstream frees the replica's slot. Mid-stream it is a cancel.
            fw.ended(End.CANCEL if req.streaming_started else End.DISCONNECT, seen, error=exc)
            log_event(logger, "caller_left", request_id=req.request_id, band=req.priority,
                      answered=req.streaming_started)
            return
        _uncancel()  # we answer the eviction ourselves
        fw.evicted = True
        fw.ended(End.EVICT, None)  # flow control times an eviction from its decision

    async def _conclude(self, fw: Forwarding) -> web.StreamResponse:
        """Flow control knows the request ended: finish the answer, or end the handler with the error."""
        if fw.evicted:
            return await self._evicted(fw)
        if isinstance(fw.error, asyncio.CancelledError):
            raise fw.error
        if fw.error is not None:
            return self._broken(fw, fw.error)
        if fw.answer is not None:
            return fw.answer
        stream = fw.stream  # relayed whole
        assert stream is not None
        try:
            if not stream.prepared:
                await stream.prepare(fw.request)
            # The whole answer was relayed; a caller that left before the final chunk is no error.
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                await stream.write_eof()
        except asyncio.CancelledError:
            fw.close_upstream()
            raise
        except (UpstreamError, OSError) as exc:
            fw.close_upstream()
            return self._broken(fw, exc)
        return stream

    async def _evicted(self, fw: Forwarding) -> web.StreamResponse:
        """429 `evicted` while nothing went out; mid-stream, the SSE evicted event ends the stream (a Responses
        stream: the Responses API's `error` and `response.failed`, gateway/responses_stream.py)."""
        stream = fw.stream
        if stream is not None and stream.prepared:
            fw.flow.count_mid_stream_eviction()
            log_event(logger, "evicted_mid_stream", request_id=fw.req.request_id)
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):  # caller gone
                await stream.write(evicted_sse_event() if fw.events is None else
                                   fw.events.failed(DropReason.EVICTED.value, evicted_message()))
                await stream.write_eof()
            return stream
        return drop_response(DropReason.EVICTED, fw.req.request_id)

    def _broken(self, fw: Forwarding, exc: BaseException) -> web.Response:
        """The exchange failed: 502 while nothing went out; after the status and part of the body, dropping the
        connection is the only honest signal."""
        failed = fw.req.leased().replica
        if fw.stream is not None and fw.stream.prepared:
            log_event(logger, "stream_broken", level=logging.WARNING, request_id=fw.req.request_id,
                      replica=failed.url, error=f"{type(exc).__name__}: {exc}")
            raise exc
        return self._upstream_failure(failed, exc, fw.req.request_id)


async def _drained(request: web.Request) -> None:
    """Until the caller's transport is below its low-water mark again (aiohttp's own wait for it)."""
    protocol = request.protocol
    if protocol.writing_paused:
        await protocol._drain_helper()


def _uncancel() -> None:
    """We answered a cancellation ourselves (eviction): later awaits in this task must run normally."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()
