"""What `holdback demo` sends and reads: realtime streams, a batch sent straight to the replicas (the arm with no
controls), the replicas' own gauges and the gateway's admin state.

Every client here streams from one asyncio loop with an unbounded connection pool, so a request is sent when its
time comes: the client never queues its own requests, and a time to first token is the platform's, not the
client's own waiting.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from holdback.contract import CHAT_ENDPOINT, OBJECTIVE_HEADER, REALTIME_OBJECTIVE

UNBOUNDED = httpx.Limits(max_connections=None, max_keepalive_connections=None)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


def _headers(key: str | None, objective: str | None) -> dict[str, str]:
    return {**({OBJECTIVE_HEADER: objective} if objective else {}),
            **({"Authorization": f"Bearer {key}"} if key else {})}


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
        async with httpx.AsyncClient(timeout=120, limits=UNBOUNDED) as client:
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
        s = self.stats
        target = self.targets[s.sent % len(self.targets)]
        s.sent += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        start = time.perf_counter()
        try:
            async with client.stream("POST", f"{target}{CHAT_ENDPOINT.path}", json=body,
                                     headers=_headers(self.key, REALTIME_OBJECTIVE)) as r:
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


@dataclass
class DirectBatch:
    """A batch sent as a script without holdback sends it: `concurrency` streams at once straight to the
    replicas (each in turn), line after line of `bodies` round and round, until stopped. The replicas alone decide
    who runs: vLLM's first-come-first-served, with no priority, no holdback and no eviction."""

    targets: list[str]
    bodies: list[dict]
    concurrency: int
    completed: int = 0
    errors: int = 0
    first_error: str = ""
    _next: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=300, limits=UNBOUNDED) as client:
            lanes = [asyncio.create_task(self._lane(client, stop)) for _ in range(self.concurrency)]
            await stop.wait()
            for lane in lanes:
                lane.cancel()  # a stream cut here is aborted by the replica, as a client that goes away is
            await asyncio.gather(*lanes, return_exceptions=True)

    async def _lane(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            i, self._next = self._next, self._next + 1
            body = {**self.bodies[i % len(self.bodies)], "stream": True}
            target = self.targets[i % len(self.targets)]
            try:
                async with client.stream("POST", f"{target}{CHAT_ENDPOINT.path}", json=body) as r:
                    if r.status_code != 200:
                        raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
                    async for _ in r.aiter_lines():
                        pass
                self.completed += 1
            except httpx.HTTPError as exc:
                self.errors += 1
                self.first_error = self.first_error or f"{exc} from {target}"
                await asyncio.sleep(0.5)  # a replica refusing everything is not hammered in a loop


@dataclass(frozen=True)
class ReplicaGauges:
    """A replica's own gauges: what its scheduler is running and holding, as vLLM reports them."""

    running: float
    waiting: float
    kv_usage: float
    preemptions: float


async def replica_load(client: httpx.AsyncClient, url: str) -> ReplicaGauges:
    r = await client.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.labels.get("reason"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return ReplicaGauges(values.get("vllm:num_requests_running", 0.0), values.get("vllm:num_requests_waiting", 0.0),
                       values.get("vllm:kv_cache_usage_perc", 0.0), values.get("vllm:num_preemptions_total", 0.0))


# -- the gateway's own view --------------------------------------------------------------------------------


class GatewayAdminClient:
    """What the demo reads from the gateway with the admin key: its admin state."""

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

    async def queued(self, client: httpx.AsyncClient) -> int:
        """Requests waiting in the gateway's queues: above zero, the batch fills the pool as far as the gateway
        lets it (its KV admission may stop short of the replica's slots)."""
        r = await client.get(f"{self.url}/admin/state", headers=self.headers, timeout=5)
        r.raise_for_status()
        return int(r.json().get("queued") or 0)
