"""A relay process: of `holdback gateway --workers N` (accepts on the inherited listening socket), or run alone on
any host by `holdback gateway --role relay` (binds its own, and reaches flow control over TCP).

It runs the gateway's `Proxy` unchanged (classification, prompt counting, the byte relay with headers held
until the first body chunk, the 429 and SSE error answers) with a `RemoteFlowController` in place of the
FlowController, so flow control's decisions come from the one flow-control process (gateway/relays/flow_process.py).
/admin/state, /admin/rollback and /metrics are answered by flow control for the whole gateway; a relay keeps
only its own counters and histograms (TTFT, prompt counts, upstream errors), which flow control collects.
A relay of `--workers N` exits when its channel to flow control closes; flow control starts another in its place.
Asked to stop (SIGTERM), a relay drains (gateway/relays/drain.py) and tells flow control its drain deadline.
A relay run alone goes on: the streams it relays run to their end, it reports not ready, keeps the requests that
wait for a decision and new ones that reach it anyway, each until its deadline (then 503), and connects again
(gateway/relays/uplink.py); the flow control it joins learns what waits from `Holding` and decides it.

    python -m gateway.relays.relay --fd N --channel PATH --index I [--drain-grace S --drain-seconds S]
        (started by `holdback gateway --workers N`, the channel's secret in its environment)
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
from typing import Coroutine

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from gateway.app import (gateway_app, readiness, refuse_admin, rollback_request, until_stopped,
                         upstream_session)
from gateway.flow.request import DropReason
from gateway.log import configure_logging, log_event
from gateway.metrics import PREFIX, GatewayMetrics, metric_families
from gateway.proxy import Proxy
from gateway.relays import messages as m
from gateway.relays.channel import ChannelClosed
from gateway.relays.drain import CUT_SECONDS, DRAIN_GRACE, DRAIN_SECONDS, Drain, refuse_unanswered
from gateway.relays.local_relays import listening_socket
from gateway.relays.handshake import SecretError, channel_secret
from gateway.relays.remote_flow import RemotePools
from gateway.relays.uplink import Uplink
from gateway.responses import error_response
from gateway.upstream import UpstreamPool

logger = logging.getLogger("gateway.relay")
# How often a relay tells flow control what its prompt counter knows (for /admin/state).
TOKENIZER_REPORT_SECONDS = 0.25


class Relay:
    def __init__(self, uplink: Uplink, index: int | None, listen: str, drain: Drain | None = None):
        self.uplink = uplink
        self.index = index
        self.listen = listen
        self.drain = drain or Drain()
        self.drain.on_begin.append(lambda deadline: self.uplink.send(m.Draining(deadline=deadline)))
        self.drain.on_deadline.append(
            lambda: self.pools.refuse_waiting(DropReason.SHUTTING_DOWN) if self.pools is not None else 0)
        self.drain.on_deadline.append(
            lambda: refuse_unanswered(self.proxy.handling.values(), DropReason.SHUTTING_DOWN)
            if self.proxy is not None else 0)
        self.metrics = GatewayMetrics()
        # Every decision flow control sent, by the fencing token it carried: a deposed leader's shows as refused.
        self.decisions = Counter(f"{PREFIX}_relay_decisions", "Decisions (config, dispatch, reject, evict) this "
                                 "relay received, by their fencing token and whether it applied or refused them.",
                                 ["token", "outcome"], registry=self.metrics.registry)
        self.pools: RemotePools | None = None
        self.proxy: Proxy | None = None
        # Set once flow control sent both its config and its first view of the replicas: a relay that listened
        # between the two would answer a request for a model it serves 404 (no pool known yet).
        self.configured: asyncio.Future = asyncio.get_running_loop().create_future()
        self._view = m.PoolView(replicas=(), routing=())
        self._viewed = False
        self._reported: dict | None = None
        # The newest fencing token a flow control sent: a decision with an older one comes from a deposed leader.
        self.token = 0

    # -- messages from flow control -------------------------------------------------------------------------
    def handle(self, message: m.Message) -> None:
        pools = self.pools
        if isinstance(message, (m.Dispatched, m.Evict, m.Rejected, m.Configure)) and not self._fenced(message):
            return
        match message:
            case m.Dispatched() | m.Evict() | m.Rejected() if pools is not None:
                pools.decided(message)
            case m.PoolView():
                self._view, self._viewed = message, True
                if pools is not None:
                    pools.update(message)
                self._ready()
            case m.Configure():
                self.uplink.set_heartbeat(message.loaded.config.flowControl.heartbeatSeconds)
                self._configure(message)
            case m.Call(name="collect"):
                self.uplink.reply(message.call_id, metric_families(self.metrics.registry))
            case _:
                log_event(logger, "flow_message_unexpected", level=logging.ERROR, kind=message.kind)

    def _fenced(self, message: m.Dispatched | m.Evict | m.Rejected | m.Configure) -> bool:
        """Whether `message` comes from the newest leader this relay has heard of (refused, and logged, if not)."""
        if message.token < self.token:
            log_event(logger, "decision_refused", level=logging.ERROR, kind=message.kind, token=message.token,
                      newest_token=self.token, reason="an older fencing token than the newest leader's: it comes "
                      "from a flow control that no longer leads")
            self.decisions.labels(str(message.token), "refused").inc()
            return False
        self.token = message.token
        self.decisions.labels(str(message.token), "applied").inc()
        return True

    def _configure(self, message: m.Configure) -> None:
        """The gateway's config, and each pool's with its ledger's settings."""
        if self.pools is None:
            self.pools = RemotePools(self.uplink, message, self._view, waits=self.index is None)
            self.proxy = Proxy(self.pools, self.metrics)
            self._ready()
        else:
            self.pools.configure(message)
            assert self.proxy is not None
            self.proxy.reconfigure()

    def _ready(self) -> None:
        if self.pools is not None and self._viewed and not self.configured.done():
            self.configured.set_result(None)

    def _proxy(self) -> Proxy:
        assert self.proxy is not None, "the relay serves only once flow control configured it"
        return self.proxy

    # -- routes ---------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        assert self.proxy is not None
        return gateway_app(self.proxy, self)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # -- the channel coming and going (Uplink.run) ----------------------------------------------------------
    def joined(self) -> None:
        self.uplink.send(m.Hello(pid=os.getpid(), index=self.index, host=socket.gethostname(), listen=self.listen))
        if self.pools is not None:  # a flow control that did not decide what this relay holds counts it first
            self.uplink.send(m.Holding(requests=self.pools.holding()))
        if self.drain.deadline is not None:
            self.uplink.send(m.Draining(deadline=self.drain.deadline))
        self._reported = None  # a new flow control learns the prompt counter's state again

    def left(self, reason: str) -> None:
        waiting = self.pools.wait_alone() if self.pools is not None and self.index is None else 0
        log_event(logger, "flow_control_lost", level=logging.ERROR, reason=reason, waiting=waiting,
                  relaying=len(self.pools.requests) - waiting if self.pools is not None else 0)

    async def ready(self, request: web.Request) -> web.Response:
        if self.drain.draining:
            return self.drain.not_ready()
        if self.uplink.closed:
            return web.json_response({"status": "failing", "flow_control": "unreachable"}, status=503)
        return readiness(self.pools.replicas.replicas if self.pools is not None else [])

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            body = await self.uplink.call("metrics")
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        return web.Response(body=str(body).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def admin_state(self, request: web.Request) -> web.Response:
        refused = refuse_admin(self._proxy().classifier, request)
        if refused is not None:
            return refused
        try:
            state = await self.uplink.call("state")
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        return web.Response(text=json.dumps(state), content_type="application/json")

    async def admin_rollback(self, request: web.Request) -> web.Response:
        lower = await rollback_request(self._proxy().classifier, request)
        if isinstance(lower, web.Response):
            return lower
        try:
            answer = await self.uplink.call("rollback", lower)
        except (ChannelClosed, asyncio.TimeoutError):
            return _flow_control_gone()
        if not isinstance(answer, list) or len(answer) != 2:
            return _flow_control_gone()
        verdict, answer = answer
        if verdict != "ok":
            return error_response(409, str(answer), "invalid_request_error", "rollback_refused")
        return web.json_response(answer)

    async def report_tokenizer(self) -> None:
        while True:
            state = self._proxy().counter.state()
            if state != self._reported and not self.uplink.closed:
                self.uplink.send(m.TokenizerReport(state=state))
                self._reported = state
            await asyncio.sleep(TOKENIZER_REPORT_SECONDS)


def _flow_control_gone() -> web.Response:
    return error_response(503, "The gateway's flow-control process is not answering; retry shortly.",
                          "service_unavailable", "flow_control_unavailable")


async def serve(uplink: Uplink, sock: socket.socket, index: int | None, drain: Drain | None = None) -> None:
    """Relay on `sock` for the flow control `uplink` reaches; drain on SIGTERM. With an `index` (a relay of
    `--workers N`) it stops when the channel closes; without one (run alone) it goes on and connects again."""
    alone = index is None
    relay = Relay(uplink, index, _address(sock), drain)
    linked = asyncio.create_task(uplink.run(relay.handle, relay.joined, relay.left, reconnect=alone), name="uplink")
    await asyncio.wait([relay.configured, linked], timeout=None if alone else 60,
                       return_when=asyncio.FIRST_COMPLETED)
    if not relay.configured.done():
        if not linked.done():
            linked.cancel()
            raise TimeoutError("flow control sent no config within 60s")
        raise linked.exception() or ConnectionError("flow control closed the channel before sending its config")
    assert relay.pools is not None and relay.proxy is not None
    pools = relay.pools
    session = upstream_session(pools.loaded.config, lambda url: pools.loaded.replica_key(url))
    relay.proxy.session = session
    relay.proxy.upstream = UpstreamPool.for_config(pools.loaded.config)
    runner = web.AppRunner(relay.make_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=CUT_SECONDS)
    await runner.setup()
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    reporter = asyncio.create_task(relay.report_tokenizer(), name="tokenizer-report")
    log_event(logger, "relay_listening", relay=index, pid=os.getpid(), listen=relay.listen,
              event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
    stopped = asyncio.create_task(until_stopped())
    try:
        # A signal, or (a relay of --workers N) flow control gone: it cannot decide anything alone.
        await asyncio.wait([stopped, linked], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            draining = asyncio.create_task(relay.drain.run(runner, relay=index, pid=os.getpid(), listen=relay.listen))
            # A relay of --workers N whose flow control died meanwhile stops at once, as it would undrained.
            await asyncio.wait([draining] if alone else [draining, linked], return_when=asyncio.FIRST_COMPLETED)
            draining.cancel()
    finally:
        stopped.cancel()
        if not alone and uplink.closed:
            relay.pools.lost()
        linked.cancel()
        reporter.cancel()
        await runner.cleanup()
        relay.proxy.counter.close()
        relay.proxy.upstream.close()
        await session.close()
        if uplink.channel is not None:
            uplink.channel.close()


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_alone(addresses: list[str], host: str, port: int, secret: bytes, drain: Drain | None = None,
              reuse_port: bool = False) -> int:
    """`holdback gateway --role relay`: one relay on its own socket (shared with other relays of this host with
    `reuse_port`), for the first flow control that answers."""
    sock = listening_socket(host, port, reuse_port=reuse_port)
    return _run(serve(Uplink(addresses, secret), sock, None, drain), None)


def _run(main: Coroutine[object, object, None], index: int | None) -> int:
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(main)
    except (ConnectionError, FileNotFoundError, TimeoutError, aiohttp.ClientError) as exc:
        log_event(logger, "relay_failed", level=logging.ERROR, relay=index, error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.relays.relay", description=(
        "A relay process of `holdback gateway --workers N` (started by it, not by hand)."))
    p.add_argument("--fd", type=int, required=True, help="the inherited listening socket's file descriptor")
    p.add_argument("--channel", required=True, help="the flow-control process's Unix socket")
    p.add_argument("--index", type=int, default=0, help="this relay's number (for logs and /admin/state)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--drain-grace", type=float, default=DRAIN_GRACE, help="`holdback gateway --drain-grace`")
    p.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS, help="`holdback gateway --drain-seconds`")
    args = p.parse_args(argv)
    # A reload is flow control's (SIGHUP to the parent); a hangup sent to the whole group must not end relays.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging(args.log_level)
    try:
        secret = channel_secret(None)
    except SecretError as exc:
        log_event(logger, "relay_failed", level=logging.ERROR, relay=args.index, error=str(exc))
        return 2
    drain = Drain(args.drain_grace, args.drain_seconds)
    return _run(serve(Uplink([args.channel], secret), socket.socket(fileno=args.fd), args.index, drain), args.index)

if __name__ == "__main__":
    sys.exit(main())
