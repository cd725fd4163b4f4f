"""An upload that trickles is dropped: at least `upload_min_bytes_per_minute` in every window, or 408."""

from __future__ import annotations

import asyncio

import pytest

from batch_api.errors import RequestTimeout
from batch_api.uploads import paced


async def body(chunks: list[bytes], gap: float):
    for chunk in chunks:
        await asyncio.sleep(gap)
        yield chunk


async def collect(source, min_bytes: int, window: float) -> bytes:
    return b"".join([chunk async for chunk in paced(source, min_bytes, window)])


def test_an_upload_at_pace_is_passed_through_whole():
    chunks = [bytes([i]) * 100 for i in range(10)]
    assert asyncio.run(collect(body(chunks, 0.01), min_bytes=100, window=0.2)) == b"".join(chunks)


def test_a_byte_at_a_time_is_dropped_once_a_window_passes_short():
    with pytest.raises(RequestTimeout) as exc:
        asyncio.run(collect(body([b"x"] * 1000, 0.02), min_bytes=1000, window=0.3))
    assert exc.value.status == 408 and "must send each minute" in exc.value.message


def test_an_upload_that_stops_sending_is_dropped_after_a_window():
    async def stalls():
        yield b"x" * 5000
        await asyncio.Event().wait()  # sends nothing more, and never ends

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RequestTimeout):
            await collect(stalls(), min_bytes=1000, window=0.2)
        return loop.time() - started
    assert asyncio.run(main()) < 5.0  # dropped at the end of its second window, not waited on for ever
