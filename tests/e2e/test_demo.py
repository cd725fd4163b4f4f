"""`holdback demo` measures right: its realtime client sends a burst at once (it never queues its own
requests), the way without holdback goes to every replica in turn without the gateway's key, the no-controls batch
keeps its concurrency and lets go of everything when stopped, every option shows its default, and the whole demo,
run as a user runs it, starts its own platform, shows the three ways and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import os
import sys
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from bench.lib import forkserver
from holdback.cli.demo import _parser
from holdback.cli.demo_traffic import DirectBatch, GatewayAdminClient, RealtimeTraffic, quantile
from holdback.settings import Settings
from tests.support import poll, served

REPO = Path(__file__).resolve().parents[2]


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
        async with served(app) as url:
            return await RealtimeTraffic([url], "k", "sim-model", burst=burst, rate=20, seconds=0.5).run()

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
        apps = [web.Application(), web.Application()]
        for index, status in ((0, 200), (1, 401)):
            apps[index].router.add_post("/v1/chat/completions", replica(index, status))
        async with served(apps[0]) as first, served(apps[1]) as second:
            return await RealtimeTraffic([first, second], None, "m", burst=10, rate=0, seconds=0).run(), [first, second]

    stats, urls = asyncio.run(main())
    assert len(seen[0]) == len(seen[1]) == 5 and set(seen[0] + seen[1]) == {None}
    assert (len(stats.ttfts), stats.errors) == (5, 5)
    assert stats.first_error.startswith(f"HTTP 401 from {urls[1]}: ") and "no key given" in stats.first_error


def test_the_p95_is_the_value_below_which_95_percent_fall():
    assert quantile([0.1] * 19 + [2.0], 0.95) == 2.0
    assert quantile([float(i) for i in range(100)], 0.95) == 95.0


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


def test_the_batch_with_no_controls_keeps_its_concurrency_and_lets_go_when_stopped():
    open_now, most, answered = 0, 0, 0
    full = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal open_now, most, answered
        body = await request.json()
        assert body["stream"] is True and request.headers.get("authorization") is None
        open_now += 1
        most = max(most, open_now)
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            answered += 1
            if answered <= 10:  # the first ten end at once; later ones stay open until the client goes
                await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n')
                return resp
            if open_now == 4:
                full.set()
            while True:  # as a replica streams: a client that went away shows as a failed write
                await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
                await asyncio.sleep(0.05)
        finally:
            open_now -= 1

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with served(app) as url:
            batch, stop = DirectBatch([url], [{"model": "m", "messages": []}], concurrency=4), asyncio.Event()
            sending = asyncio.create_task(batch.run(stop))
            await asyncio.wait_for(full.wait(), 60)
            stop.set()
            await asyncio.wait_for(sending, 60)
            deadline = asyncio.get_running_loop().time() + 60
            while open_now and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)  # the server sees each cut stream end
            return batch, open_now  # before the server is stopped, which would end every stream itself

    batch, still_open = asyncio.run(main())
    assert most == 4, f"{most} streams were open at once; the batch keeps exactly its concurrency"
    assert (batch.completed, batch.errors) == (10, 0)
    assert still_open == 0, "a stopped batch leaves no stream open at the replica"


def _processes_with(needle: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.e2e
def test_the_demo_starts_its_own_platform_shows_three_ways_and_leaves_nothing_behind():
    """The demo as a user runs it, with short windows: its own platform beside nothing else, realtime alone, beside a
    batch with no controls and through holdback, a table whose counts agree with its sentence, and at the end neither
    a process of its platform nor its data dir. Latencies are printed, not asserted: on a loaded test machine they are
    the machine's; the closing figures are measured on a quiet one (docs/benchmarks.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDBACK_")}
    env["HOLDBACK_REPLICAS"] = "http://127.0.0.1:9"  # ignored: the demo's platform takes nothing of ours
    demo = forkserver.run([sys.executable, "-m", "holdback.cli", "demo", "--seconds", "4", "--realtime-rate", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = demo.stdout
    assert demo.returncode == 0, out + demo.stderr
    data_dir = re.search(r"^starting a small platform for the demo in (\S+):", out, re.M).group(1)
    rows = dict(re.findall(r"^(alone|beside the batch, no controls|beside the batch, through holdback)\s+"
                           r"([\d,]+ ms\s+\d+\s+0\s+\S+\s+\S+\s+\d+)$", out, re.M))
    assert list(rows) == ["alone", "beside the batch, no controls", "beside the batch, through holdback"], out
    # p95, "ms", streams, errors, batch finished, evictions, preemptions
    cells = {k: v.split() for k, v in rows.items()}
    assert cells["alone"][4:6] == ["—", "—"], "alone: no batch, no evictions"
    assert cells["beside the batch, no controls"][5] == "—", "with no controls the gateway evicts nothing"
    none_done = int(cells["beside the batch, no controls"][4])
    holdback_done = int(cells["beside the batch, through holdback"][4])
    assert none_done > 0 and holdback_done > 0, out
    sentence = re.search(r"^realtime p95 ([\d,]+) ms alone, ([\d,]+) ms beside a batch with no controls, ([\d,]+) ms "
                         r"with holdback, while the batch finished (\d+) requests in 4 s \((\d+)% of the (\d+) it "
                         r"finished with no controls\)\.$", out, re.M)
    assert sentence, out
    assert [cells[k][0] for k in rows] == list(sentence.groups()[:3])
    assert (int(sentence.group(4)), int(sentence.group(6))) == (holdback_done, none_done)
    assert not Path(data_dir).exists(), "the demo's data dir is removed unless --keep"
    needle = f"HOLDBACK_DATA_DIR={data_dir}\0".encode()
    poll(lambda: not _processes_with(needle), 30, "the demo platform's processes to be gone",
         lambda: _processes_with(needle))
