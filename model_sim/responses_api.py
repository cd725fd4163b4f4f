"""vLLM's Responses API in the simulator: POST /v1/responses and, with the store on, the stored responses.

With `responses_store` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1) every answer with `store` (true unless the body
says false) is kept in this replica's memory, as vLLM keeps it: GET /v1/responses/{id} returns it,
`previous_response_id` continues its conversation (its input and output come before the new input), and
`background: true` answers at once with status `queued` while the generation runs on, then stores the final
answer; POST /v1/responses/{id}/cancel cancels a background response that has not ended. Unknown ids are
vLLM's 404 (`Response with id '...' not found.`, param `response_id`); DELETE is FastAPI's 405 (vLLM has no
DELETE route; the server's error middleware answers it). Without the store, `store` is ignored and `background` is refused as vLLM refuses it.
`stream: true` answers with vLLM 0.32's events (model_sim/responses_events.py); the store keeps the final answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from holdback.sim_tokenizer import ChatTemplateError, render_chat, responses_messages
from model_sim import answers, protocol
from holdback.logs import log_event
from model_sim.errors import EnvelopeError, InvalidRequest, json_response
from model_sim.generation import output_text, output_token_text
from model_sim.responses_events import ResponseEventStream

if TYPE_CHECKING:
    from model_sim.engine import RequestStream

# What a cancel may still stop (vLLM's `cancel_responses`); a stored background response reads `queued` until
# it ends (vLLM 0.32 never writes `in_progress` there).
_CANCELLABLE = ("queued", "in_progress")


log = logging.getLogger("model_sim.responses")


def not_found(response_id: str) -> EnvelopeError:
    return EnvelopeError(404, f"Response with id '{response_id}' not found.", "response_id", "invalid_request_error")


@dataclass
class StoredResponse:
    body: dict
    # The conversation so far (its input and its output), which a `previous_response_id` continues.
    messages: list[dict]
    task: asyncio.Task | None = None
    streams: list[RequestStream] | None = None


class ResponsesApi:
    """The /v1/responses routes of one replica. `start(request, params, prompt_ids)` adds the generation to the
    engine and returns its streams; `finished(streams)` waits for them (raising the error answer);
    `abort(streams)` stops what is unfinished."""

    def __init__(self, config, tokenizer, start: Callable, finished: Callable, abort: Callable):
        self.model = config.model
        self.max_model_len = config.engine.max_model_len
        self.store_enabled = config.responses_store
        self.tokenizer = tokenizer
        self._start, self._finished, self._abort = start, finished, abort
        self.store: dict[str, StoredResponse] = {}

    def add_routes(self, app: web.Application, create) -> None:  # noqa: ANN001 - the wrapped create handler
        app.router.add_post("/v1/responses", create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        app.on_cleanup.append(self._close)

    # -- POST /v1/responses ---------------------------------------------------------------------------------
    async def create(self, request: web.Request, body: dict, priority_header: str | None) -> web.Response:
        params = protocol.parse_responses(body, priority_header=priority_header)
        store = body.get("store", True) is not False and self.store_enabled
        background = body.get("background") is True
        if background and params.stream:
            raise InvalidRequest("The simulator does not stream a background response (vLLM does); send "
                                 "\"stream\": false with \"background\": true, and GET the response for its end.",
                                 "stream")
        if background and body.get("store", True) is False:
            raise EnvelopeError(400, "background can only be used when `store` is true (parameter=background)",
                                "background", "BadRequestError")
        if background and not self.store_enabled:
            raise EnvelopeError(400, "This vLLM engine does not support `store=True` and therefore does not support "
                                "the background mode. To enable these features, set the environment variable "
                                "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                                "background", "invalid_request_error")
        messages = self._messages(body)
        try:
            prompt = render_chat(messages)
        except ChatTemplateError as exc:
            raise InvalidRequest(exc.message, exc.param) from None
        prompt_ids = protocol.truncated(self.tokenizer.encode(prompt), body, self.max_model_len)
        protocol.check_model(body, self.model)
        streams = self._start(request, params, prompt_ids)
        created = int(time.time())
        # vLLM's ids: the body's `request_id` when it sends one, else resp_ and msg_ with 16 random hex digits.
        response_id = body.get("request_id") if isinstance(body.get("request_id"), str) else \
            f"resp_{uuid.uuid4().hex[:16]}"
        message_id = f"msg_{uuid.uuid4().hex[:16]}"
        if background:
            queued = answers.responses_unfinished(response_id, created, self.model, body, params, "queued")
            stored = StoredResponse(queued, messages, streams=streams)
            self.store[response_id] = stored
            stored.task = asyncio.create_task(self._run_background(stored, body, params, created))
            return json_response(queued)
        if params.stream:
            return await self._stream(request, streams, (response_id, message_id, created), body, params,
                                      messages if store else None)
        try:
            await self._finished(streams)
            answer = self._answer(streams, response_id, message_id, created, body, params)
        finally:
            self._abort(streams)
        if store:
            self.store[response_id] = StoredResponse(answer, self._conversation(messages, answer))
        return json_response(answer)

    def _messages(self, body: dict) -> list[dict]:
        """The chat this request renders: the stored conversation it continues, then its own input."""
        previous: list[dict] = []
        previous_id = body.get("previous_response_id")
        if previous_id is not None:
            stored = self.store.get(previous_id) if self.store_enabled else None
            if stored is None:
                raise not_found(str(previous_id))
            previous = stored.messages
        try:
            return [*previous, *responses_messages(body)]
        except ChatTemplateError as exc:
            raise InvalidRequest(exc.message, exc.param) from None

    def _answer(self, streams: list[RequestStream], response_id: str, message_id: str, created: int, body: dict,
                params) -> dict:
        req = streams[0].request
        return answers.responses_body(
            response_id, message_id, created, self.model, body, params,
            output_text(0, req.num_output_tokens), req.status.finish_reason, req.num_prompt_tokens,
            req.num_output_tokens, max(req.num_cached_tokens, 0))

    async def _stream(self, request: web.Request, streams: list[RequestStream], ids: tuple[str, str, int],
                      body: dict, params, messages: list[dict] | None) -> web.StreamResponse:
        """The answer as vLLM streams it: one delta event per output token; `messages` (the store on): the final
        answer is stored. An engine failure cuts the connection without a last event, as vLLM's does (its
        error is no Responses event, so writing it fails and the server drops the unfinished body)."""
        response_id, message_id, created = ids
        req = streams[0].request
        events = ResponseEventStream(message_id)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            await resp.prepare(request)
            started = answers.responses_unfinished(response_id, created, self.model, body, params, "in_progress")
            out = [events.opening(started)]
            sent = 0
            while req.error is None:
                made = req.num_output_tokens
                if made > sent and not sent:
                    out.append(events.message_opened())
                out.extend(events.delta(output_token_text(i)) for i in range(sent, made))
                sent = made
                if req.status.is_finished:
                    break
                if out:
                    await resp.write(b"".join(out))
                    out = []
                await streams[0].wait()
            if req.error is not None:
                log_event(log, "responses_stream_cut", level=logging.WARNING, request_id=req.request_id,
                          error=req.error)
                if out:
                    await resp.write(b"".join(out))
                if request.transport is not None:
                    request.transport.close()
                return resp
            answer = self._answer(streams, response_id, message_id, created, body, params)
            await resp.write(b"".join([*out, events.message_done() if sent else b"", events.completed(answer)]))
            await resp.write_eof()
            if messages is not None:
                self.store[response_id] = StoredResponse(answer, self._conversation(messages, answer))
        except ConnectionResetError:  # the caller left; the generation is aborted below
            log_event(log, "client_disconnected_mid_stream", level=logging.DEBUG, request_id=req.request_id)
        finally:
            self._abort(streams)
        return resp

    @staticmethod
    def _conversation(messages: list[dict], answer: dict) -> list[dict]:
        texts = [part.get("text", "") for item in answer.get("output", []) for part in item.get("content", [])]
        return [*messages, {"role": "assistant", "content": "".join(texts)}]

    async def _run_background(self, stored: StoredResponse, body: dict, params, created: int) -> None:
        streams = stored.streams or []
        response_id = stored.body["id"]
        try:
            await self._finished(streams)
            answer = self._answer(streams, response_id, f"msg_{uuid.uuid4().hex[:16]}", created, body, params)
        except EnvelopeError:
            if stored.body["status"] in _CANCELLABLE:
                stored.body = {**stored.body, "status": "failed"}
            return
        finally:
            self._abort(streams)
        if stored.body["status"] != "cancelled":
            stored.body = answer
            stored.messages = self._conversation(stored.messages, answer)

    # -- the stored responses -------------------------------------------------------------------------------
    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if request.query.get("stream", "").lower() in ("true", "1"):
            raise InvalidRequest("The simulator does not replay a background response's events; GET it without "
                                 "`stream`.", "stream")
        return json_response(stored.body)

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if stored.body["status"] not in _CANCELLABLE:
            raise EnvelopeError(400, "Cannot cancel a synchronous response.", "response_id", "invalid_request_error")
        stored.body = {**stored.body, "status": "cancelled"}
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stored.task
        return json_response(stored.body)

    async def _close(self, app: web.Application) -> None:
        tasks = [s.task for s in self.store.values() if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
