"""A streamed batch request: read the gateway's event stream and assemble the body a non-streamed request
would have returned, or, when the stream is cut (evicted, broken), what it carried so far.

The assembled body has the non-streamed shape (`chat.completion` / `text_completion`, one choice with the
whole text, `finish_reason` and `stop_reason` of the last chunk, the `usage` chunk's usage), so the output
file cannot tell a streamed request from a plain one. One choice only: requests with `n > 1` never stream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

from holdback import tracing
from holdback.contract import DROP_REASON_HEADER, is_eviction
from holdback.dispatch import Reply

_CHUNK_OBJECTS = {"chat.completion.chunk": "chat.completion", "text_completion": "text_completion"}


@dataclass
class StreamAssembly:
    """The events of one stream, folded as they arrive."""

    head: dict = field(default_factory=dict)  # id, object, created, model and any other top-level field
    parts: list[str] = field(default_factory=list)
    content_chunks: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict | None = None  # the newest usage seen (every chunk with continuous_usage_stats)
    done: bool = False  # `data: [DONE]` arrived
    error: dict | None = None  # an error event ended the stream (the gateway's eviction notice)

    def feed(self, data: bytes) -> None:
        """One `data:` payload."""
        if data.strip() == b"[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event and "choices" not in event:
            self.error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            return
        if not self.head:
            self.head = {k: v for k, v in event.items() if k not in ("choices", "usage")}
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            piece = (delta or {}).get("content") if delta is not None else choice.get("text")
            if piece:
                self.parts.append(piece)
                self.content_chunks += 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def chat(self) -> bool:
        return self.head.get("object") == "chat.completion.chunk"

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and bool(self.head)

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        """From usage when the stream sent it; else one token per content chunk (vLLM streams one each)."""
        if self.usage is not None and "completion_tokens" in self.usage:
            return int(self.usage["completion_tokens"])
        return self.content_chunks

    @property
    def cached_tokens(self) -> int:
        return int(((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def body(self, kept_text: str = "", earlier: "TokenSums | None" = None) -> dict:
        """The non-streamed response: `kept_text` (resumed output) leads the text, usage adds `earlier`."""
        head = dict(self.head)
        head["object"] = _CHUNK_OBJECTS.get(head.get("object", ""), head.get("object"))
        text = kept_text + self.text
        choice: dict = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        ordered = {k: head.pop(k) for k in ("id", "object", "created", "model") if k in head}
        return {**ordered, **head, "choices": [choice], "usage": summed_usage(self.usage or {}, earlier)}


@dataclass(frozen=True)
class TokenSums:
    """Usage of a request's earlier attempts, summed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def summed_usage(last: dict, earlier: TokenSums | None) -> dict:
    usage = json.loads(json.dumps(last))  # a deep copy of the attempt's own usage, same fields
    if earlier is None or earlier == TokenSums():
        return usage
    usage["prompt_tokens"] = int(usage.get("prompt_tokens") or 0) + earlier.prompt_tokens
    usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + earlier.completion_tokens
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if earlier.cached_tokens or "prompt_tokens_details" in usage:
        details = dict(usage.get("prompt_tokens_details") or {})
        details["cached_tokens"] = int(details.get("cached_tokens") or 0) + earlier.cached_tokens
        usage["prompt_tokens_details"] = details
    return usage


def transport_reply(exc: BaseException, timeout: float) -> Reply:
    """The Reply for a send that got no complete answer; one mapping for the streamed and the plain send.

    A refused or unresolvable connection is a failing path (the request never left), not a failing request.
    """
    if isinstance(exc, asyncio.TimeoutError):
        return Reply.transport_error(f"no complete answer within {timeout:g}s")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Reply.transport_error(f"{type(exc).__name__}: {exc}", unreachable=True)
    return Reply.transport_error(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class StreamedReply:
    reply: Reply  # 2xx only when the stream completed; the caller assembles the body from `assembly`
    assembly: StreamAssembly
    cut: bool  # the stream began and ended early: `assembly` holds what it carried
    events: bool = True  # False: the answer was not an event stream (an error, or a server that ignored stream)


async def send_streamed(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                        timeout: float) -> StreamedReply:
    """POST a `stream: true` body and fold its events; a non-2xx answer comes back as it is."""
    assembly = StreamAssembly()
    try:
        async with http.post(url, data=body, headers=tracing.inject(headers),
                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status >= 300 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return StreamedReply(Reply(resp.status, resp.headers, await resp.read()), assembly, cut=False,
                                     events=False)
            async for line in resp.content:
                if line.startswith(b"data:"):
                    assembly.feed(line[5:].strip())
            if assembly.complete:
                return StreamedReply(Reply(resp.status, resp.headers), assembly, cut=False)
            return StreamedReply(_cut_reply(resp.headers, assembly), assembly, cut=True)
    except (aiohttp.ClientPayloadError, ValueError) as exc:
        reply = Reply.transport_error(f"stream cut after {assembly.content_chunks} chunks: {exc}")
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        reply = transport_reply(exc, timeout)
    return StreamedReply(reply, assembly, cut=bool(assembly.head), events=bool(assembly.head))


def _cut_reply(headers, assembly: StreamAssembly) -> Reply:
    """A stream that ended without [DONE]: the gateway's eviction notice is a 429 `evicted` like any other."""
    error = assembly.error or {}
    if is_eviction(error.get("code")):
        replica = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        return Reply(429, {**replica, DROP_REASON_HEADER: error["code"]}, json.dumps({"error": error}).encode())
    what = error.get("message") or "the stream ended without [DONE]"
    return Reply.transport_error(f"stream cut after {assembly.content_chunks} chunks: {what}")
