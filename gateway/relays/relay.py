"""A relay process of `holdback gateway --workers N`: accepts on the inherited listening socket and relays.

It runs the gateway's `Proxy` unchanged (classification, prompt counting, the byte relay with headers held
until the first body chunk, the 429 and SSE error answers) with a `RemoteFlowController` in place of the
FlowController, so flow control's decisions come from the one flow-control process (gateway/relays/flow_process.py).
/admin/state, /admin/rollback and /metrics are answered by flow control for the whole gateway; a relay keeps
only its own counters and histograms (TTFT, prompt counts, upstream errors), which flow control collects.
A relay exits when its channel to flow control closes; flow control starts another in its place.

    python -m gateway.relays.relay --fd N --channel PATH --index I   (started by `holdback gateway --workers N`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

import aiohttp
from aiohttp import web

from gateway.app import (gateway_app, readiness, refuse_admin, rollback_request, until_stopped,
                         upstream_session)
from gateway.log import configure_logging, log_event
from gateway.metrics import GatewayMetrics, metric_families
from gateway.proxy import Proxy
from gateway.relays import messages as m
from gateway.relays.channel import Channel, ChannelClosed
from gateway.relays.remote_flow import RemotePools
from gateway.responses import error_response
from gateway.upstream import UpstreamPool

logger = logging.getLogger("gateway.relay")
# How often a relay tells flow control what its prompt counter knows (for /admin/state).
TOKENIZER_REPORT_SECONDS = 0.25


class Relay:
    def __init__(self, channel: Channel, index: int):
        self.channel = channel
        self.index = index
        self.metrics = GatewayMetrics()
        self.pools: RemotePools | None = None
        self.proxy: Proxy | None = None
        self.configured: asyncio.Future = asyncio.get_running_loop().create_future()
        self._view = m.PoolView(replicas=(), routing=())

    # -- messages from flow control -------------------------------------------------------------------------
    def handle(self, message: m.Message) -> None:
        pools = self.pools
        match message:
            case m.Dispatched() | m.Evict() | m.Rejected() if pools is not None:
                pools.decided(message)
            case m.PoolView():
                self._view = message
                if pools is not None:
                    pools.update(message)
            case m.Configure():
                self._configure(message)
            case m.Call(name="collect"):
                self.channel.reply(message.call_id, metric_families(self.metrics.registry))
            case _:
                log_event(logger, "flow_message_unexpected", level=logging.ERROR, kind=message.kind)

    def _configure(self, message: m.Configure) -> None:
        """The gateway's config, and each pool's with its ledger's settings."""
        if self.pools is None:
            self.pools = RemotePools(self.channel, message, self._view)
            self.proxy = Proxy(self.pools, self.metrics)
            self.configured.set_result(None)
        else:
            self.pools.configure(message)
            assert self.proxy is not None
            self.proxy.reconfigure()

    def _proxy(self) -> Proxy:
        assert self.proxy is not None, "the relay serves only once flow control configured it"
        return self.proxy

    # -- routes ---------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        assert self.proxy is not None
        return gateway_app(self.proxy, self)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(self, request: web.Request) -> web.Response:
        return readiness(self.pools.replicas.replicas if self.pools is not None else [])

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            body = await self.channel.call("metrics")
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        return web.Response(body=str(body).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def admin_state(self, request: web.Request) -> web.Response:
        refused = refuse_admin(self._proxy().classifier, request)
        if refused is not None:
            return refused
        try:
            state = await self.channel.call("state")
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        return web.Response(text=json.dumps(state), content_type="application/json")

    async def admin_rollback(self, request: web.Request) -> web.Response:
        lower = await rollback_request(self._proxy().classifier, request)
        if isinstance(lower, web.Response):
            return lower
        try:
            answer = await self.channel.call("rollback", lower)
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        if not isinstance(answer, list) or len(answer) != 2:
            return _flow_control_gone()
        verdict, answer = answer
        if verdict != "ok":
            return error_response(409, str(answer), "invalid_request_error", "rollback_refused")
        return web.json_response(answer)

    async def report_tokenizer(self) -> None:
        last = None
        while not self.channel.closed:
            state = self._proxy().counter.state()
            if state != last:
                self.channel.send(m.TokenizerReport(state=state))
                last = state
            await asyncio.sleep(TOKENIZER_REPORT_SECONDS)


def _flow_control_gone() -> web.Response:
    return error_response(503, "The gateway's flow-control process is not answering; retry shortly.",
                          "service_unavailable", "flow_control_unavailable")


async def serve(fd: int, channel_path: str, index: int) -> None:
    reader, writer = await asyncio.open_unix_connection(channel_path)
    channel = Channel(reader, writer, peer="flow control")
    relay = Relay(channel, index)
    reading = asyncio.create_task(channel.serve(relay.handle), name="flow-channel")
    channel.send(m.Hello(pid=os.getpid(), index=index))
    await asyncio.wait_for(relay.configured, 60)
    assert relay.pools is not None and relay.proxy is not None
    pools = relay.pools
    session = upstream_session(pools.loaded.config, lambda url: pools.loaded.replica_key(url))
    relay.proxy.session = session
    relay.proxy.upstream = UpstreamPool.for_config(pools.loaded.config)
    runner = web.AppRunner(relay.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, socket.socket(fileno=fd), backlog=1024)
    await site.start()
    reporter = asyncio.create_task(relay.report_tokenizer(), name="tokenizer-report")
    log_event(logger, "relay_listening", relay=index, pid=os.getpid(),
              event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
    stopped = asyncio.create_task(until_stopped())
    try:
        # A signal, or flow control gone (the relay cannot decide anything alone).
        await asyncio.wait([stopped, reading], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if channel.closed:
            relay.pools.lost()
        reporter.cancel()
        await runner.cleanup()
        relay.proxy.counter.close()
        relay.proxy.upstream.close()
        await session.close()
        channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.relays.relay", description=(
        "A relay process of `holdback gateway --workers N` (started by it, not by hand)."))
    p.add_argument("--fd", type=int, required=True, help="the inherited listening socket's file descriptor")
    p.add_argument("--channel", required=True, help="the flow-control process's Unix socket")
    p.add_argument("--index", type=int, default=0, help="this relay's number (for logs and /admin/state)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    # A reload is flow control's (SIGHUP to the parent); a hangup sent to the whole group must not end relays.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging(args.log_level)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(serve(args.fd, args.channel, args.index))
    except (ConnectionError, FileNotFoundError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
        log_event(logger, "relay_failed", level=logging.ERROR, relay=args.index, error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
