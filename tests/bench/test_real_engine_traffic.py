"""The real-engine study's batch accounting: a batch token counts when it arrives within the window, whatever the
attempt that carried it did before or after (an attempt that straddles the window's start or end counts only
its part inside: counted whole, an arm whose loops ran on past the window, as vLLM's slow realtime kept them,
was credited with work done outside it)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from bench.real_engine import traffic


class Clock:
    """The study's clock in these tests: each event the fake replica sends carries the time it arrives at (`t`),
    and the clock reads it when the study's code parses that event, so what arrives when is the test's choice,
    however the two sides of the connection are scheduled."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def loads(self, data: bytes | str) -> object:
        doc = json.loads(data)
        if isinstance(doc, dict) and "t" in doc:
            self.now = doc["t"]
        return doc


def event(t: float, token: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": f" t{token}", "token_ids": [token], "finish_reason": finish}
    return b"data: " + json.dumps({"t": t, "choices": [choice]}).encode() + b"\n\n"


def evicted(t: float) -> bytes:
    return b"data: " + json.dumps({"t": t, "error": {"code": "evicted"}}).encode() + b"\n\n"


async def serve(answers: list[list[bytes]], calls: list[dict]) -> tuple[web.AppRunner, str]:
    """A replica answering its n-th streamed completion with `answers[n]` (the last one again past the end)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        calls.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in answers[min(len(calls), len(answers)) - 1]:
            await resp.write(chunk)
        return resp

    return await replica(completions)


async def replica(completions=None, metrics=None) -> tuple[web.AppRunner, str]:  # noqa: ANN001 - aiohttp handlers
    """A replica on a port of this process whose /v1/completions is `completions` and /metrics `metrics`."""
    app = web.Application()
    if completions is not None:
        app.router.add_post("/v1/completions", completions)
    if metrics is not None:
        app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def run_batch(monkeypatch, answers: list[list[bytes]], owed: int) -> tuple[traffic.Record, list[dict]]:
    """One batch loop of the study against the fake replica, for the window 10–20."""
    clock = Clock()
    monkeypatch.setattr(traffic, "time", clock)
    monkeypatch.setattr(traffic, "json", clock)
    calls: list[dict] = []

    async def main() -> traffic.Record:
        runner, url = await serve(answers, calls)
        rec = traffic.Record("arm", 0)
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(traffic.batch(session, url, traffic.Arm("arm", "an arm", ""), 1,
                                                     (10.0, 20.0), rec, (owed, owed)), 30)
        finally:
            await runner.cleanup()
        return rec

    return asyncio.run(main()), calls


def test_an_attempt_across_the_window_counts_only_its_tokens_inside_it(monkeypatch) -> None:
    # Three tokens before the window, four inside it, three after it: one attempt carries them all, and the
    # loop ends with it (its clock is past the window).
    times = [1.0, 2.0, 3.0, 11.0, 12.0, 13.0, 14.0, 25.0, 26.0, 27.0]
    answer = [event(t, i + 2, "length" if i == len(times) - 1 else None) for i, t in enumerate(times)]
    rec, calls = run_batch(monkeypatch, [answer + [b"data: [DONE]\n\n"]], len(times))
    assert len(calls) == 1
    assert (rec.batch_tokens, rec.batch_completed) == (4, 0)  # it finished at 27, after the window


def test_an_evicted_attempt_counts_its_tokens_inside_the_window_and_its_resume_completes(monkeypatch) -> None:
    first = [event(4.0, 2), event(8.0, 3), event(11.0, 4), event(12.0, 5), evicted(12.5)]  # 2 before, 2 inside
    resume = [event(14.0, 6), event(15.0, 7), event(16.0, 8, "length"), b"data: [DONE]\n\n"]  # the 3 still owed
    after = [event(30.0, 9), event(31.0, 10, "length"), b"data: [DONE]\n\n"]  # the next request, past the window
    rec, calls = run_batch(monkeypatch, [first, resume, after], 7)
    assert (rec.evictions, rec.batch_completed, rec.batch_tokens) == (1, 1, 5)
    assert calls[1]["max_tokens"] == 3 and calls[1]["prompt"].endswith(" t2 t3 t4 t5")
    assert len(calls) == 3


def test_a_realtime_request_the_server_drops_twice_is_counted_failed_and_the_run_goes_on() -> None:
    """A replica that closes every connection before answering (as vLLM's API server did once under load): each
    realtime request is a failure in the record, and the arm's run ends normally instead of raising."""

    async def main() -> traffic.Record:
        async def drop(request: web.Request) -> web.StreamResponse:
            request.transport.close()  # type: ignore[union-attr]
            raise web.HTTPInternalServerError()  # never sent: the connection is gone

        runner, url = await replica(drop)
        rec = traffic.Record("arm", 0)
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(traffic.realtime(session, url, traffic.Arm("arm", "an arm", ""),
                                                        [0.0, 0.0, 0.0], 0.0, rec), 30)
        finally:
            await runner.cleanup()
        return rec

    rec = asyncio.run(main())
    assert rec.realtime_failed == 3 and len(rec.ttft) == 3 and all(t == float("inf") for t in rec.ttft)


def test_with_no_gateway_in_front_of_two_replicas_each_request_goes_to_the_next_one() -> None:
    """vLLM priority alone in front of two replicas: the load balancer the study stands in for sends each request
    to the next replica in turn, realtime and batch sharing one turn."""
    answer = [event(0.0, 2, "length"), b"data: [DONE]\n\n"]

    async def main() -> tuple[list[dict], list[dict], traffic.Record]:
        seen: tuple[list[dict], list[dict]] = ([], [])
        runners = [await serve([answer], calls) for calls in seen]
        rec = traffic.Record("arm", 0)
        try:
            async with aiohttp.ClientSession() as session:
                turn = traffic.LoadBalancer([url for _, url in runners])
                await asyncio.wait_for(traffic.realtime(session, turn, traffic.Arm("arm", "an arm", None),
                                                        [0.0] * 5, 0.0, rec), 30)
        finally:
            for runner, _ in runners:
                await runner.cleanup()
        return seen[0], seen[1], rec

    first, second, rec = asyncio.run(main())
    assert (len(first), len(second)) == (3, 2)
    assert rec.realtime_failed == 0 and len(rec.ttft) == 5


def test_the_engines_counters_are_summed_over_the_replicas() -> None:
    """Two replicas' steps and generated tokens add up; a replica that cannot say makes the sum unknown (a step
    count missing one replica's steps would credit the arm with work per step it did not do)."""

    async def main() -> tuple[dict | None, dict | None]:
        runners = []
        for steps, generated in ((10, 80), (30, 240)):
            async def metrics(request: web.Request, steps: int = steps, generated: int = generated) -> web.Response:
                return web.Response(text=f"vllm:iteration_tokens_total_count{{engine=\"0\"}} {steps}.0\n"
                                         f"vllm:generation_tokens_total{{engine=\"0\"}} {generated}.0\n")

            runners.append(await replica(metrics=metrics))
        try:
            async with aiohttp.ClientSession() as session:
                urls = [url for _, url in runners]
                both = await traffic.all_counters(session, urls)
                missing = await traffic.all_counters(session, [*urls, "http://127.0.0.1:9"])
        finally:
            for runner, _ in runners:
                await runner.cleanup()
        return both, missing

    both, missing = asyncio.run(main())
    assert both == {"steps": 40.0, "generated": 320.0}
    assert missing is None
