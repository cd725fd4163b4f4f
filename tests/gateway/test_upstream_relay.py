"""The gateway's lean upstream relay (gateway/upstream.py) against a scripted replica speaking raw HTTP/1.1.

The simulator always answers the same way; this replica answers each body framing (chunked, Content-Length,
close-delimited), breaks a stream half-way, keeps connections alive, and records when the gateway stopped
reading its stream (backpressure), so the relay's byte path is checked where the simulator cannot reach.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests.support import free_port

EVENTS = [b'data: {"i": %d}\n\n' % i for i in range(50)] + [b"data: [DONE]\n\n"]
SSE = b"".join(EVENTS)
BIG_CHUNK = b'data: {"pad": "' + b"x" * 65_000 + b'"}\n\n'
MODELS = json.dumps({"data": [{"id": "m", "root": "m", "max_model_len": 4096}]}).encode()


class ScriptedReplica:
    """An HTTP/1.1 server on its own thread and loop; the `x-mode` request header picks the answer."""

    def __init__(self) -> None:
        self.port = free_port()
        self.connections = 0
        self.stream_connections: list[int] = []  # the connection number of each streamed POST
        self.drop_next: set[int] = set()  # connections to close, unanswered, at their next POST
        self.dropped = 0
        self.blocked = threading.Event()  # the gateway stopped reading the big stream
        self.written_when_blocked = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _version = lines[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET":
                    body = MODELS if path == "/v1/models" else b"{}" if path == "/version" else b""
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    await writer.drain()
                    continue
                if number in self.drop_next:  # as if its keep-alive ran out just as the request came
                    self.drop_next.discard(number)
                    self.dropped += 1
                    break
                self.stream_connections.append(number)
                mode = headers.get("x-mode", "")
                if not await self._answer("chunked" if mode == "stale-next" else mode, writer):
                    break
                if mode == "stale-next":
                    self.drop_next.add(number)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, mode: str, writer: asyncio.StreamWriter) -> bool:
        """Write one answer; False when the connection must end after it."""
        sse_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        if mode == "chunked":
            writer.write(sse_head + b"Transfer-Encoding: chunked\r\n\r\n")
            for event in EVENTS:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        elif mode == "length":
            body = json.dumps({"choices": [{"text": "whole"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
        elif mode == "close":
            writer.write(sse_head + b"Connection: close\r\n\r\n")
            for event in EVENTS:
                writer.write(event)
                await writer.drain()
            await writer.drain()
            return False
        elif mode == "broken":
            writer.write(sse_head + b"Transfer-Encoding: chunked\r\n\r\n")
            for event in EVENTS[:5]:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            return False
        elif mode == "big":
            writer.write(sse_head + b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(BIG_COUNT):
                writer.write(b"%x\r\n%s\r\n" % (len(BIG_CHUNK), BIG_CHUNK))
                drained = asyncio.ensure_future(writer.drain())
                done, _ = await asyncio.wait({drained}, timeout=2)
                if not done and not self.blocked.is_set():  # nobody has read for 2 s
                    self.written_when_blocked = (i + 1) * len(BIG_CHUNK)
                    self.blocked.set()
                await drained
            writer.write(b"0\r\n\r\n")
        else:
            raise AssertionError(f"unknown mode {mode!r}")
        await writer.drain()
        return True


BIG_COUNT = 1024  # 64 MB: more than the kernel's socket buffers on both sides of the gateway hold


@pytest.fixture
def replica():
    r = ScriptedReplica()
    yield r
    r.stop()


def post(gw, mode: str, **kwargs) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "stream": True, "messages": []},
                      headers={"x-mode": mode}, timeout=30, **kwargs)


def test_each_body_framing_is_relayed_byte_for_byte_over_one_kept_alive_connection(stack, replica):
    gw = stack.gateway([replica.url], "admission: {enabled: false}\n")
    first = post(gw, "chunked")
    assert first.status_code == 200 and first.content == SSE
    assert first.headers["content-type"] == "text/event-stream"
    assert first.headers["x-holdback-replica"] == replica.url
    assert post(gw, "chunked").content == SSE
    answer = post(gw, "length")
    assert answer.status_code == 200 and answer.json() == {"choices": [{"text": "whole"}]}
    assert answer.headers["content-length"] == str(len(answer.content))
    # Sequential requests reuse one pooled connection (the health checks use their own).
    assert len(set(replica.stream_connections)) == 1, replica.stream_connections
    closed = post(gw, "close")
    assert closed.status_code == 200 and closed.content == SSE
    assert post(gw, "chunked").content == SSE  # a fresh connection after the replica closed the last one
    assert replica.stream_connections[-1] != replica.stream_connections[-2]


def test_a_pooled_connection_the_replica_closed_is_sent_again_on_a_new_one(stack, replica):
    gw = stack.gateway([replica.url], "admission: {enabled: false}\n")
    assert post(gw, "stale-next").content == SSE
    # The next request goes out on the pooled connection, which the replica closes unanswered. The gateway puts a
    # connection back in its pool once it has read the answer's end, which on a loaded machine can come after the
    # caller has the answer: a request sent before that takes a new connection, so send until one met it.
    for _ in range(20):
        again = post(gw, "chunked")
        assert again.status_code == 200 and again.content == SSE
        if replica.dropped:
            break
    assert replica.dropped == 1
    assert replica.stream_connections[-1] != replica.stream_connections[0]


def test_a_stream_the_replica_breaks_is_broken_for_the_caller_too(stack, replica):
    gw = stack.gateway([replica.url], "admission: {enabled: false}\n")
    with pytest.raises(httpx.RemoteProtocolError):
        post(gw, "broken")
    assert "stream_broken" in gw.log()
    assert post(gw, "chunked").content == SSE  # the gateway goes on serving


def test_a_caller_that_does_not_read_stops_the_gateway_reading_the_replica(stack, replica):
    gw = stack.gateway([replica.url], "admission: {enabled: false}\n")
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", gw.url + "/v1/chat/completions", headers={"x-mode": "big"},
                           json={"model": "m", "stream": True, "messages": []}) as response:
            assert response.status_code == 200
            # The caller reads nothing more: the replica's writes must back up (the gateway paused its reads)
            # instead of the gateway buffering the stream.
            assert replica.blocked.wait(30), "the replica's writes never backed up"
            assert replica.written_when_blocked < BIG_COUNT * len(BIG_CHUNK) / 2, replica.written_when_blocked
            received = sum(len(part) for part in response.iter_bytes())
    assert received == BIG_COUNT * len(BIG_CHUNK)
