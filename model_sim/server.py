"""HTTP routes of a replica: OpenAI generation and embeddings, vLLM's extras, admin and faults.

Routes stay thin: parse with `protocol`, hand the request to the engine, stream what it emits.
A cancelled handler (client gone) aborts its engine requests in `finally`. What is routed follows
`--runner` (a route a vLLM server of that kind lacks answers FastAPI's 404). What wraps every route (spans,
error answers, the `--api-key` guard) is `model_sim.middleware`'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import random
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from holdback.contract import (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, INFERENCE_ENDPOINTS,
                               REQUEST_ID_HEADER, RESPONSES_ENDPOINT)
from holdback.logs import log_event
from model_sim import answers, protocol
from model_sim.engine import RequestRejected, RequestStream
from model_sim.errors import EnvelopeError, InvalidRequest, json_response
from model_sim.faults import FORCE_ERROR_HEADER
from model_sim.generation import continuation_offset, output_text, output_token_text
from model_sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from model_sim.middleware import REPLICA_KEY, middlewares, stamp_headers
from model_sim.request import RequestStatus
from model_sim.responses_api import ResponsesApi

if TYPE_CHECKING:
    from model_sim.replica import SimReplica

log = logging.getLogger("model_sim")
# vLLM 0.32 reads a request's priority from this header before the body's `priority`.
PRIORITY_HEADER = "X-Vllm-Priority"

_FAULT_MESSAGES = {
    429: "Injected fault: too many requests. Retry later.",
    500: "Injected fault: internal server error.",
    503: "Injected fault: service unavailable. Retry later.",
}


def build_app(replica: "SimReplica") -> web.Application:
    app = web.Application(middlewares=middlewares(), client_max_size=64 * 1024 * 1024)
    app[REPLICA_KEY] = replica
    routes = Routes(replica)
    inference = {CHAT_ENDPOINT: routes.chat_completions, COMPLETIONS_ENDPOINT: routes.completions,
                 EMBEDDINGS_ENDPOINT: routes.embeddings, RESPONSES_ENDPOINT: routes.responses}
    for endpoint in INFERENCE_ENDPOINTS:
        if not replica.config.runner.serves(endpoint):
            continue
        if endpoint is RESPONSES_ENDPOINT:
            routes.responses_api.add_routes(app, routes.responses)
        else:
            app.router.add_post(endpoint.path, inference[endpoint])
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/metrics/", routes.metrics)
    app.router.add_get("/admin/state", routes.admin_state)
    app.router.add_get("/admin/faults", routes.get_faults)
    app.router.add_post("/admin/faults", routes.set_faults)
    app.on_response_prepare.append(stamp_headers)
    return app


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}); send a JSON object.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _response_id(prefix: str, request: web.Request) -> str:
    """vLLM's: the caller's X-Request-Id when it sent one, else 16 random hex digits."""
    return f"{prefix}-{request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex[:16]}"


class Routes:
    def __init__(self, replica: "SimReplica"):
        self.replica = replica
        self.config = replica.config
        self.engine = replica.engine
        self.tokenizer = replica.tokenizer
        self.model = replica.config.model
        self.max_model_len = replica.config.engine.max_model_len
        # vLLM's is `vllm-<version>-<config hash>`; ours names the simulator and hashes its settings.
        self.system_fingerprint = "model_sim-" + hashlib.blake2b(repr(replica.config).encode(),
                                                                 digest_size=4).hexdigest()
        self.responses_api = ResponsesApi(replica.config, self.tokenizer,
                                          lambda request, params, ids: self._start(request, params, ids, 0, True),
                                          self._finished, self._abort_unfinished)

    # -- faults ---------------------------------------------------------------------------------

    async def _inject_faults(self, request: web.Request) -> None:
        forced = request.headers.get(FORCE_ERROR_HEADER)
        if forced is not None:
            try:
                code = int(forced)
            except ValueError:
                code = 0
            if not 400 <= code <= 599:
                raise InvalidRequest(f"{FORCE_ERROR_HEADER} must be an HTTP error status from 400 to 599, "
                                     f"got {forced!r}.", FORCE_ERROR_HEADER)
        faults = self.replica.faults
        if faults.delay_seconds > 0:
            await asyncio.sleep(faults.delay_seconds)
        status = faults.choose(forced)
        if status is not None:
            raise EnvelopeError(status, _FAULT_MESSAGES.get(status, f"Injected fault: HTTP {status}."))

    # -- generation -----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        await self._inject_faults(request)
        body = await _json_object(request)
        params = protocol.parse_generation(body, chat=True, priority_header=request.headers.get(PRIORITY_HEADER))
        prompt = protocol.chat_prompt(body)
        protocol.check_model(body, self.model)
        offset = continuation_offset(prompt.continued) if prompt.continued is not None else 0
        prompt_ids = protocol.truncated(self.tokenizer.encode(prompt.text), body, self.max_model_len)
        return await self._generate(request, params, prompt_ids, chat=True, offset=offset, prompt_is_text=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await self._inject_faults(request)
        body = await _json_object(request)
        params = protocol.parse_generation(body, chat=False, priority_header=request.headers.get(PRIORITY_HEADER))
        prompt = body.get("prompt")
        prompt_ids = protocol.truncated(protocol.completion_prompt_ids(prompt, self.tokenizer), body,
                                        self.max_model_len)
        protocol.check_model(body, self.model)
        # A resumed prompt ends with the output so far, as text or (resumed by token ids) as the output's ids.
        offset = continuation_offset(prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids))
        is_text = isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                              and isinstance(prompt[0], str))
        return await self._generate(request, params, prompt_ids, chat=False, offset=offset, prompt_is_text=is_text)

    async def responses(self, request: web.Request) -> web.Response:
        """vLLM's Responses API without tools, its store when configured (model_sim/responses_api.py)."""
        await self._inject_faults(request)
        body = await _json_object(request)
        return await self.responses_api.create(request, body, request.headers.get(PRIORITY_HEADER))

    def _start(self, request: web.Request, params: protocol.GenerationParams, prompt_ids: list[int], offset: int,
               prompt_is_text: bool) -> list[RequestStream]:
        """The request's output limit resolved and checked, and its sequences added to the engine."""
        protocol.resolve_max_tokens(params, len(prompt_ids), self.max_model_len, self.config.default_max_tokens,
                                    prompt_is_text)
        try:
            self.engine.check_request(len(prompt_ids), params.max_tokens)
        except RequestRejected as exc:
            raise InvalidRequest(str(exc), exc.param) from None
        # Each choice is a sequence of its own (its own KV), as vLLM fans a request with n > 1 out.
        event = asyncio.Event()
        return [self.engine.add_request(
            prompt_ids,
            params.max_tokens,
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            priority=params.priority,
            external_id=request.headers.get(REQUEST_ID_HEADER),
            output_offset=offset,
            cache_salt=params.cache_salt,
            n=params.n,
            choice_index=i,
            event=event,
        ) for i in range(params.n)]

    async def _finished(self, streams: list[RequestStream]) -> None:
        """Until every sequence is finished; an engine failure is a 500, an abort by shutdown a 503."""
        while not all(s.request.status.is_finished for s in streams):
            await streams[0].wait()
        failed = next((s.request.error for s in streams if s.request.error is not None), None)
        if failed is not None:
            raise EnvelopeError(500, failed)
        if any(s.request.status is RequestStatus.FINISHED_ABORTED for s in streams):
            raise EnvelopeError(503, "The request was aborted because the server is shutting down. Retry it.")

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.request.status.is_finished:
                self.engine.abort_request(s.request.request_id)

    async def _generate(self, request: web.Request, params: protocol.GenerationParams, prompt_ids: list[int],
                        chat: bool, offset: int, prompt_is_text: bool):
        streams = self._start(request, params, prompt_ids, offset, prompt_is_text)
        response_id = _response_id("chatcmpl" if chat else "cmpl", request)
        created = int(time.time())
        try:
            if params.stream:
                return await self._stream(request, streams, params, response_id, created, chat)
            await self._finished(streams)
            reqs = [s.request for s in streams]
            choices = [answers.Choice(output_text(offset, offset + r.num_output_tokens), r.status.finish_reason,
                                       list(r.output_token_ids)) for r in reqs]
            return json_response(answers.completion_body(
                response_id, created, self.model, choices, reqs[0].num_prompt_tokens,
                sum(r.num_output_tokens for r in reqs), chat, self._cached_tokens(reqs[0]), self.system_fingerprint,
                list(prompt_ids) if params.return_token_ids else None))
        finally:
            self._abort_unfinished(streams)

    async def _stream(self, request, streams: list[RequestStream], params, response_id: str, created: int,
                      chat: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        fmt = answers.SseFormatter(response_id, created, self.model, chat, self.system_fingerprint,
                                    params.include_usage,
                                    list(streams[0].request.prompt_token_ids) if params.return_token_ids else None)
        n = len(streams)
        sent = [0] * n
        done = [False] * n
        prompt_tokens = streams[0].request.num_prompt_tokens
        running_usage = prompt_tokens if params.continuous_usage else None
        try:
            while True:
                failed = next((s.request.error for s in streams if s.request.error is not None), None)
                if failed is not None:
                    # As vLLM does when the engine fails mid-stream: an error event, then [DONE].
                    await resp.write(fmt.error(failed, 500) + fmt.DONE)
                    await resp.write_eof()
                    return resp
                out = []
                for i, stream in enumerate(streams):
                    req = stream.request
                    if done[i]:
                        continue
                    k, finished = req.num_output_tokens, req.status.is_finished
                    if not finished and sent[i] and k - sent[i] < params.stream_interval:
                        k = sent[i]  # held until a whole interval is made (the first token goes at once)
                    if (k > sent[i] or finished) and not fmt.role_sent:
                        out.append(fmt.roles(n, running_usage))
                    if k > sent[i]:
                        texts = [output_token_text(req.output_offset + j) for j in range(sent[i], k)]
                        chunks = fmt.joined if params.stream_interval > 1 else fmt.tokens
                        ids = req.output_token_ids[sent[i]:k] if params.return_token_ids else None
                        out.append(chunks(i, texts, req.status.finish_reason if finished else None,
                                          running_usage, sent[i], ids))
                        sent[i] = k
                    elif finished and sent[i]:
                        out.append(fmt.finish_only(i, req.status.finish_reason, running_usage, sent[i]))
                    done[i] = finished  # a choice aborted before its first token sends nothing, as in vLLM
                if out:
                    await resp.write(b"".join(out))
                if all(done):
                    break
                await streams[0].wait()
            cached = self._cached_tokens(streams[0].request)
            tail = fmt.usage(prompt_tokens, sum(sent), cached) if params.include_usage else b""
            await resp.write(tail + fmt.DONE)
            await resp.write_eof()
        except ConnectionResetError:
            # The client left between our checks; the caller's `finally` aborts the requests.
            log_event(log, "client_disconnected_mid_stream", level=logging.DEBUG,
                      request_id=streams[0].request.request_id)
        return resp

    def _cached_tokens(self, req) -> int | None:
        """Prompt tokens served from the prefix cache at admission; None (null) unless the server reports them."""
        if not self.config.enable_prompt_tokens_details:
            return None
        return max(req.num_cached_tokens, 0)

    # -- embeddings -----------------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        await self._inject_faults(request)
        body = await _json_object(request)
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(
                isinstance(t, int) and not isinstance(t, bool) for t in inputs)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise InvalidRequest("\"input\" is required: a string, a list of strings or a list of token-id lists.",
                                 "input")
        dims = body.get("dimensions") or self.config.embedding_dim
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 4096:
            raise InvalidRequest(f"\"dimensions\" must be an integer from 1 to 4096, got {dims!r}.", "dimensions")
        protocol.check_model(body, self.model)
        data, total = [], 0
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                ids = self.tokenizer.encode(item)
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in item):
                ids = item
            else:
                raise InvalidRequest(f"input[{i}] must be a string or a list of non-negative token ids.", "input")
            if not ids:
                raise InvalidRequest(f"input[{i}] is empty; send at least one token.", "input")
            ids = protocol.truncated(ids, body, self.max_model_len, generates=False)
            protocol.check_prompt_length(len(ids), self.max_model_len, isinstance(item, str))
            total += len(ids)
            data.append({"index": i, "object": "embedding", "embedding": _embedding(ids, dims)})
        return json_response({
            "id": _response_id("embd", request), "object": "list", "created": int(time.time()), "model": self.model,
            "data": data, "usage": answers.usage(total, 0)})

    # -- vLLM extras ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": now, "owned_by": "vllm", "root": self.model,
            "parent": None, "max_model_len": self.max_model_len, "permission": [permission]}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        protocol.check_model(body, self.model)
        if "messages" in body:
            text = protocol.chat_prompt(body).text
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise InvalidRequest("Send \"prompt\" (a string) or \"messages\" (a chat) to tokenize.", "prompt")
        ids = self.tokenizer.encode(text)
        return json_response({
            "count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
            "token_strs": self.tokenizer.token_strings(ids) if body.get("return_token_strs") else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        protocol.check_model(body, self.model)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise InvalidRequest("\"tokens\" is required: a list of non-negative token ids.", "tokens")
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": "model_sim"})

    async def metrics(self, request: web.Request) -> web.Response:
        # As vLLM: its /metrics route answers everything; its /metrics/ mount (prometheus_client's app) answers
        # `name[]=` with those series alone.
        names = request.query.getall("name[]", []) if request.path == "/metrics/" else []
        return web.Response(body=self.replica.metrics.render(names), headers={"Content-Type": METRICS_CONTENT_TYPE})

    # -- admin ----------------------------------------------------------------------------------

    async def admin_state(self, request: web.Request) -> web.Response:
        include_blocks = request.query.get("blocks", "0") not in ("0", "false", "")
        since = request.query.get("history_since")
        try:
            history_since = float(since) if since is not None else None
        except ValueError:
            raise InvalidRequest(f"history_since must be a Unix time in seconds, got {since!r}.",
                                 "history_since") from None
        return web.json_response(self.replica.state(include_blocks, history_since))

    def _check_admin(self, request: web.Request) -> None:
        key = self.replica.config.admin_key
        if key is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise EnvelopeError(401, "The simulator's /admin/faults needs its admin key: send "
                                "`Authorization: Bearer KEY` (the key given by --admin-key).",
                                error_type="authentication_error")

    async def get_faults(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        return web.json_response(self.replica.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await _json_object(request)
        try:
            self.replica.faults.update(body)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return web.json_response(self.replica.faults.as_dict())


def _embedding(token_ids: list[int], dims: int) -> list[float]:
    """A unit vector determined by the tokens alone (same input, same vector, on any replica)."""
    digest = hashlib.blake2b(json.dumps(token_ids).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]
