"""A worker process's probes: alive while its heartbeat loop turns (the event loop is not stuck), ready once
it is registered in Redis and while Redis answers its heartbeats and it is not stopping."""

from __future__ import annotations

from async_processor.worker import AsyncWorker
from holdback.probes import Probes


def probes(worker: AsyncWorker) -> Probes:
    def registered() -> str | None:
        if worker.stopping.is_set():
            return "stopping: draining in-flight requests"
        return worker.redis_failure

    return Probes(worker.metrics.registry, live={"event_loop": worker.heartbeat.check}, ready={"redis": registered})
