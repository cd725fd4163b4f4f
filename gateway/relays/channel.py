"""The local channel between the flow-control process and its relays (`holdback gateway --workers N`).

A Unix domain socket carrying length-prefixed messages: a 4-byte big-endian length, then a pickled tuple whose
first item names the message. Both ends are processes of one gateway, started by the same parent, and the
socket lives in a directory only its user can open, so pickle's trust assumption holds here and nowhere else.
`Channel` sends without awaiting (the single writer must never wait in the middle of a decision) and answers
calls: `call()` sends ("call", id, name, *args) and awaits the matching ("reply", id, value).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import struct
from typing import Any, Callable

_LENGTH = struct.Struct(">I")


class ChannelClosed(ConnectionError):
    """The process at the other end of the channel is gone."""


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.closed = False

    def send(self, message: tuple) -> None:
        if self.closed:
            return
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_LENGTH.pack(len(data)) + data)

    async def call(self, name: str, *args: Any, timeout: float = 30.0) -> Any:
        """Ask the other end and wait for its answer."""
        if self.closed:
            raise ChannelClosed("the flow-control channel is closed")
        call_id = next(self._ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self.send(("call", call_id, name, *args))
        try:
            async with asyncio.timeout(timeout):  # not wait_for, which drops a cancellation that meets the answer
                return await future
        finally:
            self._calls.pop(call_id, None)

    def reply(self, call_id: int, value: Any) -> None:
        self.send(("reply", call_id, value))

    async def serve(self, handle: Callable[[tuple], None]) -> None:
        """Read messages until the other end closes; replies settle calls, everything else goes to `handle`."""
        read = self.reader.readexactly
        try:
            while True:
                (size,) = _LENGTH.unpack(await read(4))
                message = pickle.loads(await read(size))
                if message[0] == "reply":
                    future = self._calls.get(message[1])
                    if future is not None and not future.done():
                        future.set_result(message[2])
                    continue
                handle(message)
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
