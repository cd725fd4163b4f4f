"""The objects one API app shares across requests: settings, DB sessions, file store, Redis, metrics.

`create_app` builds one `ApiContext` and keeps it on `app.state.context`; dependencies read it
from the request, so nothing here is a module-level global.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import HTTPConnection

from batch_api.errors import ServiceUnavailable
from batch_api.observability import ApiMetrics
from holdback.settings import Settings
from holdback.storage import FileStore


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: FileStore
    metrics: ApiMetrics
    # Connected at start-up (it may start the embedded Redis), closed at shutdown.
    redis: redis.Redis | None = None

    def require_redis(self) -> redis.Redis:
        if self.redis is None:
            raise ServiceUnavailable("Redis is not connected yet; retry in a moment.", headers={"retry-after": "1"})
        return self.redis


def get_context(connection: HTTPConnection) -> ApiContext:
    return connection.app.state.context
