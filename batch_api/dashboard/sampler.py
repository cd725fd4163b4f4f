"""The dashboard's history: every ~5 s, the gateway's TTFT p95 per objective over the last interval (from
the histogram's bucket deltas) and how many batch requests completed and failed, kept in Redis.

Samples live in one capped list, `<namespace>:dash:samples` (newest first), so every API server shows the
same history; a per-slot `SET NX` lets only one server sample each interval. The task started by the app's
lifespan never raises: a gateway or database outage only leaves gaps in the charts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
import redis
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from batch_api.context import ApiContext
from batch_api.dashboard.gateway_view import TIMEOUT, Buckets, quantile, ttft_buckets
from holdback.logs import log_event
from holdback.contract import dashboard_samples_key, dashboard_slot_key
from holdback.models import Batch

log = logging.getLogger("batch_api.dashboard.sampler")

INTERVAL = 5.0
WINDOW = 600.0  # what the charts show
KEEP = 240  # samples kept: 20 minutes at the interval


samples_key = dashboard_samples_key
slot_key = dashboard_slot_key


@dataclass
class Sample:
    t: float
    totals: dict[str, int] | None  # requests "completed" and "failed" over all batches, ever (batch counters)
    ttft: dict[str, Buckets] | None  # objective -> cumulative buckets; None: gateway unreachable
    ttft_p95: dict[str, float]  # objective -> seconds, over the interval since the previous sample
    per_s: dict[str, float]  # "completed", "failed" per second over the interval since the previous sample

    def to_json(self) -> str:
        ttft = {o: [[_le(le), n] for le, n in b] for o, b in self.ttft.items()} if self.ttft is not None else None
        return json.dumps({"t": self.t, "totals": self.totals, "ttft": ttft, "ttft_p95": self.ttft_p95,
                           "per_s": self.per_s})

    @classmethod
    def from_json(cls, text: bytes | str) -> "Sample":
        d = json.loads(text)
        ttft = ({o: [(float(le), float(n)) for le, n in b] for o, b in d["ttft"].items()}
                if d.get("ttft") is not None else None)
        return cls(d["t"], d.get("totals"), ttft, d.get("ttft_p95") or {}, d.get("per_s") or {})


def next_sample(now: float, totals: dict[str, int] | None, ttft: dict[str, Buckets] | None,
                previous: Sample | None) -> Sample:
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
    return Sample(now, totals, ttft, p95, rates)


def recent_samples(connection: redis.Redis, namespace: str, window: float = WINDOW) -> list[Sample]:
    """Samples of the last `window` seconds, oldest first."""
    cutoff = time.time() - window
    samples = []
    for raw in connection.lrange(samples_key(namespace), 0, KEEP - 1):
        try:
            sample = Sample.from_json(raw)
        except (ValueError, KeyError, TypeError):
            continue
        if sample.t >= cutoff:
            samples.append(sample)
    return sorted(samples, key=lambda s: s.t)


class Sampler:
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
        ttft = await self._scrape(client)
        totals = await run_in_threadpool(self._totals)
        return await run_in_threadpool(self._record, connection, namespace, totals, ttft)

    async def _scrape(self, client: httpx.AsyncClient) -> dict[str, Buckets] | None:
        try:
            r = await client.get(self.context.settings.gateway_url.rstrip("/") + "/metrics")
            r.raise_for_status()
            return ttft_buckets(r.text)
        except (httpx.HTTPError, ValueError):
            return None  # a gap in the TTFT chart; the gateway page says why

    def _totals(self) -> dict[str, int] | None:
        # The batches' own counters: one small aggregate, whatever the number of request rows.
        try:
            with self.context.sessions() as session:
                completed, failed = session.execute(
                    select(func.coalesce(func.sum(Batch.completed), 0), func.coalesce(func.sum(Batch.failed), 0))
                ).one()
                return {"completed": int(completed), "failed": int(failed)}
        except Exception as exc:  # noqa: BLE001 - a database outage is a gap in the throughput chart
            self.problem = f"database: {type(exc).__name__}: {exc}"
            return None

    @staticmethod
    def _record(connection: redis.Redis, namespace: str, totals: dict[str, int] | None,
                ttft: dict[str, Buckets] | None) -> Sample:
        key = samples_key(namespace)
        last = connection.lindex(key, 0)
        previous = None
        if last is not None:
            try:
                previous = Sample.from_json(last)
            except (ValueError, KeyError, TypeError):
                previous = None
        sample = next_sample(time.time(), totals, ttft, previous)
        with connection.pipeline(transaction=True) as pipe:
            pipe.lpush(key, sample.to_json())
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
