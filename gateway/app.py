"""The gateway service: wires config, replica pool, flow controller and proxy into one aiohttp application.

Routes: the OpenAI inference paths (through flow control), /v1/models, GET/DELETE and cancel of a stored
/v1/responses/{id} (to the replica that stores it), /health and /healthz (liveness),
/readyz (readiness: a healthy replica, and not draining), /metrics, and the admin
routes /admin/state and POST /admin/rollback (an admin key once any key is configured).
`Gateway.reload()` (SIGHUP) re-reads the config file; a bad file is logged and the running config stays.
`Gateway.rollback()` goes back to the previous config digest with the lower admission watermark kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.classification import ClassificationError, Classifier
from gateway.flow.controller import FlowController
from gateway.flow.request import DropReason
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.pools import ModelPools
from gateway.proxy import Proxy
from gateway.relays.drain import Drain, DrainCollector, refuse_unanswered
from gateway.replicas import Replica, ReplicaPool
from gateway.responses import error_response
from gateway.settings import ConfigError, GatewayConfig, LoadedConfig, load_config, with_admission, with_replicas
from gateway.upstream import UpstreamPool, connection_limit
from holdback.contract import INFERENCE_PATHS

logger = logging.getLogger("gateway")


class Gateway:
    def __init__(self, loaded: LoadedConfig, *, config_path: str | Path | None = None,
                 replicas_override: list[str] | None = None):
        self.config_path = config_path
        self.replicas_override = replicas_override
        if replicas_override is not None:
            loaded = with_replicas(loaded, replicas_override)
        self.metrics = GatewayMetrics()
        # Every replica, checked and scraped in one place; each model pool's flow control sees its own.
        self.pool = ReplicaPool([])
        self.pools = ModelPools(loaded, self.pool, self.metrics)
        self.pool.on_change = self.pools.wake
        self.pool.key_source = lambda url: self.pools.loaded.replica_key_source(url)
        self.proxy = Proxy(self.pools, self.metrics)
        self.metrics.watch(self.pools.snapshot)
        # How this process stops on SIGTERM (gateway/relays/drain.py); flow control adds its relays' drains.
        self.drain = Drain()
        self.drain.on_deadline.append(lambda: self.pools.refuse_waiting(DropReason.SHUTTING_DOWN))
        self.drain.on_deadline.append(
            lambda: refuse_unanswered(self.proxy.handling.values(), DropReason.SHUTTING_DOWN))
        self.drains = DrainCollector(self.drain)
        self.metrics.registry.register(self.drains)
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        # Called after a reload or rollback applied a config (the relays of `--workers` take it up).
        self.on_config: list[Callable[[], None]] = []
        _log_config("config_loaded", loaded)

    @property
    def controller(self) -> FlowController:
        """The default pool's flow controller (the only one with one model)."""
        return self.pools.default().controller

    # -- application ----------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = gateway_app(self.proxy, self)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.stop()

    def replica_key(self, url: str) -> str | None:
        """The key of the replica at `url` (or under it) in the running config."""
        return self.pools.loaded.replica_key(url)

    async def start(self) -> None:
        """Open the upstream session, start the replica checks, the dispatch loop and SIGHUP reloads."""
        self._session = upstream_session(self.pools.loaded.config, self.replica_key)
        self.proxy.session = self._session
        self.proxy.upstream = UpstreamPool.for_config(self.pools.loaded.config)
        await self.pool.start(self._session)
        self._loop_task = asyncio.create_task(self._run_pools(), name="gateway-dispatch-loop")
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        except (RuntimeError, ValueError):  # not the main thread: reload only through Gateway.reload()
            logger.warning("sighup_unavailable")

    async def _run_pools(self) -> None:
        """Every pool's dispatch loop, a pool added later (a new model reported) included."""
        running: dict[int, asyncio.Task] = {}
        added = asyncio.Event()
        self.pools.on_pools.append(added.set)
        try:
            while True:
                for controller in self.pools.flows():
                    if id(controller) not in running:
                        running[id(controller)] = asyncio.create_task(
                            controller.run(), name=f"gateway-dispatch-loop-{controller.pool_name}")
                added.clear()
                await added.wait()
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)

    async def stop(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.pool.stop()
        self.proxy.counter.close()
        await self.proxy.stored.close()
        if self.proxy.upstream is not None:
            self.proxy.upstream.close()
        if self._session is not None:
            await self._session.close()

    # -- reload ---------------------------------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the config file; keep the running config when the new one is bad."""
        running = self.pools.loaded.digest
        try:
            loaded = load_config(self.config_path)
            if self.replicas_override is not None:
                loaded = with_replicas(loaded, self.replicas_override)
            # Applying can still refuse it (an unreadable calibration profile) before anything changes.
            self.pools.configure(loaded)
        except ConfigError as exc:
            log_event(logger, "config_rejected", level=logging.ERROR, error=str(exc), running_digest=running)
            return False
        self._applied()
        _log_config("config_reloaded", loaded, previous_digest=running)
        return True

    def _applied(self) -> None:
        self.proxy.reconfigure()
        for listener in self.on_config:
            listener()

    # -- plain routes ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers."""
        return web.Response(text="ok")

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: at least one replica passes its health checks (and its calibration), so a request can
        be served; with none the gateway would answer every request 503 `rejected-no-endpoints`. Not ready
        once it drains."""
        if self.drain.draining:
            return self.drain.not_ready()
        return readiness(self.pool.replicas)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def admin_state(self, request: web.Request) -> web.Response:
        refused = refuse_admin(self.proxy.classifier, request)
        if refused is not None:
            return refused
        return web.Response(text=json.dumps({**self.pools.snapshot(), "drain": self.drain.state()}),
                            content_type="application/json")

    async def admin_rollback(self, request: web.Request) -> web.Response:
        lower = await rollback_request(self.proxy.classifier, request)
        if isinstance(lower, web.Response):
            return lower
        try:
            answer = self.rollback(lower)
        except ConfigError as exc:
            return error_response(409, str(exc), "invalid_request_error", "rollback_refused")
        return web.json_response(answer)

    # -- rollback -------------------------------------------------------------------------------------------
    def rollback(self, lower: float | None = None) -> dict:
        """Apply the config before the running one, admission on, with the lower of the two admission
        watermarks (or `lower` when it is lower still): rollback never returns to unlimited acceptance."""
        history = self.pools.history
        current = self.pools.loaded
        previous = next((c for c, _at in reversed(history[:-1]) if c.digest != current.digest), None)
        if previous is None:
            raise ConfigError("no earlier config digest to roll back to: only "
                              f"{current.digest} has been applied since start")
        marks = [current.config.admission.admissionWatermark, previous.config.admission.admissionWatermark]
        if lower is not None:
            marks.append(lower)
        watermark = min(marks)
        try:
            target = with_admission(previous, enabled=True, admissionWatermark=watermark)
        except ValueError as exc:
            raise ConfigError(f"the rolled-back config is not valid: {exc}") from exc
        self.pools.configure(target)
        self._applied()
        log_event(logger, "config_rolled_back", level=logging.WARNING, from_digest=current.digest,
                  to_digest=previous.digest, applied_digest=target.digest, admission_watermark=watermark)
        return {"from_digest": current.digest, "to_digest": previous.digest, "applied_digest": target.digest,
                "admissionWatermark": watermark}


def gateway_app(proxy: Proxy, routes) -> web.Application:  # noqa: ANN001
    """The gateway's routes: inference and models through `proxy`, the rest from `routes` (a Gateway, or a
    relay of `--workers`): health, ready, prometheus, admin_state, admin_rollback, and its `drain`, which counts
    the handlers running."""
    app = web.Application(client_max_size=64 * 2**20, middlewares=[routes.drain.middleware])
    for path in INFERENCE_PATHS:
        app.router.add_post(path, proxy.inference)
    app.router.add_get("/v1/models", proxy.models)
    # A stored response (vLLM's GET and cancel; DELETE, which vLLM lacks, answered by the replica too), relayed to
    # the replica that stores it (gateway/stored_responses.py).
    app.router.add_route("*", "/v1/responses/{response_id}", proxy.stored.relay)
    app.router.add_post("/v1/responses/{response_id}/cancel", proxy.stored.relay)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/healthz", routes.health)
    app.router.add_get("/readyz", routes.ready)
    app.router.add_get("/metrics", routes.prometheus)
    app.router.add_get("/admin/state", routes.admin_state)
    app.router.add_post("/admin/rollback", routes.admin_rollback)
    return app


async def until_stopped() -> None:
    """Wait for SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def readiness(replicas: list[Replica]) -> web.Response:
    healthy = sum(1 for r in replicas if r.healthy and not r.refused)
    body = {"status": "ok" if healthy else "failing", "healthy_replicas": healthy, "replicas": len(replicas)}
    return web.json_response(body, status=200 if healthy else 503)


