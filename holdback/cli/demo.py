"""`holdback demo`: show holdback and eviction happen on a running `holdback up`.

It submits a sample batch (the chat lines of examples/requests.jsonl, repeated) through the Batch API
with the official `openai` client, then sends an opening burst and a steady stream of realtime streaming
requests through the gateway, and shows batch progress, realtime p95 time to first token as this client
saw it beside the gateway's own p95 for the same streams, and the gateway's evictions so far.

Realtime requests go out from one asyncio loop with an unbounded connection pool, so a burst is sent at
once: the client never queues its own requests, and its TTFT is the platform's, not its own waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from holdback.contract import OBJECTIVE_HEADER, REALTIME_OBJECTIVE
from holdback.env_flags import flags_from_env
from holdback.progress import Progress
from holdback.settings import Settings
from holdback.cli.up import EXAMPLE_REQUESTS, LOCAL_KEYS

TERMINAL = ("completed", "failed", "expired", "cancelled")
TTFT_METRIC = "holdback_gateway_ttft_seconds"
FALLBACK_PROMPT = [{"role": "user", "content": "Summarise document number {i} in detail."}]


@dataclass
class RealtimeStats:
    """Counts of one traffic run; `finished` = every stream that ended, with or without a first token."""

    ttfts: list[float] = field(default_factory=list)
    sent: int = 0
    finished: int = 0
    errors: int = 0
    max_in_flight: int = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.finished

    def p95_ms(self) -> float | None:
        return quantile(self.ttfts, 0.95) * 1000 if self.ttfts else None


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class RealtimeTraffic:
    """An opening burst, then seeded Poisson arrivals at `rate` per second for `seconds`."""

    gateway: str
    key: str
    model: str
    burst: int
    rate: float
    seconds: float
    max_tokens: int = 16
    seed: int = 7
    stats: RealtimeStats = field(default_factory=RealtimeStats)

    async def run(self) -> RealtimeStats:
        rng = random.Random(self.seed)
        # No pool limit: a request never waits for a free connection inside this client.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            tasks = [asyncio.create_task(self._one(client)) for _ in range(self.burst)]
            loop = asyncio.get_running_loop()
            end = loop.time() + self.seconds
            while self.rate > 0:
                pause = rng.expovariate(self.rate)
                if loop.time() + pause >= end:
                    break
                await asyncio.sleep(pause)
                tasks.append(asyncio.create_task(self._one(client)))
            await asyncio.gather(*tasks)
        return self.stats

    async def _one(self, client: httpx.AsyncClient) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "Say hello to the realtime path."}]}
        headers = {"Authorization": f"Bearer {self.key}", OBJECTIVE_HEADER: REALTIME_OBJECTIVE}
        s = self.stats
        s.sent += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        start = time.perf_counter()
        try:
            async with client.stream("POST", f"{self.gateway}/v1/chat/completions", json=body,
                                     headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    s.errors += 1
                    return
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data:"):
                        first = False
                        s.ttfts.append(time.perf_counter() - start)
        except httpx.HTTPError:
            s.errors += 1
        finally:
            s.finished += 1


# -- the gateway's own view --------------------------------------------------------------------------------


def ttft_buckets(metrics_text: str, objective: str = REALTIME_OBJECTIVE) -> dict[float, float]:
    """Cumulative counts of the gateway's TTFT histogram for one objective, by upper bound (streamed and
    non-streamed answers together)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != TTFT_METRIC:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("objective") == objective:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> tuple[float, int] | None:
    """The q-quantile (seconds) of what the histogram counted between two scrapes, interpolated within its
    bucket as Prometheus's histogram_quantile does, and how many observations that was."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not bounds or counts[-1] <= 0:
        return None
    total = counts[-1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower, int(total)  # past the last finite bucket: its bound is all we know
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0), int(total)
        lower, below = bound, cumulative
    return None


class GatewayView:
    def __init__(self, url: str, admin_key: str):
        self.url = url
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.baseline: dict[float, float] = {}

    async def evictions(self, client: httpx.AsyncClient) -> tuple[int | None, str]:
        """Evictions the gateway has issued since it started, or None with the reason it cannot tell."""
        try:
            r = await client.get(f"{self.url}/admin/state", headers=self.headers, timeout=5)
            r.raise_for_status()
            totals = r.json().get("totals") or {}
        except (httpx.HTTPError, ValueError) as exc:
            return None, f"{type(exc).__name__}"
        return int((totals.get("evictions") or {}).get("issued", 0)), ""

    async def buckets(self, client: httpx.AsyncClient) -> dict[float, float]:
        try:
            r = await client.get(f"{self.url}/metrics", headers=self.headers, timeout=5)
            r.raise_for_status()
        except httpx.HTTPError:
            return {}
        return ttft_buckets(r.text)

    async def p95(self, client: httpx.AsyncClient) -> tuple[float, int] | None:
        return histogram_quantile(0.95, self.baseline, await self.buckets(client))


# -- the command ---------------------------------------------------------------------------------------------


def sample_batch(model: str, n: int, max_tokens: int, example: Path = EXAMPLE_REQUESTS) -> bytes:
    """n chat requests whose messages cycle through the chat lines of examples/requests.jsonl."""
    prompts = []
    if example.exists():
        prompts = [json.loads(x)["body"]["messages"] for x in example.read_text().splitlines()
                   if x.strip() and json.loads(x)["url"] == "/v1/chat/completions"]
    lines = []
    for i in range(n):
        messages = prompts[i % len(prompts)] if prompts else [
            {**m, "content": m["content"].format(i=i)} for m in FALLBACK_PROMPT]
        lines.append(json.dumps({"custom_id": f"demo-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": model, "max_tokens": max_tokens, "messages": messages}}))
    return ("\n".join(lines) + "\n").encode()


def _parser(settings: Settings) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-url", default="http://127.0.0.1:8000", help="Batch API base URL (default %(default)s)")
    p.add_argument("--gateway-url", default="http://127.0.0.1:8200", help="gateway base URL (default %(default)s)")
    p.add_argument("--keys", type=Path, default=settings.data_dir / LOCAL_KEYS,
                   help="keys file written by `holdback up` (default %(default)s)")
    p.add_argument("--requests", type=int, default=400, help="batch size (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="batch output length (default %(default)s)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds the batch runs alone before realtime traffic starts (default %(default)s)")
    p.add_argument("--realtime-seconds", type=float, default=30.0,
                   help="how long realtime arrivals go on after the burst (default %(default)s)")
    p.add_argument("--realtime-rate", type=float, default=4.0, help="realtime arrivals per second (default %(default)s)")
    p.add_argument("--burst", type=int, default=64,
                   help="realtime opening burst; above the pool's realtime reserve it forces evictions "
                        "(default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up waiting for the batch after this many seconds (default %(default)s)")
    return flags_from_env(p, "demo")


def main(argv: list[str]) -> int:
    settings = Settings()
    p = _parser(settings)
    args = p.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if min(args.burst, args.realtime_rate, args.realtime_seconds, args.warmup) < 0:
        p.error("--burst, --realtime-rate, --realtime-seconds and --warmup must not be negative")
    if not args.keys.exists():
        p.error(f"no keys file at {args.keys}: start the platform with `holdback up` (or `make up`) first, "
                "from the same directory or with the same HOLDBACK_DATA_DIR")
    try:
        import openai  # noqa: F401  (the demo shows the official client)
    except ImportError:
        p.error("holdback demo uses the official openai client: pip install 'holdback[demo]'")
    return asyncio.run(_run(args, json.loads(args.keys.read_text())))


async def _run(args: argparse.Namespace, keys: dict[str, str]) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{args.api_url}/v1", api_key=keys["tenant"])
    gateway = GatewayView(args.gateway_url, keys["admin"])
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{args.gateway_url}/v1/models", timeout=10,
                                 headers={"Authorization": f"Bearer {keys['realtime']}"})).json()
        model = models["data"][0]["id"]
        upload = await client.files.create(file=("demo.jsonl", sample_batch(model, args.requests, args.max_tokens)),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"source": "holdback demo"})
        print(f"submitted {batch.id}: {args.requests} requests, max_tokens={args.max_tokens}, model={model}")
        print(f"the batch runs alone for {args.warmup:g} s, then {args.burst} realtime streams at once and "
              f"{args.realtime_rate:g}/s for {args.realtime_seconds:g} s")
        gateway.baseline = await gateway.buckets(http)
        traffic = RealtimeTraffic(args.gateway_url, keys["realtime"], model, args.burst, args.realtime_rate,
                                  args.realtime_seconds)
        progress = Progress(args.requests, "requests")
        started = time.monotonic()
        deadline = started + args.timeout
        realtime: asyncio.Task | None = None
        while True:
            if realtime is None and time.monotonic() - started >= args.warmup:
                realtime = asyncio.create_task(traffic.run())
            batch = await client.batches.retrieve(batch.id)
            done_all = batch.status in TERMINAL and realtime is not None and realtime.done()
            progress.update(_done(batch), await _status(batch, traffic.stats, gateway, http), force=done_all)
            if done_all:
                break
            if time.monotonic() > deadline:
                progress.close()
                print(f"batch still {batch.status} after {args.timeout:.0f}s; it keeps running, check the dashboard")
                return 1
            await asyncio.sleep(0.5)
        progress.close()
        await realtime  # re-raises anything the traffic task raised
        stats = traffic.stats
        evictions, why = await gateway.evictions(http)
        gateway_p95 = await gateway.p95(http)
    print(f"batch {batch.id} {batch.status}: {batch.request_counts.completed} completed, "
          f"{batch.request_counts.failed} failed; output file {batch.output_file_id}, error file {batch.error_file_id}")
    if batch.usage:
        print(f"usage: {batch.usage.input_tokens} input + {batch.usage.output_tokens} output tokens")
    print(f"realtime: {stats.finished} streams, {len(stats.ttfts)} with a first token, {stats.errors} errors; "
          f"{_ttft_text(stats, gateway_p95)}")
    print(f"gateway evictions: {evictions if evictions is not None else f'unknown ({why})'}")
    print(f"see {args.api_url}/dashboard (admin key in {args.keys})")
    return 0 if batch.status == "completed" else 1


def _done(batch) -> int:  # noqa: ANN001
    counts = batch.request_counts
    return (counts.completed + counts.failed) if counts else 0


async def _status(batch, stats: RealtimeStats, gateway: GatewayView, http: httpx.AsyncClient) -> str:  # noqa: ANN001
    failed = batch.request_counts.failed if batch.request_counts else 0
    evictions, why = await gateway.evictions(http)
    realtime = "realtime waiting" if not stats.sent else (
        f"realtime {stats.finished} done, {stats.in_flight} in flight; {_ttft_text(stats, None)}")
    shown = evictions if evictions is not None else f"unknown ({why})"
    return f"{batch.status}, {failed} failed | {realtime} | evictions {shown}"


def _ttft_text(stats: RealtimeStats, gateway_p95: tuple[float, int] | None) -> str:
    client = stats.p95_ms()
    text = f"p95 TTFT {client:.0f} ms (client)" if client is not None else "no first token yet"
    if gateway_p95 is not None:
        text += f", {gateway_p95[0] * 1000:.0f} ms (gateway's histogram, {gateway_p95[1]} streams)"
    return text
