"""The dashboard's history: every ~5 s, the gateway's TTFT p95 per objective over the last interval (from
the histogram's bucket deltas), how many batch requests completed, failed and were cancelled, the gateway's
evictions, each replica's KV cache usage, and the depth of the request queue, kept in Redis.

Samples live in one capped list, `<namespace>:dash:samples` (newest first, six hours), so every API server
shows the same history; a per-slot `SET NX` lets only one server sample each interval. Only the newest
sample keeps the histogram's cumulative buckets (the next one is measured against them); older ones are
stored without, so six hours stay small. The task started by the app's lifespan never raises: a gateway,
database or Redis outage only leaves gaps in the charts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

import httpx
import redis
from starlette.concurrency import run_in_threadpool

from batch_api.context import ApiContext
from batch_api.dashboard.gateway_view import (TIMEOUT, Buckets, GatewayView, pool_sections, quantile,
                                              read_metrics)
from batch_api.dashboard.outcomes import outcome_totals
from holdback import jobs
from holdback.logs import log_event
from holdback.contract import dashboard_samples_key, dashboard_slot_key, requests_queue_name

log = logging.getLogger("batch_api.dashboard.sampler")

INTERVAL = 5.0
WINDOW = 900.0  # what the charts show unless asked for another range
HISTORY = 6 * 3600.0
KEEP = int(HISTORY / INTERVAL) + 12  # samples kept: six hours at the interval


samples_key = dashboard_samples_key
slot_key = dashboard_slot_key


@dataclass
class Sample:
    t: float
    # Counters that only grow, each measured as a rate against the previous sample: "completed", "failed"
    # (not cancelled) and "cancelled" requests of all batches (their counters), "evictions" the gateway issued.
    totals: dict[str, int] | None  # None: the database did not answer
    ttft: dict[str, Buckets] | None  # objective -> cumulative buckets; None: gateway unreachable (or compacted)
    ttft_p95: dict[str, float]  # objective -> seconds, over the interval since the previous sample
    per_s: dict[str, float]  # each total's increase per second since the previous sample
    kv: dict[str, float] = field(default_factory=dict)  # replica -> KV cache usage in [0, 1]
    depth: dict[str, int] = field(default_factory=dict)  # "queued", "retrying" (RQ), "gateway" (its queue)

    def to_json(self) -> str:
        ttft = {o: [[_le(le), n] for le, n in b] for o, b in self.ttft.items()} if self.ttft is not None else None
        return json.dumps({"t": self.t, "totals": self.totals, "ttft": ttft, "ttft_p95": self.ttft_p95,
                           "per_s": self.per_s, "kv": self.kv, "depth": self.depth})

    def compact(self) -> "Sample":
        """What history keeps: everything but the cumulative buckets."""
        return replace(self, ttft=None)

    @classmethod
    def from_json(cls, text: bytes | str) -> "Sample":
        d = json.loads(text)
        ttft = ({o: [(float(le), float(n)) for le, n in b] for o, b in d["ttft"].items()}
                if d.get("ttft") is not None else None)
        return cls(d["t"], d.get("totals"), ttft, d.get("ttft_p95") or {}, d.get("per_s") or {},
                   d.get("kv") or {}, d.get("depth") or {})


def next_sample(now: float, totals: dict[str, int] | None, ttft: dict[str, Buckets] | None,
                previous: Sample | None, kv: dict[str, float] | None = None,
                depth: dict[str, int] | None = None) -> Sample:
    """A sample whose per-interval values are measured against the previous one."""
    p95: dict[str, float] = {}
    rates: dict[str, float] = {}
    if previous is not None and now - previous.t <= 4 * INTERVAL:
        if ttft is not None and previous.ttft is not None:
            for objective, buckets in ttft.items():
                value = quantile(0.95, buckets, previous.ttft.get(objective) or [(le, 0.0) for le, _ in buckets])
                if value is not None:
                    p95[objective] = value
        if totals is not None and previous.totals is not None and now > previous.t:
            for name, total in totals.items():
                rates[name] = max(0, total - previous.totals.get(name, total)) / (now - previous.t)
    return Sample(now, totals, ttft, p95, rates, dict(kv or {}), dict(depth or {}))


def recent_samples(connection: redis.Redis, namespace: str, window: float = WINDOW) -> list[Sample]:
    """Samples of the last `window` seconds, oldest first."""
    cutoff = time.time() - window
    samples = []
    wanted = min(KEEP, int(window / INTERVAL) + 12)
    for raw in connection.lrange(samples_key(namespace), 0, wanted - 1):
        try:
            sample = Sample.from_json(raw)
        except (ValueError, KeyError, TypeError):
            continue
        if sample.t >= cutoff:
            samples.append(sample)
    return sorted(samples, key=lambda s: s.t)


class DashboardSampler:
    """One per API process; `run()` is its background task."""

    def __init__(self, context: ApiContext, interval: float = INTERVAL):
        self.context = context
        self.interval = interval
        self.failing: str | None = None
        self.problem: str | None = None  # of the current round

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            while True:
                self.problem = None
                try:
                    await self.sample_once(client)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the sampler must outlive any outage
                    self.problem = f"{type(exc).__name__}: {exc}"
                self._report(self.problem)
                await asyncio.sleep(self.interval - time.time() % self.interval)

    async def sample_once(self, client: httpx.AsyncClient) -> Sample | None:
        """Take this interval's sample unless another API server already did."""
        context, namespace = self.context, self.context.settings.redis_namespace
        connection = context.redis
        if connection is None:
            return None
        slot = int(time.time() // self.interval)
        claimed = await run_in_threadpool(connection.set, slot_key(namespace, slot), "1", nx=True,
                                          ex=int(self.interval * 4) + 1)
        if not claimed:
            return None
        gateway = await self._scrape(client)
        kv, gateway_queued = await self._state(client) if gateway is not None else ({}, None)
        totals = await run_in_threadpool(self._totals)
        if totals is not None and gateway is not None:
            totals["evictions"] = gateway.evictions.get("issued", 0)
        depth = await run_in_threadpool(self._depth, connection, namespace)
        if gateway_queued is not None:
            depth["gateway"] = gateway_queued
        return await run_in_threadpool(self._record, connection, namespace, totals,
                                       gateway.ttft if gateway is not None else None, kv, depth)

    async def _scrape(self, client: httpx.AsyncClient) -> GatewayView | None:
        view = GatewayView(self.context.settings.gateway_url.rstrip("/"))
        try:
            r = await client.get(view.url + "/metrics")
            r.raise_for_status()
            read_metrics(view, r.text)
            return view
        except (httpx.HTTPError, ValueError):
            return None  # a gap in the gateway's charts; the gateway page says why

    async def _state(self, client: httpx.AsyncClient) -> tuple[dict[str, float], int | None]:
        """Each replica's KV usage and the gateway's queue, of every pool, from its /admin/state (which may need
        the key)."""
        key = self.context.settings.admin_key
        try:
            r = await client.get(self.context.settings.gateway_url.rstrip("/") + "/admin/state",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
            r.raise_for_status()
            pools = pool_sections(r.json())
            kv = {str(rep["url"]): float(rep["kv_usage"]) for pool in pools for rep in pool.get("replicas") or []
                  if rep.get("kv_usage") is not None}
            return kv, sum(int(pool.get("queued") or 0) for pool in pools)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return {}, None

    def _totals(self) -> dict[str, int] | None:
        # The batches' own counters: one small aggregate, whatever the number of request rows.
        try:
            with self.context.sessions() as session:
                totals = outcome_totals(session)
            return {"completed": totals["succeeded"], "failed": totals["failed"], "cancelled": totals["cancelled"]}
        except Exception as exc:  # noqa: BLE001 - a database outage is a gap in the throughput chart
            self.problem = f"database: {type(exc).__name__}: {exc}"
            return None

    def _depth(self, connection: redis.Redis, namespace: str) -> dict[str, int]:
        try:
            counts = jobs.queue_counts(connection, requests_queue_name(namespace))
            return {"queued": int(counts["queued"]), "retrying": int(counts["scheduled"])}
        except (redis.RedisError, KeyError) as exc:
            self.problem = f"redis: {type(exc).__name__}: {exc}"
            return {}

    @staticmethod
    def _record(connection: redis.Redis, namespace: str, totals: dict[str, int] | None,
                ttft: dict[str, Buckets] | None, kv: dict[str, float] | None = None,
                depth: dict[str, int] | None = None) -> Sample:
        key = samples_key(namespace)
        last = connection.lindex(key, 0)
        previous = None
        if last is not None:
            try:
                previous = Sample.from_json(last)
            except (ValueError, KeyError, TypeError):
                previous = None
        sample = next_sample(time.time(), totals, ttft, previous, kv, depth)
        with connection.pipeline(transaction=True) as pipe:
            pipe.lpush(key, sample.to_json())
            if previous is not None:
                pipe.lset(key, 1, previous.compact().to_json())  # its buckets served their one purpose
            pipe.ltrim(key, 0, KEEP - 1)
            pipe.execute()
        return sample

    def _report(self, failure: str | None) -> None:
        # One log line per change of state, not one every interval of an outage.
        if failure != self.failing:
            if failure is None:
                log_event(log, "dashboard.sampler_recovered")
            else:
                log_event(log, "dashboard.sampler_failing", level=logging.WARNING, error=failure)
            self.failing = failure


def _le(value: float) -> float | str:
    return "+Inf" if value == float("inf") else value
