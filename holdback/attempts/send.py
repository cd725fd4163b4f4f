"""The HTTP side of an attempt: the plain send, the streamed send (its events folded by `stream`), and the one
mapping of a send that got no complete answer (`transport_reply`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import aiohttp

from holdback import tracing
from holdback.attempts.outcomes import Reply
from holdback.attempts.stream import StreamAssembly, StreamedReply, cut_reply
from holdback.attempts.transactions import OpenAttempt


async def send_plain(http: aiohttp.ClientSession, url: str, attempt: OpenAttempt, gateway_key: str | None,
                     timeout: float, answered: Callable[[], None] = lambda: None) -> Reply:
    """POST the row's body to the gateway; every failure to get a complete answer is a transport error.
    `answered` is called when the answer's head arrives (it no longer waits in the gateway's queue)."""
    try:
        async with http.post(url, data=attempt.body.encode(), headers=tracing.inject(attempt.headers(gateway_key)),
                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            answered()
            body = await resp.read()
            return Reply(resp.status, resp.headers, body)
    except aiohttp.ClientPayloadError as exc:
        return Reply.transport_error(f"truncated answer: {exc}")
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        return transport_reply(exc, timeout)


def transport_reply(exc: BaseException, timeout: float) -> Reply:
    """The Reply for a send that got no complete answer; one mapping for the streamed and the plain send.

    A refused or unresolvable connection is a failing path (the request never left), not a failing request.
    """
    if isinstance(exc, asyncio.TimeoutError):
        return Reply.transport_error(f"no complete answer within {timeout:g}s")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Reply.transport_error(f"{type(exc).__name__}: {exc}", unreachable=True)
    return Reply.transport_error(f"{type(exc).__name__}: {exc}")


async def event_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, each ending in its `\\n` (the last may not), however long: aiohttp's own line reader refuses
    one longer than twice its read buffer (512 KiB), and one vLLM event can be megabytes (a long prompt's token ids
    with `return_token_ids`, an echoed prompt's logprobs). Each byte is searched once."""
    pending = bytearray()
    async for chunk in content.iter_any():
        searched = len(pending)  # what is pending holds no line end
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", searched)) != -1:
            yield bytes(pending[start:end + 1])
            start = searched = end + 1
        del pending[:start]
    if pending:
        yield bytes(pending)


async def send_streamed(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                        timeout: float, answered: Callable[[], None] = lambda: None) -> StreamedReply:
    """POST a `stream: true` body and fold its events; a non-2xx answer comes back as it is. `answered` is
    called when the answer's head arrives."""
    assembly = StreamAssembly()
    try:
        async with http.post(url, data=body, headers=tracing.inject(headers),
                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            answered()
            if resp.status >= 300 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return StreamedReply(Reply(resp.status, resp.headers, await resp.read()), assembly, cut=False,
                                     events=False)
            try:
                async for line in event_lines(resp.content):
                    if line.startswith(b"data:"):
                        assembly.feed(line[5:].strip())
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
                if not assembly.answered:
                    raise
            # A stream cut after its answer finished is that answer: a resume would have nothing to continue and
            # a restart would compute the whole output again.
            if assembly.complete or assembly.answered:
                return StreamedReply(Reply(resp.status, resp.headers), assembly, cut=False)
            return StreamedReply(cut_reply(resp.headers, assembly), assembly, cut=True)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        # The connection broke (or our timeout ended it). After output that is how an llm-d eviction reaches
        # us, and the next attempt goes on from the output: `cut_after_output` keeps it off the budget.
        if isinstance(exc, aiohttp.ClientPayloadError):
            reply = Reply.transport_error(f"stream cut after {assembly.content_chunks} chunks: {exc}")
        else:
            reply = transport_reply(exc, timeout)
        reply = dataclasses.replace(reply, cut_after_output=assembly.carried_output)
    except ValueError as exc:
        # An event that is not JSON: the server's doing and likely to repeat, so it spends the budget.
        reply = Reply.transport_error(f"unreadable event after {assembly.content_chunks} chunks: {exc}")
    return StreamedReply(reply, assembly, cut=bool(assembly.head), events=bool(assembly.head))
