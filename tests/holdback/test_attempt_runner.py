"""One attempt runner: the async worker's runtime and the processor's sync mode map every kind of answer
(success, 4xx, 5xx, a 429 eviction, a failing path, a timeout, an unreachable gateway) to the same row move,
the same attempt outcome and the same retry counters, streamed and plain sends alike."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from holdback.attempts import InFlight, RetryPolicy, Runtime, run_attempt
from batch_processor.sync_handoff import SyncHandoff
from holdback.contract import DROP_REASON_HEADER
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, Batch, RequestRow, Tenant
from tests.support import free_port, poll

# The timeout case's gateway answers after 5 s: sent alone with a 1 s request timeout, it times out however busy
# the machine is. The other cases are sent with 30 s, which an answer the gateway gives at once never needs (with
# 1 s for all, a CI machine stalled past it turned every answer into a timeout).
TIMEOUT, PATIENT = 1.0, 30.0
# case -> (row status, attempt outcome, evictions, transient failures) after one attempt
EXPECTED = {
    "ok": ("succeeded", "success", 0, 0),
    "bad_request": ("failed", "client_error", 0, 0),
    "server_error": ("retry_wait", "server_error", 0, 1),
    "evicted": ("retry_wait", "evicted", 1, 0),
    "no_replica": ("retry_wait", "server_error", 0, 0),  # a failing path: never budgeted
    "timeout": ("retry_wait", "transport_error", 0, 1),
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    case = body["messages"][0]["content"]
    if case == "ok":
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "model": "m", "usage": USAGE,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                   "finish_reason": "stop"}]})
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for event in ({"id": "c", "object": "chat.completion.chunk", "model": "m",
                       "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]},
                      {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": USAGE}):
            await stream.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await stream.write(b"data: [DONE]\n\n")
        return stream
    if case == "bad_request":
        return web.json_response({"error": {"message": "bad"}}, status=400)
    if case == "server_error":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    if case == "evicted":
        return web.json_response({"error": {"message": "evicted"}}, status=429, headers={DROP_REASON_HEADER: "evicted"})
    if case == "no_replica":
        return web.json_response({"error": {"message": "none"}}, status=503)
    await asyncio.sleep(TIMEOUT * 5)  # timeout
    return web.json_response({})


class Gateway:
    """A scripted gateway on its own loop thread: the answer is named by the request's prompt."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", _answer)
        self.runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def gateway():
    g = Gateway()
    yield g
    g.close()


def _rows(factory, cases, streamed):
    """One row per case; `streamed` rows are resumable (sent as a stream), the others have n=2 (sent as is)."""
    with transaction(factory) as s:
        t = Tenant(name=f"t{time.time_ns()}")
        s.add(t)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                  window_seconds=86400, status="in_progress", total=len(cases), expires_at=int(time.time() + 3600))
        s.add(b)
        s.flush()
        rows = {}
        for i, case in enumerate(cases):
            body = {"model": "m", "messages": [{"role": "user", "content": case}], **({} if streamed else {"n": 2})}
            row = RequestRow(batch_id=b.id, tenant_id=t.id, line=i + 1, custom_id=case, url="/v1/chat/completions",
                             body=json.dumps(body), status="queued")
            s.add(row)
            s.flush()
            rows[case] = row.id
        return b.id, rows


def _observed(factory, rows):
    out = {}
    with factory() as s:
        for case, row_id in rows.items():
            row = s.get(RequestRow, row_id)
            (attempt,) = s.query(Attempt).filter(Attempt.request_id == row_id).all()
            out[case] = (row.status, attempt.outcome, row.evictions, row.transient_failures)
    return out


POLICY = RetryPolicy(base=60.0, cap=60.0)  # retries wait a minute: one attempt per row here


def _through_worker(factory, url, batch_rows, timeout):
    async def run():
        rt = Runtime.over(factory, gateway_url=url, gateway_key=None, policy=POLICY, worker_name="w",
                          request_timeout=timeout, owns_engine=False)
        try:
            async with aiohttp.ClientSession() as http:
                await asyncio.gather(*(run_attempt(rt, http, InFlight(row_id)) for _, row_id in batch_rows))
        finally:
            rt.close()
    asyncio.run(run())


def _through_sync(factory, url, batch_rows, timeout):
    sync = SyncHandoff(factory, gateway_url=url, gateway_key=None, worker_name="p/sync", max_concurrency=8,
                       policy=POLICY, request_timeout=timeout)
    try:
        sync.push([(row_id, batch_id) for batch_id, row_id in batch_rows])
        poll(lambda: sync.in_flight == 0, 30, "the sync mode to finish every row")
    finally:
        assert sync.close() == []


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "plain"])
def test_worker_and_sync_mode_make_the_same_move_for_every_answer(backend, gateway, streamed):
    engine = make_engine(backend.database_url)
    factory = make_sessionmaker(engine)
    url = f"http://127.0.0.1:{gateway.port}"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the request never leaves
    try:
        seen = {}
        for name, run in (("worker", _through_worker), ("sync", _through_sync)):
            batch_id, rows = _rows(factory, [case for case in EXPECTED if case != "timeout"], streamed)
            run(factory, url, [(batch_id, row_id) for row_id in rows.values()], PATIENT)
            slow_batch, slow = _rows(factory, ["timeout"], streamed)
            run(factory, url, [(slow_batch, slow["timeout"])], TIMEOUT)
            unreachable_batch, unreachable = _rows(factory, ["ok"], streamed)
            run(factory, dead, [(unreachable_batch, unreachable["ok"])], PATIENT)
            seen[name] = {**_observed(factory, rows), **_observed(factory, slow),
                          "unreachable": _observed(factory, unreachable)["ok"]}
        expected = {**EXPECTED, "unreachable": ("retry_wait", "transport_error", 0, 0)}
        assert seen["worker"] == expected
        assert seen["sync"] == expected
    finally:
        engine.dispose()
