"""The channel between flow control and a relay: on a Unix socket (`--workers N`) or over TCP (a relay run alone).

Both ends first pass the handshake of gateway/relays/handshake.py; then every frame carries one message of
gateway/relays/messages.py, sealed with its MAC and validated as it is read. `Channel` sends without awaiting (the
single writer must never wait in the middle of a decision) and answers calls: `call()` sends a `Call` and awaits
the `Answer` with its id. A frame whose MAC fails closes the channel (`channel_peer_refused`, with the reason); a
frame that passes its MAC but is not a message of this protocol is logged and skipped; one announcing more than the
frame limit closes the channel (what follows it cannot be found). Each end sends a `ChannelHeartbeat` every
`heartbeat` seconds and closes a channel whose peer sent nothing for three of the peer's heartbeats
(`channel_peer_silent`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

from gateway.log import log_event
from pydantic import JsonValue

from gateway.relays.handshake import MAX_SEALED_FRAME, FrameSeal, PeerRefused, Role, Standby, handshake
from gateway.relays.messages import (LENGTH, Answer, Call, CallName, ChannelHeartbeat, Malformed, Message, decode,
                                     dump, frame_length)

logger = logging.getLogger("gateway.channel")
# A peer silent for this many of its heartbeats is gone.
SILENT_HEARTBEATS = 3


class ChannelClosed(ConnectionError):
    """The process at the other end of the channel is gone."""


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seal: FrameSeal,
                 peer: str = "peer", heartbeat: float = 1.0, peer_heartbeat: float = 1.0):
        self.reader = reader
        self.writer = writer
        self.seal = seal
        # Who is at the other end, for the log line of a frame refused.
        self.peer = peer
        # How often this end sends a ChannelHeartbeat, and how often the peer said it sends one.
        self.heartbeat = heartbeat
        self.peer_heartbeat = peer_heartbeat
        self.heard = time.monotonic()
        # Silence is judged only over TCP. On one host (`--workers N`, a Unix socket) a peer that dies closes its
        # end and this one reads EOF at once; a peer that is only starved of CPU (two cores shared with busy
        # engines went 5-12 s without running a process here) is still there and must not be cut off.
        self.judges_silence = isinstance(writer.get_extra_info("peername"), tuple)
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.refused = 0
        # Why the channel closed, once it has ("" when the peer closed it or this end stopped).
        self.reason = ""

    def send(self, message: Message) -> None:
        if self.closed:
            return
        self.writer.write(self.seal.seal(dump(message)))

    async def call(self, name: CallName, *args: JsonValue, timeout: float = 30.0) -> JsonValue:
        """Ask the other end and wait for its answer."""
        if self.closed:
            raise ChannelClosed("the flow-control channel is closed")
        call_id = next(self._ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self.send(Call(call_id=call_id, name=name, args=args))
        try:
            async with asyncio.timeout(timeout):  # not wait_for, which drops a cancellation that meets the answer
                return await future
        finally:
            self._calls.pop(call_id, None)

    def reply(self, call_id: int, value: JsonValue) -> None:
        self.send(Answer(call_id=call_id, value=value))

    async def serve(self, handle: Callable[[Message], None]) -> None:
        """Read messages until the channel closes; replies settle calls, heartbeats tell the peer is there,
        everything else goes to `handle`. Sends this end's heartbeats meanwhile."""
        pulse = asyncio.create_task(self._pulse(), name=f"heartbeat {self.peer}")
        try:
            await self._read(handle)
        finally:
            pulse.cancel()
            self.close()

    async def _read(self, handle: Callable[[Message], None]) -> None:
        read = self.reader.readexactly
        try:
            while True:
                size = frame_length(await read(LENGTH.size), MAX_SEALED_FRAME)
                body = self.seal.open(await read(size))
                self.heard = time.monotonic()
                try:
                    message = decode(body)
                except Malformed as exc:
                    self.refused += 1
                    log_event(logger, "channel_frame_refused", level=logging.ERROR, peer=self.peer, bytes=size,
                              error=str(exc))
                    continue
                if isinstance(message, ChannelHeartbeat):
                    self.peer_heartbeat = message.every
                elif isinstance(message, Answer):
                    future = self._calls.get(message.call_id)
                    if future is not None and not future.done():
                        future.set_result(message.value)
                else:
                    try:
                        handle(message)
                    except Exception as exc:  # a message this end could not apply: the next one may be fine
                        log_event(logger, "channel_message_failed", level=logging.ERROR, peer=self.peer,
                                  kind=message.kind, error=f"{type(exc).__name__}: {exc}")
        except PeerRefused as exc:
            self.refuse(exc.reason)
        except Malformed as exc:  # an oversized frame: the stream cannot be followed past it
            self.reason = str(exc)
            log_event(logger, "channel_frame_refused", level=logging.ERROR, peer=self.peer, error=str(exc),
                      hint="the channel is closed")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    def refuse(self, reason: str) -> None:
        """Close the channel to a peer that failed a check, saying why."""
        self.reason = reason
        log_event(logger, "channel_peer_refused", level=logging.ERROR, peer=self.peer, reason=reason)
        self.close()

    async def _pulse(self) -> None:
        """Send a heartbeat every `heartbeat` seconds; close the channel when the peer has been silent too long.
        A check after this loop itself was held up (a long turn of the event loop) waits one more round: what the
        peer sent meanwhile may not have been read yet."""
        sent = 0.0
        while not self.closed:
            interval = min(self.heartbeat, self.peer_heartbeat)
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - sent >= self.heartbeat:
                self.send(ChannelHeartbeat(every=self.heartbeat))
                sent = now
            if now - due > interval or not self.judges_silence:
                continue
            silent = now - self.heard
            if silent > SILENT_HEARTBEATS * self.peer_heartbeat:
                self.reason = (f"nothing heard for {silent:.1f}s, {SILENT_HEARTBEATS} of its heartbeats of "
                               f"{self.peer_heartbeat:g}s")
                log_event(logger, "channel_peer_silent", level=logging.ERROR, peer=self.peer, reason=self.reason)
                self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ChannelClosed("the flow-control channel closed"))
        self.writer.close()


