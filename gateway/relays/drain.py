"""How a process that serves the gateway's clients stops when asked (SIGTERM): it drains.

Its readiness goes false at once, so a load balancer stops sending it new clients; it goes on accepting for
`grace` seconds, the time a load balancer's health checks take to notice; then it stops accepting (idle keep-alive
connections are closed) and lets the requests it runs finish until `grace + seconds` after the signal, the drain
deadline. What still waits in line for a decision then is refused (503 `rejected-shutting-down`, which a batch
worker retries without spending its budget), and so is what runs with no byte of its answer sent yet (a slot
freed just before the deadline may have dispatched it a moment ago); what still streams is cut: its caller's
connection closes as when a relay dies (a batch row is retried by its worker). Either way flow control is told it
ended, releasing its slot and reservation. The same for a relay run
alone, the relays of `--workers N` and the single-process gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from gateway.flow import moves
from gateway.flow.request import DropReason, FlowRequest, Status
from gateway.log import log_event
from gateway.metrics import PREFIX

logger = logging.getLogger("gateway")

# HAProxy checks every 2 s by default and takes a server out after `fall` failures (`inter 2s fall 2`: 4 s); a
# Kubernetes Service stops routing to a terminating pod at once, but kube-proxy, ingress controllers and cloud load
# balancers take a few seconds to apply it. 5 s covers both; a longer `fall` wants a longer grace.
DRAIN_GRACE = 5.0
# Long enough for a realtime answer of a few thousand tokens; with the grace it fits a pod's
# terminationGracePeriodSeconds of 40.
DRAIN_SECONDS = 30.0
# Once the deadline has passed: how long a cut request's handler may take to close its upstream and report.
CUT_SECONDS = 2.0


class Drain:
    """One process's drain: whether it drains, until when, and the requests its handlers still run."""

    def __init__(self, grace: float = DRAIN_GRACE, seconds: float = DRAIN_SECONDS):
        self.grace = grace
        self.seconds = seconds
        # Wall-clock times, for /admin/state and /metrics; None until a stop is asked for.
        self.began: float | None = None
        self.deadline: float | None = None
        self.accepting = True
        # Handlers running now (every route): the drain waits for them.
        self.running = 0
        # Told the deadline when the drain begins (a relay tells its flow control).
        self.on_begin: list[Callable[[float], None]] = []
        # Called at the deadline, in order: refuse what still waits for a decision, then what runs with its answer
        # not begun; each returns how many it refused.
        self.on_deadline: list[Callable[[], int]] = []
        self._end = 0.0

    @property
    def draining(self) -> bool:
        return self.began is not None

    def state(self) -> dict:
        """For /admin/state."""
        return {"draining": self.draining, "drain_deadline": self.deadline, "accepting": self.accepting,
                "running": self.running, "grace_seconds": self.grace, "drain_seconds": self.seconds}

    def begin(self) -> None:
        if self.began is not None:
            return
        self.began = time.time()
        self.deadline = self.began + self.grace + self.seconds
        self._end = time.monotonic() + self.grace + self.seconds
        for listener in self.on_begin:
            listener(self.deadline)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        self.running += 1
        try:
            return await handler(request)
        finally:
            self.running -= 1

    def not_ready(self) -> web.Response:
        """/readyz while draining: 503, so that load balancers send new clients elsewhere."""
        return web.json_response({"status": "draining", "drain_deadline": self.deadline}, status=503)

    async def run(self, runner: web.AppRunner, **who: object) -> int:
        """Drain the app `runner` serves: returns how many requests were still running at the deadline (the
        runner's cleanup, with a `shutdown_timeout` of CUT_SECONDS, cuts them)."""
        self.begin()
        log_event(logger, "draining", **who, grace_seconds=self.grace, drain_deadline=round(self.deadline or 0, 3),
                  running=self.running)
        await asyncio.sleep(self.grace)
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            runner.server.pre_shutdown()  # idle keep-alive connections close; busy ones close after their answer
        self.accepting = False
        log_event(logger, "drain_stopped_accepting", **who, running=self.running)
        while self.running and time.monotonic() < self._end:
            await asyncio.sleep(0.05)
        refused = sum(refuse() for refuse in self.on_deadline) if self.running else 0
        cut = max(0, self.running - refused)  # the refused ones answer at once, during the runner's cleanup
        log_event(logger, "drained", level=logging.WARNING if cut or refused else logging.INFO, **who, cut=cut,
                  refused=refused, seconds=round(time.time() - (self.began or 0), 3))
        return cut


def refuse_unanswered(requests: Iterable[FlowRequest], reason: DropReason) -> int:
    """At the drain deadline, after what still waits was refused: a running request whose answer has not begun
    is refused too, with `reason`, rather than cut (its caller gets a 503 it can retry, not a closed connection):
    a slot freed just before the deadline may have dispatched it a moment ago. Its handler closes the upstream
    and answers (gateway/proxy.py `_cancelled`). Returns how many."""
    refused = 0
    for req in list(requests):
        if req.status is Status.DISPATCHED and req.drop_reason is None and not req.streaming_started \
                and req.task is not None:
            moves.stop(req, reason)
            req.task.cancel()
            refused += 1
    return refused


class DrainCollector:
    """/metrics: whether this process drains, its deadline, and (flow control) its relays that drain."""

    def __init__(self, drain: Drain, relays: Callable[[], dict[str, float]] = dict):
        self.drain = drain
        self.relays = relays

    def collect(self):
        draining = GaugeMetricFamily(f"{PREFIX}_draining", "1 while this gateway process drains (asked to stop: "
                                     "not ready, then not accepting, its running requests finishing).")
        draining.add_metric([], float(self.drain.draining))
        deadline = GaugeMetricFamily(f"{PREFIX}_drain_deadline_seconds", "Unix time this process's drain cuts "
                                     "what still runs (0 while it does not drain).")
        deadline.add_metric([], float(self.drain.deadline or 0))
        relays = GaugeMetricFamily(f"{PREFIX}_relay_drain_deadline_seconds", "Unix time each draining relay "
                                   "connected to this flow control cuts what it still runs.", labels=["relay"])
        for relay, until in self.relays().items():
            relays.add_metric([relay], until)
        return [draining, deadline, relays]
