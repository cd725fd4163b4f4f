"""The gateway service: wires config, replica pool, flow controller and proxy into one aiohttp application.

Routes: the OpenAI inference paths (through flow control), /v1/models, /health, /metrics and /admin/state.
`Gateway.reload()` (SIGHUP) re-reads the config file; a bad file is logged and the running config stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.config import ConfigError, LoadedConfig, load_config, with_replicas
from gateway.flow_control import FlowController
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.replicas import ReplicaPool

logger = logging.getLogger("gateway")

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class Gateway:
    def __init__(self, loaded: LoadedConfig, *, config_path: str | Path | None = None,
                 replicas_override: list[str] | None = None):
        self.config_path = config_path
        self.replicas_override = replicas_override
        if replicas_override is not None:
            loaded = with_replicas(loaded, replicas_override)
        self.metrics = GatewayMetrics()
        self.pool = ReplicaPool(loaded.config.replicas)
        self.controller = FlowController(loaded, self.pool, self.metrics)
        self.pool.on_change = self.controller.wake
        self.proxy = Proxy(self.controller, self.metrics)
        self.metrics.watch(self.controller.snapshot)
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        _log_config("config_loaded", loaded)

    # -- application ----------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self.proxy.inference)
        app.router.add_get("/v1/models", self.proxy.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/admin/state", self.admin_state)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        cfg = self.controller.loaded.config
        sat = cfg.saturation
        limit = cfg.upstream.connectionLimit or max(
            256, int(len(cfg.replicas) * sat.maxConcurrency * (1 + sat.headroom) * 2) + 64)
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=30,
                                         enable_cleanup_closed=False)
        timeout = aiohttp.ClientTimeout(total=cfg.upstream.timeoutSeconds or None,
                                        sock_connect=cfg.upstream.connectTimeoutSeconds)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("User-Agent",))
        self.proxy.session = self._session
        await self.pool.start(self._session)
        self._loop_task = asyncio.create_task(self.controller.run(), name="gateway-dispatch-loop")
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        except (RuntimeError, ValueError):  # not the main thread: reload only through Gateway.reload()
            logger.warning("event=sighup_unavailable")

    async def _on_cleanup(self, app: web.Application) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.pool.stop()
        if self._session is not None:
            await self._session.close()

    # -- reload ---------------------------------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the config file; keep the running config when the new one is bad."""
        running = self.controller.loaded.digest
        try:
            loaded = load_config(self.config_path)
            if self.replicas_override is not None:
                loaded = with_replicas(loaded, self.replicas_override)
        except ConfigError as exc:
            log_event(logger, logging.ERROR, "config_rejected", error=str(exc), running_digest=running)
            return False
        self.controller.apply_config(loaded)
        self.proxy.reconfigure()
        _log_config("config_reloaded", loaded, previous_digest=running)
        return True

    # -- plain routes ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def admin_state(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.controller.snapshot()), content_type="application/json")


def _log_config(event: str, loaded: LoadedConfig, **extra: object) -> None:
    cfg = loaded.config
    log_event(logger, logging.INFO, event, digest=loaded.digest, source=loaded.source,
              replicas=",".join(cfg.replicas) or "none", detector=cfg.saturation.detector,
              holdback=cfg.usageLimit.policy, eviction=cfg.eviction.enabled, admission=cfg.admission.enabled,
              keys=len(loaded.keys), **extra)
    for env_name in loaded.skipped_key_envs:
        log_event(logger, logging.WARNING, "key_env_unset", env=env_name,
                  hint="this key entry is skipped until the variable is set and the config reloaded")
