"""What runs through a gateway fleet during a drill: realtime clients streaming in a loop, a batch of rows sent
at batch priority by worker-like senders that retry each row until it has one answer, and a sampler of the
replicas' running count. Every outcome is kept, stamped with the monotonic clock, so a drill can ask what happened
to what was running, or was sent, at the moment it struck.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp

from holdback.contract import OBJECTIVE_HEADER, REQUEST_ID_HEADER

RELAY_HEADER = "x-fleet-relay"  # set by the fleet's HAProxy (bench/lib/fleet.py): the relay that answered
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", re.M)
_SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*finished_reason=\"(?:stop|length)\"[^}]*\} ([0-9.e+]+)$", re.M)


def _body(tokens: int, stream: bool, words: int = 24) -> dict:
    return {"model": "sim-model", "prompt": " ".join(["fleet"] * words), "max_tokens": tokens, "ignore_eos": True,
            "stream": stream}


@dataclass
class Stream:
    """One realtime request as its client saw it (times are monotonic)."""

    client: int
    sent: float
    status: int = 0  # 0: the connection failed or broke before an answer
    first: float | None = None  # the first token
    ended: float | None = None
    done: bool = False  # read to `data: [DONE]` with no error event
    tokens: int = 0
    relay: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def cut(self) -> bool:
        """It streamed, then broke before its end."""
        return self.first is not None and not self.done

    def running_at(self, t: float) -> bool:
        """Already streaming at `t`, and not ended before it."""
        return self.first is not None and self.first <= t and (self.ended is None or self.ended > t)


async def _stream(session: aiohttp.ClientSession, url: str, s: Stream, tokens: int) -> Stream:
    """Fill in `s` (kept by the caller from the start: a drill asks what was streaming at an instant)."""
    try:
        async with session.post(url + "/v1/completions", json=_body(tokens, True),
                                headers={OBJECTIVE_HEADER: "realtime"}) as r:
            s.status, s.relay = r.status, r.headers.get(RELAY_HEADER)
            if r.status != 200:
                s.error = (await r.text())[:200]
                return s
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    s.done = s.error is None
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    s.error = str(chunk["error"])[:200]
                    continue
                if s.first is None:
                    s.first = time.monotonic()
                s.tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        s.error = s.error or f"{type(exc).__name__}: {exc}"[:200]
    finally:
        s.ended = time.monotonic()
    return s


@dataclass
class RealtimeClients:
    """`clients` callers, each streaming `tokens`-token completions one after another through `url`."""

    url: str
    clients: int
    tokens: int = 30
    pause: float = 0.05
    streams: list[Stream] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=300, sock_read=180)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i, stop) for i in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            s = Stream(i, time.monotonic())
            self.streams.append(s)
            await _stream(session, self.url, s, self.tokens)
            if s.status != 200:  # a failed caller retries, through the load balancer
                await asyncio.sleep(0.2)
            await asyncio.sleep(self.pause)


@dataclass
class RowAttempt:
    row: int
    sent: float
    ended: float
    status: int  # 0: the connection failed or broke
    relay: str | None
    error: str | None


@dataclass
class BatchRows:
    """`rows` rows sent at batch priority by `senders` worker-like senders through `url`: each row is sent until
    one answer is 200 (an eviction's 429, a 503 or a broken connection is retried after `backoff`)."""

    url: str
    rows: int
    senders: int = 16
    tokens: int = 8
    backoff: float = 0.2
    answers: dict[int, int] = field(default_factory=dict)  # row -> 200 answers it got
    attempts: list[RowAttempt] = field(default_factory=list)

    async def run(self, deadline: float) -> None:
        """Send every row, or give up at `deadline` (monotonic): what has no answer then is lost."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for row in range(self.rows):
            queue.put_nowait(row)
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=timeout) as session:
            await asyncio.gather(*(self._sender(session, queue, deadline) for _ in range(self.senders)))

    async def _sender(self, session: aiohttp.ClientSession, queue: asyncio.Queue[int], deadline: float) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            row = queue.get_nowait()
            while time.monotonic() < deadline:
                attempt = await self._send(session, row)
                self.attempts.append(attempt)
                if attempt.status == 200:
                    self.answers[row] = self.answers.get(row, 0) + 1
                    break
                await asyncio.sleep(self.backoff)

    async def _send(self, session: aiohttp.ClientSession, row: int) -> RowAttempt:
        sent, status, relay, error = time.monotonic(), 0, None, None
        try:
            async with session.post(self.url + "/v1/completions", json=_body(self.tokens, False),
                                    headers={OBJECTIVE_HEADER: "batch", REQUEST_ID_HEADER: f"row-{row}"}) as r:
                status, relay = r.status, r.headers.get(RELAY_HEADER)
                text = await r.text()
                if status != 200:
                    error = text[:200]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status, error = 0, f"{type(exc).__name__}: {exc}"[:200]
        return RowAttempt(row, sent, time.monotonic(), status, relay, error)

    @property
    def done(self) -> int:
        return len(self.answers)

    @property
    def lost(self) -> int:
        return self.rows - len(self.answers)

    @property
    def duplicated(self) -> int:
        return sum(n - 1 for n in self.answers.values() if n > 1)


HELD = 0.25  # seconds over the limit in every sample: requests sent past the slots, not an eviction's hand-on


@dataclass
class RunningSampler:
    """Each replica's `vllm:num_requests_running`, read from its /metrics every `every` seconds.

    An eviction hands its victim's slot on at the decision: the next request may start on the replica a few
    milliseconds before the victim's abort reaches it, so one sample can catch one request more than the slots
    (`blips`). A replica sent more than its slots holds them as long as those requests run (a second or more at the
    drills' sizes), so a count above the limit in every sample for HELD seconds is kept in `over`."""

    replicas: list[str]
    every: float = 0.05
    limit: int = 0  # samples above it: (monotonic time, replica, running)
    peaks: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    over: list[tuple[float, str, int]] = field(default_factory=list)
    blips: list[tuple[float, str, int]] = field(default_factory=list)
    _over_since: dict[str, float] = field(default_factory=dict)  # each replica over the limit since, in a row

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not stop.is_set():
                began = time.monotonic()
                for url in self.replicas:
                    try:
                        async with session.get(url + "/metrics/",
                                               params=[("name[]", "vllm:num_requests_running")]) as r:
                            text = await r.text()
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        continue
                    running = sum(int(float(v)) for v in _RUNNING.findall(text))
                    self.peaks[url] = max(self.peaks.get(url, 0), running)
                    now = time.monotonic()
                    if self.limit and running > self.limit:
                        self.blips.append((now, url, running))
                        if now - self._over_since.setdefault(url, now) >= HELD:
                            self.over.append((now, url, running))  # held, not a blip
                    else:
                        self._over_since.pop(url, None)
                self.samples += 1
                await asyncio.sleep(max(0.0, self.every - (time.monotonic() - began)))


async def replica_successes(replicas: list[str]) -> int:
    """Requests the replicas completed (`vllm:request_success_total` that stopped or reached their length)."""
    total = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in replicas:
            async with session.get(url + "/metrics") as r:
                total += sum(int(float(v)) for v in _SUCCESS.findall(await r.text()))
    return total
