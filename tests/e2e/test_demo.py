"""`holdback demo` measures right: its realtime client sends a burst at once (it never queues its own
requests), the phase without holdback goes to every replica in turn without the gateway's key, the gateway's own
p95 comes from the gateway's histogram for the demo's streams only, and every option shows its default. The demo
against a real `holdback up` (its three phases in one run) runs in tests/e2e/test_up.py.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from aiohttp import web

from holdback.cli.demo import GatewayAdminClient, RealtimeTraffic, _parser, histogram_quantile, quantile, ttft_buckets
from holdback.settings import Settings


def test_a_burst_is_in_flight_at_once_and_every_stream_is_counted_once():
    burst, open_now, most = 128, 0, 0  # more than httpx's default pool of 100 connections
    everyone_in = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        if open_now >= burst:
            everyone_in.set()
        try:
            # Nobody gets a first token until the whole burst is open here: a client that queued
            # its own requests (a small pool, a few threads) would never get there.
            await asyncio.wait_for(everyone_in.wait(), 60)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            open_now -= 1

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            traffic = RealtimeTraffic([f"http://127.0.0.1:{port}"], "k", "sim-model", burst=burst, rate=20,
                                      seconds=0.5)
            return await traffic.run()
        finally:
            await runner.cleanup()

    stats = asyncio.run(main())
    assert most == burst, f"the server saw at most {most} of the {burst}-stream burst at once"
    assert stats.errors == 0 and stats.in_flight == 0
    assert stats.finished == stats.sent == len(stats.ttfts) >= burst


def test_straight_to_the_replicas_goes_to_each_in_turn_without_a_key():
    seen: dict[int, list[str | None]] = {0: [], 1: []}

    def replica(index: int, status: int):  # noqa: ANN202
        async def chat(request: web.Request) -> web.StreamResponse:
            seen[index].append(request.headers.get("authorization"))
            if status != 200:
                return web.json_response({"error": {"message": "no key given"}}, status=status)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n')
            return resp
        return chat

    async def main():
        runners, urls = [], []
        for index, status in ((0, 200), (1, 401)):
            app = web.Application()
            app.router.add_post("/v1/chat/completions", replica(index, status))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            return await RealtimeTraffic(urls, None, "m", burst=10, rate=0, seconds=0).run(), urls
        finally:
            for runner in runners:
                await runner.cleanup()

    stats, urls = asyncio.run(main())
    assert len(seen[0]) == len(seen[1]) == 5 and set(seen[0] + seen[1]) == {None}
    assert (len(stats.ttfts), stats.errors) == (5, 5)
    assert stats.first_error.startswith(f"HTTP 401 from {urls[1]}: ") and "no key given" in stats.first_error


METRICS = """# TYPE holdback_gateway_ttft_seconds histogram
holdback_gateway_ttft_seconds_bucket{le="0.1",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="0.25",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="+Inf",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="0.1",objective="batch"} 999
holdback_gateway_ttft_seconds_bucket{le="+Inf",objective="batch"} 999
"""


def test_the_gateway_p95_counts_only_the_streams_since_the_baseline():
    before = ttft_buckets(METRICS % (1000, 1000, 1000))  # earlier traffic, all fast
    after = ttft_buckets(METRICS % (1010, 1100, 1100))  # the demo's 100 streams: 10 under 100 ms, 90 under 250
    value, n = histogram_quantile(0.95, before, after)
    assert n == 100
    assert value == pytest.approx(0.1 + 0.15 * (95 - 10) / 90)  # interpolated within the 100-250 ms bucket
    assert histogram_quantile(0.95, after, after) is None  # nothing new: no figure rather than an old one
    assert quantile([0.1] * 19 + [2.0], 0.95) == 2.0


def test_evictions_read_zero_before_the_first_and_unknown_only_when_unreachable():
    def state(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"totals": {"dispatched": 5, "evictions": {}, "rejections": {}}})

    async def read(transport):  # noqa: ANN001
        async with httpx.AsyncClient(transport=transport) as client:
            return await GatewayAdminClient("http://gw", "admin").evictions(client)

    assert asyncio.run(read(httpx.MockTransport(state))) == (0, "")
    down = httpx.MockTransport(lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused")))
    assert asyncio.run(read(down)) == (None, "ConnectError")


def test_every_demo_option_shows_its_default():
    text = _parser(Settings()).format_help()
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    assert options, text
    missing = [o.split()[0] for o in options if "default" not in o and not o.startswith("-h")]
    assert not missing, f"options without a default in --help: {missing}"


def test_the_sample_batch_uses_the_example_chat_lines(tmp_path):
    from holdback.cli.demo import sample_batch
    from holdback.cli.up import EXAMPLE_REQUESTS

    chats = [json.loads(x)["body"]["messages"] for x in EXAMPLE_REQUESTS.read_text().splitlines()
             if json.loads(x)["url"] == "/v1/chat/completions"]
    urls = {json.loads(x)["url"] for x in EXAMPLE_REQUESTS.read_text().splitlines()}
    assert urls == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}
    lines = [json.loads(x) for x in sample_batch("m", 7, 5).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"demo-{i}" for i in range(7)]
    assert [x["body"]["messages"] for x in lines] == [chats[i % len(chats)] for i in range(7)]
