"""A caller that leaves just as the gateway's awaited step completes is still a caller that left.

Python 3.11's `asyncio.wait_for` returns the inner result and drops the cancellation when both land in the same
turn of the loop. The gateway opened each replica connection that way, so a request whose caller left (or that
was evicted) just as its connection opened went on to wait for the replica's whole answer, holding its slot: the
adaptive-reserve test saw two realtime requests stay in flight 30 s after their callers left, in loaded suites
and reliably with the cores busy. The relays' calls to the flow-control process waited the same way. Each test
makes the two events meet in one turn, deterministically, and needs the cancellation to arrive.
"""

from __future__ import annotations

import asyncio
import socket

from gateway.relays.channel import Channel
from gateway.relays.handshake import FrameSeal
from gateway.upstream import UpstreamPool


async def _cancelled_in_time(task: asyncio.Task) -> bool:
    done, _ = await asyncio.wait({task}, timeout=10)
    return task in done and task.cancelled()


def test_a_caller_leaving_as_the_replica_connection_opens_ends_the_request():
    async def main() -> bool:
        server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(limit=4, connect_timeout=5, total_timeout=None)
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        handler: asyncio.Task | None = None

        async def open_then_caller_leaves(*args, **kwargs):
            opened = await real(*args, **kwargs)
            handler.cancel()  # the caller's connection closes in the turn the replica's opens
            return opened

        loop.create_connection = open_then_caller_leaves  # type: ignore[method-assign]

        async def handle() -> None:
            conn = await pool.open(f"http://127.0.0.1:{port}")
            try:
                await asyncio.sleep(60)  # the wait for the replica's answer
            finally:
                conn.close()

        handler = asyncio.create_task(handle())
        try:
            return await _cancelled_in_time(handler)
        finally:
            del loop.create_connection
            handler.cancel()
            pool.close()
            server.close()

    assert asyncio.run(main()), "the request went on waiting for its answer after its caller left"


def test_a_relay_call_answered_as_its_caller_leaves_ends_the_call():
    async def main() -> bool:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        channel = Channel(reader, writer, FrameSeal(b"k" * 32, b"j" * 32))
        caller = asyncio.create_task(channel.call("state"))
        while not channel._calls:
            await asyncio.sleep(0)
        (answer,) = channel._calls.values()
        answer.set_result("dispatched")  # the flow-control process answers ...
        caller.cancel()  # ... in the turn the caller leaves
        try:
            return await _cancelled_in_time(caller)
        finally:
            writer.close()
            theirs.close()

    assert asyncio.run(main()), "the relay went on with a call whose caller had left"