def peer_name(writer: asyncio.StreamWriter) -> str:
    """The peer's address for log lines: host:port over TCP, the socket's path on a Unix socket."""
    address = writer.get_extra_info("peername")
    if isinstance(address, tuple) and len(address) >= 2:
        return f"[{address[0]}]:{address[1]}" if ":" in str(address[0]) else f"{address[0]}:{address[1]}"
    return str(address or writer.get_extra_info("sockname") or "unix socket")


async def secure_channel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, role: Role,
                         heartbeat: float, standby: bool = False, peer: str | None = None) -> Channel:
    """The channel over a connection made either way, once the peer passed the handshake; `PeerRefused` (logged,
    the connection closed) if it failed, `Standby` (logged as such) when the flow control reached does not lead.
    A flow control that does not lead greets as `standby`."""
    peer = peer or peer_name(writer)
    try:
        session = await handshake(reader, writer, secret, role, heartbeat, standby=standby)
    except PeerRefused as exc:
        if isinstance(exc, Standby):
            log_event(logger, "flow_control_standby", peer=peer, reason=exc.reason, hint="trying its next address")
        else:
            log_event(logger, "channel_peer_refused", level=logging.ERROR, peer=peer, reason=exc.reason)
        writer.close()
        raise
    return Channel(reader, writer, session.seal, peer=peer, heartbeat=heartbeat, peer_heartbeat=session.peer_heartbeat)


async def open_channel(address: str, secret: bytes, role: Role, heartbeat: float) -> Channel:
    """Connect to `address` (HOST:PORT, or a Unix socket's path) and pass the handshake; `PeerRefused` when the
    peer fails it (logged), `OSError` when nothing answers there."""
    if address.startswith("/"):
        reader, writer = await asyncio.open_unix_connection(address)
    else:
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
    try:
        return await secure_channel(reader, writer, secret, role, heartbeat, peer=address)
    except BaseException:  # a handshake timed out or cancelled (a silent peer) must not leave its socket open
        writer.close()
        raise


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPv6]:PORT`) → (host, port); `ValueError` saying what is wrong."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:8300 or [::1]:8300)")
    return host, int(port)
