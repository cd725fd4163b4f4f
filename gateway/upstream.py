"""The gateway's lean upstream client: one HTTP/1.1 exchange with a replica on an asyncio Protocol.

The replica's response is parsed by httptools inside `data_received`. Until the proxy has sent the response
headers (held until the first body chunk), body bytes are buffered and the handler task is woken; after that
(`UpstreamConnection.relay`) each body chunk goes straight from the parser callback to the caller's transport,
re-framed as one HTTP chunk when the caller's response is chunked, with the KV ledger's token count kept in
the same callback. The handler task is woken only at the end, on an error, when the caller has left, or when
the caller's transport is over its high-water mark (the replica's transport stops reading until it drains).
Connections are kept alive and pooled per replica URL; an idle one is closed after `IDLE_SECONDS`.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Callable
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

# A streamed answer's body buffered before the handler relays it (the first chunk's wait for the caller's
# transport to drain): above this the replica's connection stops reading.
BUFFER_LIMIT = 2**16
# Below uvicorn's default keep-alive (5 s), so a pooled connection is rarely one the replica has just closed.
IDLE_SECONDS = 4.0


class UpstreamError(Exception):
    """The replica broke the exchange: closed it early, sent bad HTTP, or ran past the total timeout."""


class ConnectFailed(UpstreamError):
    """No connection to the replica: nothing reached it, so another replica may take the request."""

    def __init__(self, url: str, os_error: OSError):
        super().__init__(f"cannot connect to {url}: {os_error}")
        self.os_error = os_error


def connection_limit(cfg) -> int:  # noqa: ANN001 - a GatewayConfig
    """Simultaneous connections to the replicas: `upstream.connectionLimit`, or twice what flow control can
    dispatch (Σ replica capacity × (1 + headroom)) plus 64, at least 256."""
    slots = sum(cfg.capacity(url) * (1 + cfg.saturation.headroom) for url in cfg.replicas)
    for pool in cfg.pools:  # each pool's replicas with its own engine and saturation settings
        own = cfg.of_pool(pool)
        slots += sum(own.capacity(url) * (1 + own.saturation.headroom) for url in pool.replicas)
    return cfg.upstream.connectionLimit or max(256, int(slots * 2) + 64)


class UpstreamConnection(asyncio.Protocol):
    """A pooled connection to one replica; one exchange at a time (`send`, then the handler waits on it)."""

    def __init__(self, pool: UpstreamPool, url: str):
        self.pool = pool
        self.url = url
        parts = urlsplit(url)
        self.host = parts.netloc
        # A replica behind a path (`http://host/vllm-a`, a reverse proxy's route): every target goes under it.
        self.base_path = parts.path.rstrip("/")
        self.transport: asyncio.Transport | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        self.deadline_handle: asyncio.TimerHandle | None = None  # the pool's total timeout of this exchange
        self.reused = False  # taken from the idle pool: the replica may have closed it meanwhile
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.sized = False  # a Content-Length
        self.framed = False  # Content-Length or chunked: the body does not end at close
        self.keep_alive = False
        self.pieces: list[bytes] = []
        self.streaming = False  # set by the handler for a streamed answer: buffering before `relay` is bounded
        self.buffered = 0
        self.held = False  # reading paused until the handler takes the buffered body
        self.complete = False
        self.received = False  # any byte of this exchange's answer arrived
        self.error: BaseException | None = None
        self.closed = False  # closed by us: the end of the connection is no error
        self.waiter: asyncio.Future | None = None
        # Relay mode (set by `relay`): the caller's transport and protocol, chunk framing, and what is waited on.
        self.client: asyncio.Transport | None = None
        self.client_protocol = None
        self.chunked_out = False
        self.paused = False
        self.left = False
        self.counter: Callable[[bytes], None] | None = None

    # -- transport callbacks --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.complete or self.closed:  # nothing is expected between exchanges
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self._fail(exc.__context__ or exc)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(UpstreamError(f"the replica sent bad HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._forget(self)
        if self.closed or self.complete:
            return
        if self.status and not self.framed:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
            return
        self._fail(UpstreamError("the replica closed the connection" + (f": {exc}" if exc else "")))

    # -- parser callbacks -----------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            self.sized = self.framed = True
        elif lower == b"transfer-encoding" and b"chunked" in value.lower():
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.status in (204, 304):
            self.framed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        # The relay's hot path: one call per body chunk of the replica's response.
        client = self.client
        if client is None:
            self.pieces.append(body)
            if self.streaming:
                self.buffered += len(body)
                if self.buffered > BUFFER_LIMIT and not self.held and not self.closed:
                    self.held = True
                    self.transport.pause_reading()  # type: ignore[union-attr]
            self._wake()
            return
        if self.counter is not None:
            self.counter(body)
        if client.is_closing():
            self.left = True
            self.close()
            self._wake()
            return
        client.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked_out else body)
        if self.client_protocol.writing_paused and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the handler's side ---------------------------------------------------------------------------------
    def send(self, method: str, target: str, headers: CIMultiDict, body: bytes) -> None:
        """Write the request for `target` (the caller's path and query, under the replica URL's own path); the
        exchange fails with a timeout after the pool's `total_timeout` (until `put`)."""
        if self.pool.total_timeout:
            self.deadline_handle = asyncio.get_running_loop().call_later(self.pool.total_timeout, self.expire)
        lines = [f"{method} {self.base_path}{target} HTTP/1.1", f"Host: {self.host}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)  # type: ignore[union-attr]

    async def wait(self) -> None:
        """Until the next event (headers, body, end, caller gone, backpressure); raises the exchange's error."""
        if self.error is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        """The body buffered so far (before `relay`)."""
        pieces, self.pieces = self.pieces, []
        self.buffered = 0
        if self.held:
            self.held = False
            if not self.closed:
                self.transport.resume_reading()  # type: ignore[union-attr]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def relay(self, client: asyncio.Transport, client_protocol, chunked: bool,
              counter: Callable[[bytes], None] | None) -> None:
        """From now on body chunks go to `client` as they arrive (call with nothing buffered)."""
        assert not self.pieces
        self.client, self.client_protocol, self.chunked_out, self.counter = client, client_protocol, chunked, counter

    def resume(self) -> None:
        """The caller's transport drained: read the replica again."""
        self.paused = False
        if not self.closed and self.transport is not None:
            self.transport.resume_reading()

    def expire(self) -> None:
        self._fail(asyncio.TimeoutError(f"the replica did not finish within {self.pool.total_timeout} s"))

    def close(self) -> None:
        """Drop the connection (the replica aborts the request); it is never pooled again."""
        self.client = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def unanswered(self) -> bool:
        """The replica closed (or reset) the connection before one byte of its answer came back. Sending the
        request once more is safe: an inference request has no effect beyond its compute, and none of its
        answer was relayed."""
        return not self.received and type(self.error) is UpstreamError

    def stale(self) -> bool:
        """Unanswered on a pooled connection: most likely the replica closed it while it sat idle (its keep-alive
        ran out), so a new connection to the same replica may take the request."""
        return self.reused and self.unanswered()

    def reusable(self) -> bool:
        return (self.complete and self.keep_alive and not self.closed and not self.paused and not self.held
                and self.transport is not None and not self.transport.is_closing())

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = exc
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class UpstreamPool:
    """Keep-alive connections to the replicas, at most `limit` in use at once (the rest wait)."""

    def __init__(self, limit: int, connect_timeout: float, total_timeout: float | None):
        self.connect_timeout = connect_timeout
        self.total_timeout = total_timeout
        self._slots = asyncio.Semaphore(limit)
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._ssl: ssl.SSLContext | None = None

    @classmethod
    def for_config(cls, cfg) -> UpstreamPool:  # noqa: ANN001 - a GatewayConfig
        return cls(connection_limit(cfg), cfg.upstream.connectTimeoutSeconds, cfg.upstream.timeoutSeconds or None)

    async def open(self, url: str, fresh: bool = False) -> UpstreamConnection:
        """A connection to `url` (a pooled one when idle, unless `fresh`); raises ConnectFailed, or TimeoutError
        on connect."""
        await self._slots.acquire()
        try:
            idle = None if fresh else self._idle.get(url)
            while idle:
                conn = idle.pop()
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                    conn.idle_handle = None
                if conn.transport is not None and not conn.transport.is_closing():
                    conn._reset()
                    conn.reused = True
                    return conn
            return await self._connect(url)
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self, url: str) -> UpstreamConnection:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the connection and drops a cancellation
            # that lands as the connection completes (a caller leaving, an eviction), and the handler then waited
            # for the whole answer of a request nobody was waiting for, holding its slot.
            async with asyncio.timeout(self.connect_timeout):
                _transport, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, url), parts.hostname, parts.port or (443 if secure else 80),
                    ssl=self._ssl if secure else None)
        except OSError as exc:
            raise ConnectFailed(url, exc) from exc
        return conn

    def put(self, conn: UpstreamConnection) -> None:
        """The exchange is over: pool the connection if it can carry another, else close it."""
        self._slots.release()
        if conn.deadline_handle is not None:
            conn.deadline_handle.cancel()
            conn.deadline_handle = None
        if not conn.reusable():
            conn.close()
            return
        conn.idle_handle = asyncio.get_running_loop().call_later(IDLE_SECONDS, self._expire, conn)
        self._idle.setdefault(conn.url, []).append(conn)

    def _expire(self, conn: UpstreamConnection) -> None:
        conn.idle_handle = None
        self._forget(conn)
        conn.close()

    def _forget(self, conn: UpstreamConnection) -> None:
        idle = self._idle.get(conn.url)
        if idle and conn in idle:
            idle.remove(conn)
            if conn.idle_handle is not None:
                conn.idle_handle.cancel()
                conn.idle_handle = None

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                conn.close()
        self._idle.clear()


def response_headers(raw: list[tuple[bytes, bytes]], skip: frozenset[str]) -> CIMultiDict:
    out: CIMultiDict = CIMultiDict()
    for name, value in raw:
        key = name.decode("latin-1")
        if key.lower() not in skip:
            out.add(key, value.decode("latin-1"))
    return out
