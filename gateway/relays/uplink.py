"""A relay's link to flow control, whichever channel carries it at the moment.

It asks every one of its addresses at once and keeps the first that passes the handshake: a flow control paused
mid-handshake (SIGSTOP, a long GC pause, a partition) accepts the connection and answers nothing until the handshake
times out, and asked in order it held back every address after it (a relay found the standby that led 6-16 s after
its leader paused). While its leader is quiet for a heartbeat and a half, it asks the others whether one leads now,
and moves to one that does without waiting for the channel's silence cut. A relay of
`--workers N` has one address (its parent's Unix socket) and stops when the channel closes; a relay run alone
(`--role relay`) connects again, over every address in turn, after a pause that doubles up to `BACKOFF_CAP`; while
one of them answers as a standby (a leader is being elected: the old one's lease has yet to lapse), it tries again
every `STANDBY_RETRY` seconds for up to `STANDBY_RETRY_FOR`, so it finds the new leader soon after it leads. While
no channel is up, `send` drops the message (flow control has released what it concerned) and `call` raises
`ChannelClosed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from pydantic import JsonValue

from gateway.log import log_event
from gateway.relays import messages as m
from gateway.relays.channel import Channel, ChannelClosed, open_channel
from gateway.relays.handshake import HANDSHAKE_SECONDS, PeerRefused, Standby

logger = logging.getLogger("gateway.relay")

BACKOFF_FIRST = 0.2
BACKOFF_CAP = 5.0
# A standby answers in a round trip and a handshake: asking it again this often costs it little, for a while.
STANDBY_RETRY = 0.25
# Longer than a lease (default 6 s) plus a relay's notice of a silent leader: a standby that still stands by after
# this is not about to lead (the leader is alive and out of this relay's reach), and the capped backoff applies.
STANDBY_RETRY_FOR = 15.0
# A leader silent for this many of its heartbeats may be paused: the relay asks its other addresses whether one of
# them leads now (a standby that took the lease passes the handshake), instead of waiting for the channel's
# silence cut (three heartbeats), and moves to it at once.
QUIET_HEARTBEATS = 1.5


class Uplink:
    def __init__(self, addresses: list[str], secret: bytes, heartbeat: float = 1.0):
        self.addresses = addresses
        self.secret = secret
        self.heartbeat = heartbeat
        self.channel: Channel | None = None
        # Whether one of the addresses answered as a standby at the last attempt to connect.
        self.standby_answered = False
        # Handshakes under way, by address; one a silent peer holds is asked on by the next `connect`, not again.
        self._attempts: dict[str, asyncio.Task[Channel]] = {}
        # A channel to a flow control found leading while the one in use was quiet: the next one to serve.
        self._successor: Channel | None = None

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
        """A channel to the first address that passes the handshake, all of them asked at once; `ConnectionError`
        saying why each failed once none can pass now: every one answered and refused, or was unreachable, or a
        standby answered while the others are still silent (the standby is asked again soon; a silent one's
        handshake goes on until it answers or times out, and is not begun again meanwhile)."""
        self.standby_answered = False
        failures: dict[str, str] = {}
        for address in self.addresses:
            if address not in self._attempts:
                self._attempts[address] = asyncio.create_task(self._open(address))
        try:
            while True:
                winner = None
                for address, task in list(self._attempts.items()):
                    if not task.done():
                        continue
                    del self._attempts[address]
                    try:
                        channel = task.result()
                    except PeerRefused as exc:
                        self.standby_answered |= isinstance(exc, Standby)
                        failures[address] = exc.reason
                    except (OSError, TimeoutError) as exc:
                        failures[address] = f"{type(exc).__name__}: {exc}"
                    else:
                        if winner is None:
                            winner = channel
                        else:  # two passed at once (only a leader accepts a relay): keep the first
                            channel.close()
                if winner is not None:
                    await self._abandon()
                    self.channel = winner
                    return winner
                if not self._attempts or self.standby_answered:
                    raise ConnectionError("; ".join(f"{a}: {failures.get(a, 'no answer yet (asked on)')}"
                                                    for a in self.addresses))
                await asyncio.wait(self._attempts.values(), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._abandon()
            raise

    async def _watch(self, channel: Channel) -> None:
        """While `channel` serves: each time its peer has been quiet for `QUIET_HEARTBEATS` of its heartbeats, ask
        the other addresses whether one leads; if one does, keep that channel for next and close this one."""
        others = [address for address in self.addresses if address != channel.peer]
        while others and channel.judges_silence and not channel.closed:
            await asyncio.sleep(channel.peer_heartbeat / 2)
            if time.monotonic() - channel.heard < QUIET_HEARTBEATS * channel.peer_heartbeat:
                continue
            found = await asyncio.gather(*(self._open(address) for address in others), return_exceptions=True)
            leaders = [c for c in found if isinstance(c, Channel)]
            for extra in leaders[1:]:
                extra.close()
            if leaders and not channel.closed:
                self._successor = leaders[0]
                channel.reason = (f"{leaders[0].peer} leads now, while {channel.peer} has been silent for "
                                  f"{time.monotonic() - channel.heard:.1f}s")
                log_event(logger, "flow_control_moved", level=logging.WARNING, reason=channel.reason)
                channel.close()
                return
            for extra in leaders:
                extra.close()

    async def _open(self, address: str) -> Channel:
        async with asyncio.timeout(HANDSHAKE_SECONDS + 5):
            return await open_channel(address, self.secret, "relay", self.heartbeat)

    async def _abandon(self) -> None:
        """Cancel the handshakes still under way (each closes its connection)."""
        attempts, self._attempts = list(self._attempts.values()), {}
        for task in attempts:
            task.cancel()
        for result in await asyncio.gather(*attempts, return_exceptions=True):
            if isinstance(result, Channel):  # it passed as it was cancelled
                result.close()

    async def run(self, handle: Callable[[m.Message], None], joined: Callable[[], None],
                  left: Callable[[str], None], reconnect: bool) -> None:
        """Connect and serve the channel; when it closes, `left(reason)`, and connect again if `reconnect` (else
        return). Without `reconnect`, a first connection that fails raises its `ConnectionError`."""
        try:
            await self._serve(handle, joined, left, reconnect)
        finally:
            await self._abandon()
            if self._successor is not None:
                self._successor.close()

    async def _serve(self, handle: Callable[[m.Message], None], joined: Callable[[], None],
                     left: Callable[[str], None], reconnect: bool) -> None:
        pause, electing_since = BACKOFF_FIRST, None  # since when a standby answers (a leader being elected)
        loop = asyncio.get_running_loop()
        while True:
            try:
                channel, self._successor = self._successor or await self.connect(), None
            except ConnectionError as exc:
                if not reconnect:
                    raise
                if self.standby_answered:
                    if electing_since is None:
                        electing_since = loop.time()
                        log_event(logger, "flow_control_electing", level=logging.WARNING, error=str(exc),
                                  retry_every=STANDBY_RETRY, for_seconds=STANDBY_RETRY_FOR)
                    if loop.time() - electing_since < STANDBY_RETRY_FOR:
                        await asyncio.sleep(STANDBY_RETRY)
                        continue
                log_event(logger, "flow_control_unreachable", level=logging.WARNING, error=str(exc),
                          retry_in=round(pause, 2))
                await asyncio.sleep(pause)
                pause = min(pause * 2, BACKOFF_CAP)
                continue
            self.channel = channel
            pause, electing_since = BACKOFF_FIRST, None
            log_event(logger, "flow_control_connected", address=channel.peer)
            joined()
            watch = asyncio.create_task(self._watch(channel), name="leader watch")
            try:
                await channel.serve(handle)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            left(channel.reason or "flow control closed the channel")
            if not reconnect:
                return
