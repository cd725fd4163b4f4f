"""The real-engine study's traffic (bench/real_engine/study.py): what an arm is, what one run of it records, and
the load itself: realtime arrivals (a burst, then Poisson) streamed for their first token, and batch loops
that keep requests in flight and resume an evicted one from its prompt's and output's token ids, as the workers
do."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import aiohttp

from bench.lib.traffic import schedule
from holdback.contract import OBJECTIVE_HEADER

# The status a stream gets when its connection broke after the headers.
BROKEN = 0
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass(frozen=True)
class Arm:
    name: str
    title: str
    gateway: str | None  # extra gateway YAML; None: straight to vLLM
    batch: bool = True
    default: bool = True  # False: run only when named in --arms
    shared: bool = True  # False: the gateway runs `gateway` alone, without the study's common settings


@dataclass
class Record:
    arm: str
    round: int
    engine: str = "vllm"
    group: int = 0  # the run of the two baselines and one arm, adjacent in time, its ratios are taken within
    ttft: list[float] = field(default_factory=list)  # seconds; inf: no first token
    realtime_failed: int = 0
    batch_completed: int = 0
    batch_tokens: int = 0
    batch_failed: int = 0
    evictions: int = 0
    broken: int = 0  # batch streams whose connection broke mid-stream (resumed, as an eviction is)
    # The engine's steps within the window (vLLM's vllm:iteration_tokens_total count; None: not scraped): the
    # batch tokens per step compare arms in the engine's own time, whatever the machine's speed meanwhile.
    steps: float | None = None
    # Cores each role used over the run, lead included (bench.real_engine.study.cpu_role: the load, the gateway,
    # vLLM's API server, its engine, the simulator).
    cpu: dict[str, float] = field(default_factory=dict)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class LoadBalancer:
    """Where each request goes: the gateway, or with no gateway each replica in turn, as a plain load balancer in
    front of replicas spreads requests (a resumed request goes wherever the next turn points, its cached prefix
    or not)."""

    def __init__(self, urls: str | Sequence[str]):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("needs at least one URL")
        self._turn = itertools.count()

    @classmethod
    def of(cls, url: "str | LoadBalancer") -> "LoadBalancer":
        """`url` as a turn: itself when it is one already (run_arm's, shared by realtime and batch)."""
        return url if isinstance(url, LoadBalancer) else cls(url)

    def __call__(self) -> str:
        return self.urls[next(self._turn) % len(self.urls)]


@dataclass
class Streamed:
    """One streamed completion: its status, the text of each token event, the prompt's and the output's token ids
    (vLLM's `return_token_ids`; None where the server sent none), whether it finished, seconds to first text."""

    status: int
    texts: list[str] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = field(default_factory=list)
    finished: bool = False
    first: float | None = None

    @property
    def tokens(self) -> int:
        """Output tokens received: the ids' count where every event carried them (an event may carry several,
        with a stream interval), else one per text event."""
        return len(self.output_ids) if self.output_ids is not None else len(self.texts)


async def stream(session: aiohttp.ClientSession, url: str, body: dict, headers: dict,
                 arrived: Callable[[int], None] | None = None,
                 until: Callable[[Streamed], bool] | None = None) -> Streamed:
    """POST a streamed completion and read it to its end (an error event ends it as evicted: 429; a connection
    broken mid-stream as BROKEN); `arrived` gets each event's new tokens when they come; once `until` says so
    after an event, the connection is closed there (the server aborts the request, as when the gateway evicts
    it). A pooled connection the server had closed before the request went out (its keep-alive ran out) is
    retried once on a new one, as any HTTP client retries a stale connection."""
    start = time.monotonic()
    for stale in (False, True):
        try:
            resp = await session.post(url + "/v1/completions", headers=headers,
                                      json={**body, "stream": True, "return_token_ids": True})
            break
        except aiohttp.ClientConnectionError:  # disconnected, or the body could not be written
            if stale:
                raise
    async with resp:
        out = Streamed(resp.status)
        if resp.status != 200:
            await resp.read()
            return out
        try:
            if await read_events(resp, out, start, arrived, until):
                resp.close()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            out.status = BROKEN
    return out


async def read_events(resp: aiohttp.ClientResponse, out: Streamed, start: float,
                      arrived: Callable[[int], None] | None = None,
                      until: Callable[[Streamed], bool] | None = None) -> bool:
    """The stream's events into `out`, to [DONE] or the gateway's eviction event; True when `until` stopped it
    before its end."""
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            out.status = 429  # the gateway's eviction notice ends the stream
            return False
        for choice in event.get("choices", ()):
            if choice.get("prompt_token_ids"):
                out.prompt_ids = choice["prompt_token_ids"]
            if choice.get("text") is not None:
                if out.first is None:
                    out.first = time.monotonic() - start
                out.texts.append(choice["text"])
                ids = choice.get("token_ids")  # [] on an event with no new token (the last, often)
                out.output_ids = out.output_ids + ids if out.output_ids is not None and ids is not None else None
                if arrived is not None:
                    arrived(len(ids) if ids is not None else 1)
            if choice.get("finish_reason") in ("length", "stop"):
                out.finished = True
        if until is not None and not out.finished and until(out):
            return True
    return False


async def realtime(session, url: str | LoadBalancer, arm: Arm, arrivals: list[float], t0: float,
                   rec: Record) -> None:
    target = LoadBalancer.of(url)
    headers = {"X-Vllm-Priority": "-100"} if arm.gateway is None else {OBJECTIVE_HEADER: "realtime"}

    async def one(at: float, text: str) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        try:
            got = await stream(session, target(), {"model": "tiny", "prompt": text, "max_tokens": 8}, headers)
        except aiohttp.ClientConnectionError:  # dropped twice before an answer: a failed request, not the run's end
            got = Streamed(BROKEN)
        status, first = got.status, got.first
        if status != 200 or first is None:
            rec.realtime_failed += 1
            rec.ttft.append(float("inf"))
        else:
            rec.ttft.append(first)

    rng = random.Random(7)
    await asyncio.gather(*(one(at, prompt(rng, 24)) for at in arrivals))


async def batch(session, url: str | LoadBalancer, arm: Arm, seed: int, window: tuple[float, float], rec: Record,
                tokens: tuple[int, int], stream_interval: int = 1) -> None:
    """One of the batch loops: a request after another until the window ends; an evicted one is resumed as the
    workers resume a completion, from the prompt's and the kept output's token ids (the text where the server
    sent none), for the tokens it still owes. Tokens count when they arrive within the window (an attempt that
    straddles its start or end counts only its part inside), completions when they end within it."""
    target = LoadBalancer.of(url)
    headers = {"X-Vllm-Priority": "10"} if arm.gateway is None else {OBJECTIVE_HEADER: "batch"}
    # vLLM sends a stream's tokens this many at a time (its `stream_interval`; the first and last at once).
    interval = {"stream_interval": stream_interval} if stream_interval > 1 else {}
    def arrived(n: int) -> None:
        if window[0] <= time.monotonic() <= window[1]:
            rec.batch_tokens += n

    rng = random.Random(seed)
    while time.monotonic() < window[1]:
        prompt_now: str | list[int] = prompt(rng, 40)
        owed = rng.randint(*tokens)
        while owed > 0 and time.monotonic() < window[1]:
            try:
                got = await stream(session, target(), {"model": "tiny", "prompt": prompt_now, "max_tokens": owed,
                                                  "ignore_eos": True, **interval}, headers, arrived)
            except aiohttp.ClientConnectionError:
                got = Streamed(BROKEN)  # not even sent twice: this loop tries again shortly, it does not end
                await asyncio.sleep(0.05)
            if got.status == 200 and got.finished:
                if window[0] <= time.monotonic() <= window[1]:
                    rec.batch_completed += 1
                break
            rec.broken += got.status == BROKEN
            if got.status not in (200, 429, BROKEN):
                rec.batch_failed += 1  # refused: this request is given up, the loop goes on with the next
                break
            rec.evictions += got.status == 429
            if got.prompt_ids is not None and got.output_ids is not None:
                prompt_now = got.prompt_ids + got.output_ids
            elif isinstance(prompt_now, str):
                prompt_now += "".join(got.texts)
            owed -= got.tokens


# The engine's running counters read from its /metrics: its steps (each observes vllm:iteration_tokens_total once)
# and the output tokens it generated.
ENGINE_COUNTERS = {"steps": "vllm:iteration_tokens_total_count", "generated": "vllm:generation_tokens_total"}


async def engine_counters(session: aiohttp.ClientSession, engine: str) -> dict[str, float] | None:
    """The engine's ENGINE_COUNTERS so far, from one scrape (None: unreachable, or it reports no steps)."""
    try:
        async with session.get(engine + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        for key, name in ENGINE_COUNTERS.items():
            if line.startswith(name):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out if "steps" in out else None


async def all_counters(session: aiohttp.ClientSession, engines: Sequence[str]) -> dict[str, float] | None:
    """ENGINE_COUNTERS summed over `engines` (None when any cannot say)."""
    out: dict[str, float] = {}
    for counters in await asyncio.gather(*(engine_counters(session, e) for e in engines)):
        if counters is None:
            return None
        for key, value in counters.items():
            out[key] = out.get(key, 0.0) + value
    return out


async def counters_in(session: aiohttp.ClientSession, engine: str | Sequence[str],
                      window: tuple[float, float]) -> dict[str, float] | None:
    """How far the engine's (or the engines' summed) ENGINE_COUNTERS moved between the window's start and end."""
    engines = [engine] if isinstance(engine, str) else list(engine)
    await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
    before = await all_counters(session, engines)
    await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
    after = await all_counters(session, engines)
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in after}


async def run_arm(url: str | Sequence[str], arm: Arm, rnd: int, args: argparse.Namespace,
                  engine: str | Sequence[str] | None = None) -> Record:
    """One run of `arm` against `url` (several: each request to the next in turn); `engine`, the replica or
    replicas behind it, is asked for its step count at the window's start and end."""
    rec = Record(arm.name, rnd)
    arrivals = schedule(args.seed, args.burst, args.rate, args.window)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        t0 = start + (args.lead if arm.batch else 1.0)
        window = (t0, t0 + args.window)
        target = LoadBalancer(url)  # one turn for realtime and batch alike, as one load balancer has
        loops = [asyncio.create_task(batch(session, target, arm, args.seed * 100 + i, window, rec, args.batch_tokens,
                                           args.batch_stream_interval))
                 for i in range(args.batch_inflight if arm.batch else 0)]
        counters = asyncio.create_task(counters_in(session, engine, window)) if engine else None
        await realtime(session, target, arm, arrivals, t0, rec)
        if counters is not None:
            rec.steps = ((await counters) or {}).get("steps")
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    return rec
