"""The API server's app factory: `create_app(settings)` wires routes, errors, metrics and resources.

Start-up applies the migrations (when `settings.migrate_on_start`), connects Redis (starting
the embedded one when REDIS_URL is unset) and starts the dashboard's sampler; shutdown stops the
sampler and closes Redis and the DB pool.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager, suppress
from typing import AsyncIterator

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from batch_api import admin, batches, dashboard, files, ops
from batch_api.boundary import check_path_and_query
from batch_api.context import ApiContext
from batch_api.errors import install_error_handlers
from batch_api.front_door import install_front_door
from batch_api.openapi import install_openapi
from batch_api.observability import ObserveRequests, create_metrics
from holdback.logs import log_event
from holdback import __version__
from holdback.broker import connect
from holdback.db import make_engine, make_sessionmaker
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.storage import open_file_store

log = logging.getLogger("batch_api.app")


def create_app(settings: Settings) -> FastAPI:
    engine = make_engine(settings.sqlalchemy_url)
    context = ApiContext(
        settings=settings,
        engine=engine,
        sessions=make_sessionmaker(engine),
        store=open_file_store(settings),
        metrics=create_metrics(),
    )
    context.metrics.registry.register(dashboard.OutcomeCollector(context.sessions))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            await run_in_threadpool(upgrade, engine)
        context.redis = await run_in_threadpool(connect, settings)
        sampler = asyncio.create_task(dashboard.DashboardSampler(context).run(), name="dashboard-sampler")
        log_event(
            log, "api.started", database=engine.url.render_as_string(hide_password=True),
            files=settings.files_url or str(settings.files_dir), migrated=settings.migrate_on_start,
        )
        try:
            yield
        finally:
            sampler.cancel()
            with suppress(asyncio.CancelledError):
                await sampler
            context.redis.close()
            engine.dispose()
            log_event(log, "api.stopped")

    app = FastAPI(
        title="holdback Batch API",
        version=__version__,
        description="OpenAI-compatible Files and Batches API. Authenticate with 'Authorization: Bearer <tenant key>'.",
        lifespan=lifespan,
        docs_url=None,  # /docs is served with local assets (batch_api/front_door.py); ReDoc would need a CDN
        redoc_url=None,
    )
    app.state.context = context
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(ObserveRequests, metrics=context.metrics)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(admin.router)
    app.include_router(ops.router)
    # The dashboard signs in per page; its ids and filters are still refused with a NUL before any query.
    app.include_router(dashboard.router, dependencies=[Depends(check_path_and_query)])
    app.mount("/dashboard/static", dashboard.static_files(), name="dashboard-static")
    install_front_door(app)
    # Outermost, so the client address every part sees (the request log, the login throttle) is the resolved
    # one; the server runs with uvicorn's own proxy headers off (batch_api/cli.py), which would otherwise
    # believe any process on this host.
    trusted = [h.strip() for h in settings.trusted_proxies.split(",") if h.strip()]
    if trusted:
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=trusted)
    return app