def refuse_admin(classifier: Classifier, request: web.Request) -> web.Response | None:
    """The answer to a caller without an admin key (once keys are configured); None lets it through."""
    try:
        classifier.admin(request.headers.get("Authorization"))
    except ClassificationError as exc:
        return error_response(exc.status, exc.message, exc.err_type, exc.code)
    return None


def upstream_session(cfg: GatewayConfig, key: Callable[[str], str | None] = lambda url: None
                     ) -> aiohttp.ClientSession:
    """The session for /v1/models, health checks, scrapes and tokenizer calls to the replicas (inference requests
    go through the proxy's UpstreamPool); not decompressed. `key(url)` is the replica's key, put on every call
    that does not carry an Authorization of its own."""
    connector = aiohttp.TCPConnector(limit=connection_limit(cfg), limit_per_host=0, keepalive_timeout=30,
                                     enable_cleanup_closed=False)
    timeout = aiohttp.ClientTimeout(total=cfg.upstream.timeoutSeconds or None,
                                    sock_connect=cfg.upstream.connectTimeoutSeconds)

    async def authorize(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        if "Authorization" not in request.headers:
            value = key(str(request.url))
            if value:
                request.headers["Authorization"] = f"Bearer {value}"
        return await handler(request)

    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",), middlewares=(authorize,))


async def rollback_request(classifier: Classifier, request: web.Request) -> float | None | web.Response:
    """The optional lower admission watermark of POST /admin/rollback, or the answer to a caller without an
    admin key or with a bad body."""
    refused = refuse_admin(classifier, request)
    if refused is not None:
        return refused
    lower = None
    if request.can_read_body:
        try:
            doc = json.loads(await request.read() or b"{}")
            lower = doc.get("admissionWatermark") if isinstance(doc, dict) else None
            if lower is not None and (isinstance(lower, bool) or not isinstance(lower, (int, float))
                                      or not 0 < lower <= 1):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            return error_response(400, "The body must be a JSON object, optionally with `admissionWatermark` "
                                  "(a number in (0, 1]).", "invalid_request_error", "invalid_body")
    return lower


def _log_config(event: str, loaded: LoadedConfig, **extra: object) -> None:
    cfg = loaded.config
    log_event(logger, event, digest=loaded.digest, source=loaded.source,
              replicas=",".join(cfg.replicas) or "none", pools=",".join(p.name for p in cfg.pools) or "by model",
              detector=cfg.saturation.detector,
              holdback=cfg.usageLimit.policy, eviction=cfg.eviction.enabled, admission=cfg.admission.enabled,
              keys=len(loaded.keys), **extra)
    for env_name in loaded.skipped_key_envs:
        log_event(logger, "key_env_unset", level=logging.WARNING, env=env_name,
                  hint="this key entry is skipped until the variable is set and the config reloaded")
