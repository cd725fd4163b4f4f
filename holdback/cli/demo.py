"""`holdback demo`: show holdback and eviction happen on a running `holdback up`.

It measures realtime alone first: an opening burst and a steady stream of realtime streaming requests through
the gateway, with no batch. Then it submits a sample batch (the chat lines of examples/requests.jsonl, repeated)
through the Batch API with the official `openai` client and sends the same realtime traffic twice while the
batch runs: through the gateway (with holdback), then straight to the replicas (no holdback: no priority, no
reserve, no eviction; the batch itself still goes through the gateway, so it holds no more than its ceiling of
the pool). It shows batch progress, each phase's realtime p95 time to first token as this client saw it (beside
the gateway's own p95 for the streams it carried) and the gateway's evictions.

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

from holdback.contract import CHAT_ENDPOINT, OBJECTIVE_HEADER, REALTIME_OBJECTIVE
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
    first_error: str = ""

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
    """An opening burst, then seeded Poisson arrivals at `rate` per second for `seconds`, sent to `targets` in
    turn (the gateway, or each replica: a key is sent only when there is one)."""

    targets: list[str]
    key: str | None
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
        headers = {OBJECTIVE_HEADER: REALTIME_OBJECTIVE, **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        s = self.stats
        target = self.targets[s.sent % len(self.targets)]
        s.sent += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        start = time.perf_counter()
        try:
            async with client.stream("POST", f"{target}{CHAT_ENDPOINT.path}", json=body, headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    s.errors += 1
                    s.first_error = s.first_error or f"HTTP {r.status_code} from {target}: {text[:200]}"
                    return
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data:"):
                        first = False
                        s.ttfts.append(time.perf_counter() - start)
        except httpx.HTTPError as exc:
            s.errors += 1
            s.first_error = s.first_error or f"{type(exc).__name__} from {target}"
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


class GatewayAdminClient:
    """What the demo reads from the gateway with the admin key: its admin state and its metrics."""

    def __init__(self, url: str, admin_key: str):
        self.url = url
        self.headers = {"Authorization": f"Bearer {admin_key}"}

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

    async def replicas(self, client: httpx.AsyncClient) -> list[str]:
        """The healthy replicas' base URLs, as the gateway's admin state lists them."""
        r = await client.get(f"{self.url}/admin/state", headers=self.headers, timeout=10)
        r.raise_for_status()
        return [rep["url"] for rep in r.json().get("replicas") or [] if rep.get("healthy")]


# -- the command ---------------------------------------------------------------------------------------------


def sample_batch(model: str, n: int, max_tokens: int, example: Path = EXAMPLE_REQUESTS) -> bytes:
    """n chat requests whose messages cycle through the chat lines of examples/requests.jsonl."""
    prompts = []
    if example.exists():
        prompts = [json.loads(x)["body"]["messages"] for x in example.read_text().splitlines()
                   if x.strip() and json.loads(x)["url"] == CHAT_ENDPOINT.path]
    lines = []
    for i in range(n):
        messages = prompts[i % len(prompts)] if prompts else [
            {**m, "content": m["content"].format(i=i)} for m in FALLBACK_PROMPT]
        lines.append(json.dumps({"custom_id": f"demo-{i}", "method": "POST", "url": CHAT_ENDPOINT.path,
                                 "body": {"model": model, "max_tokens": max_tokens, "messages": messages}}))
    return ("\n".join(lines) + "\n").encode()


def _parser(settings: Settings) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-url", default="http://127.0.0.1:8000", help="Batch API base URL (default %(default)s)")
    p.add_argument("--gateway-url", default="http://127.0.0.1:8200", help="gateway base URL (default %(default)s)")
    p.add_argument("--keys", type=Path, default=settings.data_dir / LOCAL_KEYS,
                   help="keys file written by `holdback up` (default %(default)s)")
    p.add_argument("--requests", type=int, default=2000,
                   help="batch size: enough to outlast both realtime phases beside it (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="batch output length (default %(default)s)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds the batch runs alone before realtime traffic starts (default %(default)s)")
    p.add_argument("--realtime-seconds", type=float, default=15.0,
                   help="how long realtime arrivals go on after the burst, in each of the three phases "
                        "(default %(default)s)")
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


@dataclass
class Phase:
    """One run of the realtime traffic: where it went, and what it measured."""

    title: str
    traffic: RealtimeTraffic
    through_gateway: bool
    beside_batch: bool
    gateway_p95: tuple[float, int] | None = None
    batch_ended_during: bool = False


def _traffic(args: argparse.Namespace, targets: list[str], key: str | None, model: str) -> RealtimeTraffic:
    return RealtimeTraffic(targets, key, model, args.burst, args.realtime_rate, args.realtime_seconds)


async def _measure(phase: Phase, gateway: GatewayAdminClient, http: httpx.AsyncClient) -> None:
    before = await gateway.buckets(http) if phase.through_gateway else {}
    await phase.traffic.run()
    if phase.through_gateway:
        phase.gateway_p95 = histogram_quantile(0.95, before, await gateway.buckets(http))


async def _run(args: argparse.Namespace, keys: dict[str, str]) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{args.api_url}/v1", api_key=keys["tenant"])
    gateway = GatewayAdminClient(args.gateway_url, keys["admin"])
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{args.gateway_url}/v1/models", timeout=10,
                                 headers={"Authorization": f"Bearer {keys['realtime']}"})).json()
        model = models["data"][0]["id"]
        replicas = await gateway.replicas(http)
        if not replicas:
            print(f"the gateway at {args.gateway_url} has no healthy replica; wait for one (see its /admin/state)")
            return 1
        alone = Phase("alone, before the batch", _traffic(args, [args.gateway_url], keys["realtime"], model),
                      through_gateway=True, beside_batch=False)
        beside = [Phase("beside the batch, through holdback",
                        _traffic(args, [args.gateway_url], keys["realtime"], model), True, True),
                  Phase("beside the batch, straight to the replicas (no holdback)",
                        _traffic(args, replicas, None, model), False, True)]
        print(f"realtime alone: {args.burst} streams at once, then {args.realtime_rate:g}/s for "
              f"{args.realtime_seconds:g} s, through the gateway with no batch")
        await _measure(alone, gateway, http)
        print(f"  {_ttft_text(alone.traffic.stats, alone.gateway_p95)}")
        upload = await client.files.create(file=("demo.jsonl", sample_batch(model, args.requests, args.max_tokens)),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT_ENDPOINT.path,
                                            completion_window="24h", metadata={"source": "holdback demo"})
        print(f"submitted {batch.id}: {args.requests} requests, max_tokens={args.max_tokens}, model={model}")
        print(f"the batch runs alone for {args.warmup:g} s, then the same realtime traffic through the gateway, then "
              f"straight to the {len(replicas)} replicas")
        progress = Progress(args.requests, "requests")
        started = time.monotonic()
        deadline = started + args.timeout
        running: asyncio.Task | None = None
        pending = list(beside)
        current: Phase | None = None
        while True:
            batch = await client.batches.retrieve(batch.id)
            if (running is None or running.done()) and pending and time.monotonic() - started >= args.warmup:
                if running is not None:
                    await running  # re-raises anything the traffic task raised
                current = pending.pop(0)
                running = asyncio.create_task(_measure(current, gateway, http))
            if current is not None and not running.done() and batch.status in TERMINAL:
                current.batch_ended_during = True  # (or it had ended before this phase began)
            done_all = batch.status in TERMINAL and not pending and running is not None and running.done()
            progress.update(_done(batch), await _status(batch, current, gateway, http), force=done_all)
            if done_all:
                break
            if time.monotonic() > deadline:
                progress.close()
                print(f"batch still {batch.status} after {args.timeout:.0f}s; it keeps running, check the dashboard")
                return 1
            await asyncio.sleep(0.5)
        progress.close()
        await running
        evictions, why = await gateway.evictions(http)
    print(f"batch {batch.id} {batch.status}: {batch.request_counts.completed} completed, "
          f"{batch.request_counts.failed} failed; output file {batch.output_file_id}, error file {batch.error_file_id}")
    if batch.usage:
        print(f"usage: {batch.usage.input_tokens} input + {batch.usage.output_tokens} output tokens")
    print(f"realtime p95 time to first token, measured by this client in this run "
          f"({args.burst} streams at once, then {args.realtime_rate:g}/s for {args.realtime_seconds:g} s each):")
    for phase in (alone, *beside):
        stats = phase.traffic.stats
        print(f"  {phase.title + ':':<58} {_ttft_text(stats, phase.gateway_p95)}")
        print(f"  {'':<58} {stats.finished} streams, {len(stats.ttfts)} with a first token, {stats.errors} errors"
              + (f" (first: {stats.first_error})" if stats.first_error else ""))
        if phase.batch_ended_during:
            print(f"  {'':<58} the batch ended before this phase did, so part of it ran alone: raise --requests")
    print(f"gateway evictions: {evictions if evictions is not None else f'unknown ({why})'}")
    print(f"see {args.api_url}/dashboard (admin key in {args.keys})")
    return 0 if batch.status == "completed" else 1


def _done(batch) -> int:  # noqa: ANN001
    counts = batch.request_counts
    return (counts.completed + counts.failed) if counts else 0


async def _status(batch, phase: Phase | None, gateway: GatewayAdminClient,  # noqa: ANN001
                  http: httpx.AsyncClient) -> str:
    failed = batch.request_counts.failed if batch.request_counts else 0
    evictions, why = await gateway.evictions(http)
    if phase is None:
        realtime = "realtime waiting"
    else:
        stats = phase.traffic.stats
        realtime = (f"realtime {'via gateway' if phase.through_gateway else 'direct'} {stats.finished} done, "
                    f"{stats.in_flight} in flight; {_ttft_text(stats, None)}")
    shown = evictions if evictions is not None else f"unknown ({why})"
    return f"{batch.status}, {failed} failed | {realtime} | evictions {shown}"


def _ttft_text(stats: RealtimeStats, gateway_p95: tuple[float, int] | None) -> str:
    client = stats.p95_ms()
    text = f"p95 TTFT {client:.0f} ms (client)" if client is not None else "no first token yet"
    if gateway_p95 is not None:
        text += f", {gateway_p95[0] * 1000:.0f} ms (gateway's histogram, {gateway_p95[1]} streams)"
    return text
