"""The processor's probes: alive while its main loop turns, ready while its database, Redis and the gateway it
hands work to answer (`gateway_reach`: while the gateway does not, it claims no batch)."""

from __future__ import annotations

from sqlalchemy import text

from batch_processor.processor import Processor
from holdback.probes import Probes


def probes(processor: Processor) -> Probes:
    def database() -> str | None:
        with processor.factory() as session:
            session.execute(text("SELECT 1"))
        return None

    def redis() -> str | None:
        return None if processor.redis.ping() else "PING was not answered"

    return Probes(processor.metrics.registry, live={"main_loop": processor.heartbeat.check},
                  ready={"database": database, "redis": redis, "gateway": processor.gateway.failure})
