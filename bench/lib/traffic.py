"""Realtime traffic for the study: an opening burst, then seeded arrivals around a mean rate.

Every request streams; time to first token is measured at the client, from just before the request
is sent to the first SSE chunk that carries content. The schedule depends only on the seed, so every
scenario sees the same traffic.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import aiohttp

from holdback.contract import DROP_REASON_HEADER, OBJECTIVE_HEADER, QUEUE_MS_HEADER


@dataclass
class RealtimeRecord:
    index: int
    scheduled_s: float  # offset from the traffic start in the schedule
    sent_s: float  # offset when actually sent
    status: int
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    prompt_tokens: int
    queue_ms: float | None  # the gateway's x-holdback-queue-ms: arrival to dispatch
    drop_reason: str | None
    error: str | None

    def to_json(self) -> dict:
        return asdict(self)


def schedule(seed: int, burst: int, rate: float, seconds: float) -> list[float]:
    """Send offsets: `burst` at 0, then a Poisson process of `rate` per second until `seconds`."""
    rng = random.Random(seed)
    offsets = [0.0] * burst
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return offsets
        offsets.append(t)


def prompt_text(rng: random.Random, words: int) -> str:
    vocab = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta")
    return " ".join(rng.choice(vocab) for _ in range(words))


@dataclass
class StreamOutcome:
    """What one streamed chat completion came to, seen from the client."""

    status: int  # HTTP status; 0 when the connection failed, 499 when we cancelled it
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    prompt_tokens: int
    queue_ms: float | None
    drop_reason: str | None
    error: str | None


async def stream_chat(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict,
                      cancel_after: float | None = None) -> StreamOutcome:
    """POST a chat completion and read it to the end, or close it `cancel_after` seconds after sending.

    Streams are read chunk by chunk (TTFT is the first content chunk); a non-streaming body (`stream` false)
    is read whole and has no TTFT. An SSE `error` event (a replica failing mid-stream) turns the outcome
    into a 500 with its message.
    """
    sent = time.monotonic()
    state = {"ttft": None, "tokens": 0, "prompt": 0, "queue_ms": None}

    async def read() -> StreamOutcome:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            queue_ms = r.headers.get(QUEUE_MS_HEADER)
            state["queue_ms"] = float(queue_ms) if queue_ms else None
            drop = r.headers.get(DROP_REASON_HEADER)
            if r.status != 200:
                text = await r.text()
                return StreamOutcome(r.status, None, None, 0, 0, state["queue_ms"], drop, text[:200])
            if not body.get("stream"):
                usage = (await r.json()).get("usage") or {}
                return StreamOutcome(200, None, time.monotonic() - sent, int(usage.get("completion_tokens") or 0),
                                     int(usage.get("prompt_tokens") or 0), state["queue_ms"], None, None)
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    message = str((chunk["error"] or {}).get("message"))[:200]
                    return StreamOutcome(500, state["ttft"], None, state["tokens"], state["prompt"],
                                         state["queue_ms"], None, message)
                if state["ttft"] is None and any((c.get("delta") or {}).get("content")
                                                 for c in chunk.get("choices") or []):
                    state["ttft"] = time.monotonic() - sent
                if chunk.get("usage"):
                    state["tokens"] = int(chunk["usage"].get("completion_tokens") or 0)
                    state["prompt"] = int(chunk["usage"].get("prompt_tokens") or 0)
            return StreamOutcome(200, state["ttft"], time.monotonic() - sent, state["tokens"], state["prompt"],
                                 state["queue_ms"], None, None)

    try:
        if cancel_after is None:
            return await read()
        return await asyncio.wait_for(read(), cancel_after)
    except asyncio.TimeoutError:
        if cancel_after is not None and time.monotonic() - sent >= cancel_after * 0.99:
            return StreamOutcome(499, state["ttft"], None, state["tokens"], state["prompt"], state["queue_ms"],
                                 None, "cancelled by the client")
        return StreamOutcome(0, state["ttft"], None, state["tokens"], state["prompt"], None, None, "timeout")
    except (aiohttp.ClientError, ValueError) as exc:
        return StreamOutcome(0, state["ttft"], None, state["tokens"], state["prompt"], None, None, repr(exc)[:200])


async def _one(session: aiohttp.ClientSession, url: str, key: str, objective: str, model: str, prompt: str,
               max_tokens: int, index: int, scheduled: float, t0: float) -> RealtimeRecord:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
    headers = {"Authorization": f"Bearer {key}", OBJECTIVE_HEADER: objective}
    sent = time.monotonic()
    o = await stream_chat(session, url, headers, body)
    return RealtimeRecord(index, scheduled, sent - t0, o.status, o.ttft_s, o.e2e_s, o.output_tokens, o.prompt_tokens,
                          o.queue_ms, o.drop_reason, o.error)


async def run_realtime(url: str, key: str, model: str, offsets: list[float], *, objective: str = "realtime",
                       prompt_words: int, max_tokens: int, seed: int) -> list[RealtimeRecord]:
    rng = random.Random(seed + 1)
    prompts = [prompt_text(rng, prompt_words) for _ in offsets]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                _one(session, url, key, objective, model, prompts[i], max_tokens, i, offset, t0)))
        return list(await asyncio.gather(*tasks))
