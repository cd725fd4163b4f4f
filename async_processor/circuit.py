"""The gateway circuit shared by every worker: while the way to the replicas is down, nobody claims new jobs.

One Redis key, `<namespace>:circuit:gateway`, holds why the circuit opened; while it exists every worker's
claim loop waits (requests already in flight carry on). Any worker that sees a failing path
(`holdback.attempts.is_path_failure`) probes the gateway with `GET /v1/models` and its key; if the probe
fails as well, it opens the circuit. While open, one worker at a time (lock `<key>:probe`) probes every
interval, and the first answer that is not a path failure deletes the key. A failing probe renews the key's
TTL, so a circuit whose workers all died closes by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from async_processor.log import logger
from async_processor.metrics import WorkerMetrics
from holdback.contract import DROP_REASON_HEADER, circuit_key
from holdback.attempts import is_path_failure
from holdback.logs import log_event

PROBE_PATH = "/v1/models"  # answered by the gateway (503 with no healthy replica) and by vLLM itself
PROBE_TIMEOUT = 5.0
CHECK_INTERVAL = 0.5  # seconds a worker trusts its last read of the key


class GatewayCircuit:
    """One worker's view of the shared circuit: read it before claiming, report path failures, probe."""

    def __init__(self, redis: aioredis.Redis, namespace: str, worker_name: str, gateway_url: str,
                 gateway_key: str | None, metrics: WorkerMetrics, probe_interval: float = 1.0):
        self.redis = redis
        self.key = circuit_key(namespace)
        self.lock_key = f"{self.key}:probe"
        self.worker_name = worker_name
        self.probe_url = gateway_url.rstrip("/") + PROBE_PATH
        self.headers = {"authorization": f"Bearer {gateway_key}"} if gateway_key else {}
        self.metrics = metrics
        self.probe_interval = probe_interval
        self.open_ttl = max(30, int(10 * probe_interval))
        self.open = False
        self._checked_at = float("-inf")
        self._last_probe = float("-inf")
        self._probe_task: asyncio.Task | None = None

    async def is_open(self) -> bool:
        """Whether claiming should wait; Redis is read at most every CHECK_INTERVAL."""
        now = time.monotonic()
        if now - self._checked_at >= CHECK_INTERVAL:
            self._checked_at = now
            self._set_open(bool(await self.redis.exists(self.key)))
        return self.open

    def suspect(self, http: aiohttp.ClientSession, reason: str) -> None:
        """A request met a failing path: probe (once per interval per worker) and open the circuit if the
        gateway fails the probe too. One request's bad luck does not stop the fleet."""
        now = time.monotonic()
        if self.open or now - self._last_probe < self.probe_interval:
            return
        if self._probe_task is not None and not self._probe_task.done():
            return
        self._last_probe = now
        self._probe_task = asyncio.create_task(self._confirm(http, reason))

    async def _confirm(self, http: aiohttp.ClientSession, reason: str) -> None:
        failure = await self.probe(http)
        if failure is None:
            return
        try:
            opened = await self.redis.set(self.key, f"{reason}; probe: {failure}", ex=self.open_ttl, nx=True)
        except RedisError as exc:
            log_event(logger, "circuit_write_failed", level=logging.WARNING, worker=self.worker_name, error=str(exc))
            return
        self._set_open(True)
        self._checked_at = time.monotonic()
        if opened:
            log_event(logger, "circuit_opened", level=logging.WARNING, worker=self.worker_name, reason=reason,
                      probe=failure)

    async def probe(self, http: aiohttp.ClientSession) -> str | None:
        """None if the gateway answers as a working path would, else what failed."""
        try:
            async with http.get(self.probe_url, headers=self.headers,
                                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as resp:
                await resp.read()
                drop_reason = resp.headers.get(DROP_REASON_HEADER)
                down = is_path_failure(resp.status, drop_reason)
                failure = f"HTTP {resp.status}" + (f" {drop_reason}" if drop_reason else "") if down else None
        except aiohttp.ClientConnectorError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            # Reachable but not answering in time: not proof of an outage, but no proof of health either.
            failure = f"{type(exc).__name__}: {exc}"
        self.metrics.circuit_probes.labels("down" if failure else "up").inc()
        return failure

    async def watch(self, http: aiohttp.ClientSession, closing: asyncio.Event) -> None:
        """While the circuit is open, take turns at probing; close it on the first healthy answer."""
        while not closing.is_set():
            try:
                if await self.is_open() and await self.redis.set(
                        self.lock_key, self.worker_name, px=int(self.probe_interval * 1000), nx=True):
                    failure = await self.probe(http)
                    if failure is None:
                        await self.redis.delete(self.key)
                        self._set_open(False)
                        log_event(logger, "circuit_closed", worker=self.worker_name)
                    else:
                        await self.redis.expire(self.key, self.open_ttl)
            except RedisError as exc:
                log_event(logger, "circuit_check_failed", level=logging.WARNING, worker=self.worker_name,
                          error=str(exc))
            try:
                await asyncio.wait_for(closing.wait(), timeout=min(CHECK_INTERVAL, self.probe_interval))
            except asyncio.TimeoutError:
                pass

    def _set_open(self, value: bool) -> None:
        self.open = value
        self.metrics.circuit_open.set(1 if value else 0)

    async def close(self) -> None:
        if self._probe_task is not None and not self._probe_task.done():
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
