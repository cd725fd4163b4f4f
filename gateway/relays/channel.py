"""The channel between the flow-control process and its relays (`holdback gateway --workers N`).

A Unix domain socket carrying the frames of gateway/relays/messages.py: typed messages, validated as they are
read. `Channel` sends without awaiting (the single writer must never wait in the middle of a decision) and
answers calls: `call()` sends a `Call` and awaits the `Answer` with its id. A frame that is not a message of this
protocol is logged and skipped; one announcing more than the frame limit closes the channel (what follows it
cannot be found), and the process at the other end is then treated as gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

from gateway.log import log_event
from pydantic import JsonValue

from gateway.relays.messages import LENGTH, Answer, Call, CallName, Malformed, Message, decode, encode, frame_length

logger = logging.getLogger("gateway.channel")


class ChannelClosed(ConnectionError):
    """The process at the other end of the channel is gone."""


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str = "peer"):
        self.reader = reader
        self.writer = writer
        # Who is at the other end, for the log line of a frame refused.
        self.peer = peer
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.refused = 0

    def send(self, message: Message) -> None:
        if self.closed:
            return
        self.writer.write(encode(message))

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
        """Read messages until the other end closes; replies settle calls, everything else goes to `handle`."""
        read = self.reader.readexactly
        try:
            while True:
                size = frame_length(await read(LENGTH.size))
                try:
                    message = decode(await read(size))
                except Malformed as exc:
                    self.refused += 1
                    log_event(logger, "channel_frame_refused", level=logging.ERROR, peer=self.peer, bytes=size,
                              error=str(exc))
                    continue
                if isinstance(message, Answer):
                    future = self._calls.get(message.call_id)
                    if future is not None and not future.done():
                        future.set_result(message.value)
                    continue
                try:
                    handle(message)
                except Exception as exc:  # a message this end could not apply: the next one may be fine
                    log_event(logger, "channel_message_failed", level=logging.ERROR, peer=self.peer,
                              kind=message.kind, error=f"{type(exc).__name__}: {exc}")
        except Malformed as exc:  # an oversized frame: the stream cannot be followed past it
            log_event(logger, "channel_frame_refused", level=logging.ERROR, peer=self.peer, error=str(exc),
                      hint="the channel is closed; the relay is replaced")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ChannelClosed("the flow-control channel closed"))
        self.writer.close()
