"""What the API server tells its operator: one JSON log event per request (holdback.logs) and Prometheus metrics.

`ObserveRequests` is the ASGI middleware that gives every request an `x-request-id` (the caller's, if it
sent a usable one), counts it by route template and status, times it, and logs it. Each app owns its
`CollectorRegistry`, so two apps in one process (tests) never share counters.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from holdback import tracing
from holdback.contract import REQUEST_ID_HEADER
from holdback.probes import component_registry
from holdback.logs import log_event

_REQUEST_ID = REQUEST_ID_HEADER.encode()
# A caller's id is kept only if it is short, visible ASCII: it goes into logs and response headers verbatim.
_REQUEST_ID_SHAPE = re.compile(rb"[!-~]{1,128}")


def incoming_request_id(scope: Scope) -> str | None:
    """The caller's `x-request-id`, if it sent a usable one, so its id and ours are the same in the logs."""
    for name, value in scope.get("headers", ()):
        if name == _REQUEST_ID:
            return value.decode("ascii") if _REQUEST_ID_SHAPE.fullmatch(value) else None
    return None

log = logging.getLogger("batch_api.requests")

@dataclass
class ApiMetrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram


def create_metrics() -> ApiMetrics:
    registry = component_registry()
    return ApiMetrics(
        registry=registry,
        requests=Counter(
            "holdback_api_requests",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            registry=registry,
        ),
        latency=Histogram(
            "holdback_api_request_duration_seconds",
            "Time from receiving a request to sending the last byte of its response.",
            ["method", "route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=registry,
        ),
    )


# Unmatched paths share one label so scanners cannot blow up the metric's cardinality.
UNMATCHED = "<unmatched>"


class ObserveRequests:
    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = incoming_request_id(scope) or "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (_REQUEST_ID, request_id.encode())]
            await send(message)

        method = scope["method"]
        # One server span per request, continuing the caller's `traceparent` if it sent one (holdback.tracing);
        # the request's log line is written inside it, so it carries the trace id.
        parent = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]} if tracing.enabled() else None
        with tracing.span(f"{method} {scope['path']}", parent=parent, kind="server",
                          attributes={"http.request.method": method, "request_id": request_id}) as span:
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                elapsed = time.perf_counter() - started
                # The router writes the matched route into this same scope dict.
                route = getattr(scope.get("route"), "path", None) or UNMATCHED
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                self.metrics.requests.labels(method, route, str(status)).inc()
                self.metrics.latency.labels(method, route).observe(elapsed)
                log_event(
                    log,
                    "http.request",
                    request_id=request_id,
                    method=method,
                    route=route,
                    path=scope["path"],
                    status=status,
                    duration_ms=round(elapsed * 1000, 2),
                    tenant_id=scope["state"].get("tenant_id"),
                )
