"""`holdback gateway`: run the priority-aware gateway in front of model replicas."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from gateway.app import Gateway
from gateway.config import ConfigError, load_config
from gateway.log import configure_logging, log_event
from holdback.env_flags import flags_from_env

logger = logging.getLogger("gateway")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback gateway", description=(
        "Priority-aware gateway: flow control with priority bands, holdback ceilings, TTLs and in-flight "
        "eviction of sheddable requests, in front of vLLM-compatible replicas. SIGHUP reloads the config."))
    p.add_argument("--config", help="YAML config file (default: the shipped gateway/default.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="listen port (default 8200)")
    p.add_argument("--replicas", help="comma-separated replica base URLs; overrides `replicas` in the config")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return flags_from_env(p, "gateway")


async def serve(gateway: Gateway, host: str, port: int) -> None:
    runner = web.AppRunner(gateway.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    log_event(logger, logging.INFO, "listening", host=host, port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log_event(logger, logging.INFO, "stopping")
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        loaded = load_config(args.config)
    except ConfigError as exc:
        log_event(logger, logging.ERROR, "config_rejected", error=str(exc))
        return 2
    replicas = [u.strip() for u in args.replicas.split(",") if u.strip()] if args.replicas else None
    try:
        gateway = Gateway(loaded, config_path=args.config, replicas_override=replicas)
    except ConfigError as exc:
        log_event(logger, logging.ERROR, "config_rejected", error=str(exc))
        return 2
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        uvloop.run(serve(gateway, args.host, args.port))
    else:
        asyncio.run(serve(gateway, args.host, args.port))
    return 0
