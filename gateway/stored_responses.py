"""Stored responses through a pool: vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 keeps each /v1/responses answer in
the memory of the replica that answered it, so everything that names a response id must go there.

`ResponseHomes` remembers, by response id, the replica that answered it and the tenant that asked (a TTL and a
bound on the count). The gateway names every response itself (the body's `request_id`, which vLLM makes the
response's id) so it knows the id before the answer, streamed or not. An id it does not remember (forgotten, or
made before a restart, or by another relay) is looked for by asking the replicas (GET /v1/responses/{id}); none
has it: vLLM's own 404. `StoredResponses` does this for the proxy: the turn that continues a response is pinned
to its replica (`Ask.replica`), GET/DELETE/cancel are relayed there, and a `background` response keeps its slot and
KV reservation until its replica reports it ended (polled), or is refused when the config does not allow it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import aiohttp
from aiohttp import web

from gateway.classification import Classifier, ClassificationError
from gateway.flow.request import DropReason, End
from gateway.forwarded_headers import to_caller
from gateway.log import log_event
from gateway.responses import error_response
from holdback.contract import REQUEST_ID_HEADER

if TYPE_CHECKING:
    from gateway.flow.interface import FlowControl, FlowPools
    from gateway.flow.request import FlowRequest

logger = logging.getLogger("gateway.responses")

# A stored response in one of these has ended (vLLM's ResponseStatus); `queued` and `in_progress` have not.
ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass(frozen=True, slots=True)
class Home:
    url: str  # the replica that stored it
    tenant: str  # who asked for it
    at: float  # when it was remembered (monotonic)


class ResponseHomes:
    """Response id -> the replica that stored it; the oldest are forgotten past `max_entries` or `ttl` seconds."""

    def __init__(self, ttl: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.max_entries, self.clock = ttl, max_entries, clock
        self._homes: collections.OrderedDict[str, Home] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, url: str, tenant: str) -> None:
        self._homes.pop(response_id, None)
        self._homes[response_id] = Home(url, tenant, self.clock())
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> Home | None:
        now = self.clock()
        while self._homes:  # oldest first: drop what outlived the TTL
            oldest = next(iter(self._homes.values()))
            if now - oldest.at < self.ttl:
                break
            self._homes.popitem(last=False)
        return self._homes.get(response_id)


@dataclass(slots=True)
class Turn:
    """A /v1/responses request as the gateway sends it: its body (named), its id, the replica it must run on."""

    body: bytes
    response_id: str | None = None
    home: str | None = None
    background: bool = False
    stored: bool = False


def not_found(response_id: str, request_id: str | None = None) -> web.Response:
    """vLLM's own answer for an id no replica stores."""
    body = {"error": {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return web.json_response(body, status=404, headers=headers)


class StoredResponses:
    def __init__(self, pools: FlowPools, session: Callable[[], aiohttp.ClientSession | None],
                 classifier: Callable[[], Classifier]):
        self.pools = pools
        # The proxy's session (opened at start) and classifier (replaced by a reload).
        self.session, self.classifier = session, classifier
        settings = pools.loaded.config.responses
        self.homes = ResponseHomes(settings.rememberSeconds, settings.rememberMax)
        self.holding: set[asyncio.Task] = set()

    def reconfigure(self) -> None:
        settings = self.pools.loaded.config.responses
        self.homes.ttl, self.homes.max_entries = settings.rememberSeconds, settings.rememberMax

    # -- a /v1/responses request ----------------------------------------------------------------------------
    async def arrive(self, doc: object, body: bytes, tenant: str, flow: FlowControl,
                     request_id: str) -> Turn | web.Response:
        """The turn to send, or the gateway's answer: background refused, the previous response not found, its
        replica down or serving another model."""
        if not isinstance(doc, dict):
            return Turn(body)  # the replica answers a body that is not an object
        settings = self.pools.loaded.config.responses
        background = doc.get("background") is True
        if background and not settings.allowBackground:
            message = ("This gateway does not run `background` responses (responses.allowBackground is false in "
                       "its config): send the request without `background`, or ask the operator to allow it.")
            return error_response(400, message, "invalid_request_error", "background_not_allowed", request_id,
                                  param="background")
        turn = Turn(body, background=background, stored=doc.get("store", True) is not False)
        previous = doc.get("previous_response_id")
        if isinstance(previous, str):
            home = await self.find(previous, tenant, [r.url for r in flow.pool.healthy()])
            if home is None:
                return not_found(previous, request_id)
            if home not in {r.url for r in flow.pool.healthy()}:
                return _home_unavailable(previous, home, request_id,
                                         home in {r.url for r in self.pools.replicas.healthy()})
            turn.home = home
        if turn.stored:
            if not isinstance(doc.get("request_id"), str):
                # vLLM names the response after the body's request_id: named here, it is known before the answer.
                doc["request_id"] = f"resp_{os.urandom(8).hex()}"
                turn.body = json.dumps(doc, separators=(",", ":")).encode()
            turn.response_id = doc["request_id"]
        return turn

    def answered(self, turn: Turn | None, url: str, status: int, tenant: str) -> None:
        """The replica took the request (2xx): with the store on, it keeps the response under the turn's id."""
        if turn is not None and turn.response_id is not None and 200 <= status < 300:
            self.homes.remember(turn.response_id, url, tenant)

    async def find(self, response_id: str, tenant: str, urls: list[str]) -> str | None:
        """The replica that stores `response_id`: remembered (for the tenant that made it), else the first of
        `urls` (else every healthy replica) that answers GET /v1/responses/{id} with 200."""
        home = self.homes.home(response_id)
        if home is not None:
            return home.url if home.tenant == tenant else None
        urls = urls or [r.url for r in self.pools.replicas.healthy()]
        session = self.session()
        if not urls or session is None:
            return None

        async def stores(url: str) -> str | None:
            try:
                async with session.get(f"{url}/v1/responses/{response_id}") as resp:
                    return url if resp.status == 200 else None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return None

        found = next((url for url in await asyncio.gather(*(stores(u) for u in urls)) if url), None)
        if found is not None:
            self.homes.remember(response_id, found, tenant)
            log_event(logger, "response_found", response_id=response_id, replica=found)
        return found

    # -- GET, DELETE and cancel of /v1/responses/{id} -------------------------------------------------------
    async def relay(self, request: web.Request) -> web.StreamResponse:
        """The request relayed to the replica that stores the response, its answer back as it came (the caller
        must be the tenant that made it, when the gateway saw it made)."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or os.urandom(16).hex()
        try:
            caller = self.classifier().caller(request.headers.get("Authorization"))
        except ClassificationError as exc:
            return error_response(exc.status, exc.message, exc.err_type, exc.code, request_id)
        response_id = request.match_info["response_id"]
        home = await self.find(response_id, caller.tenant, [])
        if home is None:
            return not_found(response_id, request_id)
        session = self.session()
        assert session is not None
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            async with session.request(request.method, home + request.path_qs, headers=headers,
                                       data=await request.read() or None) as resp:
                answer = web.StreamResponse(status=resp.status, headers=to_caller(resp.headers.items(), request_id))
                await answer.prepare(request)
                async for chunk in resp.content.iter_any():  # a background response's events (GET ?stream=true)
                    await answer.write(chunk)
                await answer.write_eof()
                return answer
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            log_event(logger, "upstream_error", level=logging.WARNING, request_id=request_id, replica=home,
                      error=f"{type(exc).__name__}: {exc}")
            return error_response(502, f"The replica that stores response {response_id!r} failed: "
                                  f"{type(exc).__name__}; retry the request.", "upstream_error", "upstream_error",
                                  request_id)

    # -- background responses ---------------------------------------------------------------------------------
    def hold(self, turn: Turn | None, flow: FlowControl, req: FlowRequest, cause: End, status: int) -> bool:
        """A background response the replica took goes on generating after its answer: keep it counted, and
        finish it when the replica reports it ended (True: held, finished later). An evicted one is cancelled
        at its replica, since closing the connection does not stop it."""
        if turn is None or not turn.background or turn.response_id is None or not 200 <= status < 300:
            return False
        url = req.leased().replica.url
        if cause is End.EVICT:
            self._spawn(self._cancel(url, turn.response_id))
            return False
        if cause not in (End.END, End.CANCEL, End.DISCONNECT):
            return False
        req.task = self._spawn(self._until_ended(flow, req, url, turn.response_id))  # eviction cancels it
        return True

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.create_task(coro)
        self.holding.add(task)
        task.add_done_callback(self.holding.discard)
        return task

    async def _until_ended(self, flow: FlowControl, req: FlowRequest, url: str, response_id: str) -> None:
        cause = End.END
        try:
            while (status := await self._status(url, response_id)) not in ENDED and status is not None:
                await asyncio.sleep(self.pools.loaded.config.responses.pollSeconds)
        except asyncio.CancelledError:
            evicted = req.drop_reason is DropReason.EVICTED
            cause = End.EVICT if evicted else End.DISCONNECT
            if evicted:
                log_event(logger, "background_evicted", request_id=req.request_id, response_id=response_id)
                self._spawn(self._cancel(url, response_id))
        finally:
            flow.finish(req, cause, None if cause is End.EVICT else time.monotonic())

    async def _status(self, url: str, response_id: str) -> str | None:
        """The stored response's status; "" while the replica cannot be asked; None when it no longer has it."""
        session = self.session()
        try:
            async with session.get(f"{url}/v1/responses/{response_id}") as resp:  # type: ignore[union-attr]
                if resp.status == 404:
                    return None
                doc = await resp.json(content_type=None) if resp.status == 200 else {}
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return ""
        return doc.get("status", "") if isinstance(doc, dict) else ""

    async def _cancel(self, url: str, response_id: str) -> None:
        session = self.session()
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with session.post(f"{url}/v1/responses/{response_id}/cancel") as resp:  # type: ignore[union-attr]
                await resp.read()

    async def close(self) -> None:
        for task in list(self.holding):
            task.cancel()
        await asyncio.gather(*self.holding, return_exceptions=True)


def _home_unavailable(response_id: str, url: str, request_id: str, other_pool: bool) -> web.Response:
    if other_pool:
        return error_response(400, f"Response {response_id!r} was answered by a replica of another model pool "
                              f"({url}); continue it with that response's `model`.", "invalid_request_error",
                              "previous_response_other_model", request_id, param="previous_response_id")
    return error_response(503, f"The replica that stores response {response_id!r} ({url}) is not healthy now; "
                          "retry later (its stored responses are lost if it restarted).", "service_unavailable",
                          "previous_response_unavailable", request_id, {"Retry-After": "2"})
