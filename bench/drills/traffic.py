"""The drills' realtime traffic: request specs sent to the gateway at their offsets on one event loop, every
outcome kept, and the request ids that let a replica's state name the tenant."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import aiohttp

from holdback.contract import FAIRNESS_HEADER, OBJECTIVE_HEADER, REQUEST_ID_HEADER
from bench.lib.stack import Stack
from bench.lib.traffic import stream_chat
from bench.lib.workload import RequestSpec
from bench.drills.timeline import Timeline


class Traffic:
    """Sends request specs to the gateway on one event loop and keeps every outcome."""

    def __init__(self, stack: Stack, timeline: Timeline, model: str):
        self.stack = stack
        self.timeline = timeline
        self.model = model
        self.records: list[dict] = []
        self.tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _send(self, spec: RequestSpec) -> None:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {self.stack.realtime_key}", OBJECTIVE_HEADER: spec.objective,
                   FAIRNESS_HEADER: spec.tenant, REQUEST_ID_HEADER: request_id(spec)}
        sent = self.timeline.now()
        outcome = await stream_chat(self.session, self.stack.gateway_url, headers, spec.body(self.model),
                                    spec.cancel_after)
        self.records.append({**spec.describe(), "sent_t": sent, **asdict(outcome)})

    async def play(self, specs: list[RequestSpec]) -> None:
        """Start each spec at its offset from now; returns when the last one is sent (not finished)."""
        start = time.monotonic()
        for spec in sorted(specs, key=lambda s: s.at):
            delay = start + spec.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._send(spec))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def drain(self, timeout: float) -> int:
        """Wait for every request in flight; returns how many were still running at the timeout."""
        pending = set(self.tasks)
        if not pending:
            return 0
        _, still = await asyncio.wait(pending, timeout=timeout)
        return len(still)

    def since(self, t: float, phase: str | None = None) -> list[dict]:
        return [r for r in self.records if r["sent_t"] >= t and (phase is None or r["phase"] == phase)]


REQUEST_ID_PREFIX = "drill."


def request_id(spec: RequestSpec) -> str:
    """`drill.<tenant>.<index>`: the gateway passes it to the replica, whose /admin/state shows it."""
    return f"{REQUEST_ID_PREFIX}{spec.tenant}.{spec.index}"


def tenant_of(external_id: str | None) -> str | None:
    if not external_id or not external_id.startswith(REQUEST_ID_PREFIX):
        return None
    return external_id[len(REQUEST_ID_PREFIX):].rsplit(".", 1)[0]
