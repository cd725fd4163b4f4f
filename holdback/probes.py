"""The metrics port of a background process: `/metrics`, `/healthz` (liveness) and `/readyz` (readiness).

The processor and each worker process serve one; the API server and the gateway answer the same two paths
on their own ports. Liveness asks whether the process's main loop still turns (a stuck loop needs a restart);
readiness asks whether it can do its work now (its database and Redis answer), which a restart cannot fix.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# A check returns None when it passes, else what failed (shown to the operator).
Check = Callable[[], "str | None"]


def component_registry(**kwargs: object) -> CollectorRegistry:
    """A component's own registry, with the process's CPU, memory and file descriptors (`process_*`) and the
    Python version (`python_info`) on it, so every component's scrape shows what its process costs."""
    registry = CollectorRegistry(**kwargs)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


@dataclass
class Heartbeat:
    """Beaten by a process's main loop; stale after `stale_after` seconds without a beat."""

    stale_after: float
    last: float = field(default_factory=time.monotonic)

    def beat(self) -> None:
        self.last = time.monotonic()

    def check(self) -> str | None:
        age = time.monotonic() - self.last
        return None if age <= self.stale_after else f"main loop silent for {age:.0f}s (limit {self.stale_after:.0f}s)"


@dataclass
class Probes:
    """What a process reports: liveness checks, readiness checks, and the registry `/metrics` shows."""

    registry: CollectorRegistry
    live: dict[str, Check] = field(default_factory=dict)
    ready: dict[str, Check] = field(default_factory=dict)

    def report(self, checks: dict[str, Check]) -> tuple[int, dict]:
        results = {name: _run(check) for name, check in checks.items()}
        failing = {name: r for name, r in results.items() if r != "ok"}
        body = {"status": "ok" if not failing else "failing", "checks": results}
        return (200 if not failing else 503), body


def _run(check: Check) -> str:
    try:
        failure = check()
    except Exception as exc:  # noqa: BLE001 - a probe reports every failure, it never raises
        failure = f"{type(exc).__name__}: {exc}"
    return "ok" if failure is None else failure


def serve(probes: Probes, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve the probes on host:port from a daemon thread; returns the server (its `server_port` is bound)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(probes.registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                status, body = probes.report(probes.live if path == "/healthz" else {**probes.live, **probes.ready})
                self._send(status, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b'{"error": "try /metrics, /healthz or /readyz"}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes are not news
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"probes-{port}", daemon=True).start()
    return server
