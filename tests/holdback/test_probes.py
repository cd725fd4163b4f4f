"""The metrics port of the processor and the workers: /metrics, /healthz (liveness), /readyz (readiness)."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter

from holdback.probes import Heartbeat, Probes, serve


def _served(probes: Probes) -> tuple[str, object]:
    server = serve(probes, 0)
    return f"http://127.0.0.1:{server.server_port}", server


def test_a_turning_loop_with_answering_dependencies_is_alive_and_ready_and_shows_its_metrics():
    registry = CollectorRegistry()
    Counter("holdback_probe_test", "A counter only this test exports.", registry=registry).inc()
    beat = Heartbeat(stale_after=60)
    url, server = _served(Probes(registry, live={"main_loop": beat.check}, ready={"redis": lambda: None}))
    try:
        live = httpx.get(url + "/healthz", timeout=10)
        assert live.status_code == 200 and live.json() == {"status": "ok", "checks": {"main_loop": "ok"}}
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["checks"] == {"main_loop": "ok", "redis": "ok"}
        assert "holdback_probe_test_total 1.0" in httpx.get(url + "/metrics", timeout=10).text
        assert httpx.get(url + "/nowhere", timeout=10).status_code == 404
    finally:
        server.shutdown()


def test_a_dependency_down_makes_it_unready_but_still_alive():
    def database() -> str | None:
        raise ConnectionRefusedError("connection refused")

    url, server = _served(Probes(CollectorRegistry(), live={"main_loop": Heartbeat(60).check},
                                 ready={"database": database, "redis": lambda: "PING was not answered"}))
    try:
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 503
        assert ready.json() == {"status": "failing", "checks": {
            "main_loop": "ok", "database": "ConnectionRefusedError: connection refused",
            "redis": "PING was not answered"}}
    finally:
        server.shutdown()


def test_a_silent_main_loop_fails_liveness_and_readiness():
    beat = Heartbeat(stale_after=30)
    beat.last -= 31  # the loop last turned 31 s ago
    url, server = _served(Probes(CollectorRegistry(), live={"main_loop": beat.check}))
    try:
        live = httpx.get(url + "/healthz", timeout=10)
        assert live.status_code == 503 and "main loop silent for 31s (limit 30s)" in live.json()["checks"]["main_loop"]
        assert httpx.get(url + "/readyz", timeout=10).status_code == 503
        beat.beat()
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    finally:
        server.shutdown()


def test_every_components_registry_shows_its_process():
    from prometheus_client import generate_latest

    from async_processor.metrics import WorkerMetrics
    from batch_api.observability import create_metrics
    from batch_processor.metrics import ProcessorMetrics
    from gateway.metrics import GatewayMetrics

    for registry in (GatewayMetrics().registry, ProcessorMetrics().registry, WorkerMetrics("w").registry,
                     create_metrics().registry):
        text = generate_latest(registry).decode()
        assert "process_resident_memory_bytes" in text and "python_info" in text
