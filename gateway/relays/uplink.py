"""A relay's link to flow control, whichever channel carries it at the moment.

It connects to the first of its addresses that answers and passes the handshake, in the order given. A relay of
`--workers N` has one address (its parent's Unix socket) and stops when the channel closes; a relay run alone
(`--role relay`) connects again, over every address in turn, after a pause that doubles up to `BACKOFF_CAP`. While
no channel is up, `send` drops the message (flow control has released what it concerned) and `call` raises
`ChannelClosed`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pydantic import JsonValue

from gateway.log import log_event
from gateway.relays import messages as m
from gateway.relays.channel import Channel, ChannelClosed, open_channel
from gateway.relays.handshake import HANDSHAKE_SECONDS, PeerRefused

logger = logging.getLogger("gateway.relay")

BACKOFF_FIRST = 0.2
BACKOFF_CAP = 5.0


class Uplink:
    def __init__(self, addresses: list[str], secret: bytes, heartbeat: float = 1.0):
        self.addresses = addresses
        self.secret = secret
        self.heartbeat = heartbeat
        self.channel: Channel | None = None

    @property
    def closed(self) -> bool:
        return self.channel is None or self.channel.closed

    def send(self, message: m.Message) -> None:
        if self.channel is not None:
            self.channel.send(message)

    async def call(self, name: m.CallName, *args: JsonValue, timeout: float = 30.0) -> JsonValue:
        if self.channel is None:
            raise ChannelClosed("no channel to flow control")
        return await self.channel.call(name, *args, timeout=timeout)

    def reply(self, call_id: int, value: JsonValue) -> None:
        self.send(m.Answer(call_id=call_id, value=value))

    def set_heartbeat(self, seconds: float) -> None:
        """Flow control's config says how often to beat (from now on, and on later channels)."""
        self.heartbeat = seconds
        if self.channel is not None:
            self.channel.heartbeat = seconds

    async def connect(self) -> Channel:
        """A channel to the first address that passes the handshake; `ConnectionError` saying why each failed."""
        failures = []
        for address in self.addresses:
            try:
                async with asyncio.timeout(HANDSHAKE_SECONDS + 5):
                    self.channel = await open_channel(address, self.secret, "relay", self.heartbeat)
                return self.channel
            except PeerRefused as exc:
                failures.append(f"{address}: {exc.reason}")
            except (OSError, TimeoutError) as exc:
                failures.append(f"{address}: {type(exc).__name__}: {exc}")
        raise ConnectionError("; ".join(failures))

    async def run(self, handle: Callable[[m.Message], None], joined: Callable[[], None],
                  left: Callable[[str], None], reconnect: bool) -> None:
        """Connect and serve the channel; when it closes, `left(reason)`, and connect again if `reconnect` (else
        return). Without `reconnect`, a first connection that fails raises its `ConnectionError`."""
        pause = BACKOFF_FIRST
        while True:
            try:
                channel = await self.connect()
            except ConnectionError as exc:
                if not reconnect:
                    raise
                log_event(logger, "flow_control_unreachable", level=logging.WARNING, error=str(exc),
                          retry_in=round(pause, 2))
                await asyncio.sleep(pause)
                pause = min(pause * 2, BACKOFF_CAP)
                continue
            pause = BACKOFF_FIRST
            log_event(logger, "flow_control_connected", address=channel.peer)
            joined()
            await channel.serve(handle)
            left(channel.reason or "flow control closed the channel")
            if not reconnect:
                return
