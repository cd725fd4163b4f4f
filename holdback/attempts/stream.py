"""Stream assembly: fold the event stream as vLLM writes it (and our gateway relays it) into
the body a non-streamed request would have returned, or, when the stream did not complete (evicted, aborted,
failed, broken), what it carried so far. The send itself is `holdback.attempts.send`'s.

The assembled body has the non-streamed shape (`chat.completion` / `text_completion`, one choice with the
whole text and reasoning, `finish_reason` and `stop_reason` of the last chunk, the `usage` chunk's usage, every
chunk's top-level fields but the streaming-only ones), so the output file cannot tell a streamed request from
a plain one. One choice only: requests with `n > 1` never stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from holdback.attempts.outcomes import PATH_STATUSES, Reply
from holdback.contract import DROP_REASON_HEADER, DropReason, is_eviction

_CHUNK_OBJECTS = {"chat.completion.chunk": "chat.completion", "text_completion": "text_completion"}
_COMPLETION_ID_PREFIX, _CHAT_ID_PREFIX = "cmpl-", "chatcmpl-"  # vLLM's response ids: <prefix><request id>
# Top-level fields of a chunk that describe the stream, not the answer: vLLM's head chunk carries
# `prompt_token_ids` and `prompt_text` (nulls unless asked for); the ids are kept apart, never in the body.
_STREAM_FIELDS = ("choices", "usage", "prompt_token_ids", "prompt_text")
# vLLM's spellings of a reasoning delta: `reasoning` today, `reasoning_content` in older releases.
REASONING_FIELDS = ("reasoning", "reasoning_content")
# vLLM's finish reasons of a request that did not finish: aborted at the server (what an eviction by
# abort-request-id looks like), or failed there (vLLM turns that into an error event; a proxy may not).
ABORTED = "abort"
FAILED = "error"


@dataclass
class StreamAssembly:
    """The events of one stream, folded as they arrive."""

    head: dict = field(default_factory=dict)  # id, object, created, model and any other top-level field
    parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    reasoning_fields: list[str] = field(default_factory=list)  # the spellings the stream used, first seen first
    content_chunks: int = 0  # chunks that carried text or reasoning
    # The generated token ids (`return_token_ids`), while every token event carried them; None once one did not.
    token_ids: list[int] | None = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # the prompt as vLLM saw it, when it sent the ids
    # The ids at the end of `token_ids` whose text has not come yet: vLLM streams a token whose bytes are not
    # yet a whole character as an empty delta, and its text with a later one.
    untold_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict | None = None  # the newest usage seen (every chunk with continuous_usage_stats)
    done: bool = False  # `data: [DONE]` arrived
    error: dict | None = None  # an error event: the gateway's eviction notice, or vLLM's failed request

    def feed(self, data: bytes) -> None:
        """One `data:` payload."""
        if data.strip() == b"[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"an event is not a JSON object: {data[:100]!r}")
        if "error" in event and "choices" not in event:
            self.error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            return
        for key, value in event.items():
            # vLLM sets some fields on one chunk only (`system_fingerprint` on the usage chunk): take each
            # from wherever it comes.
            if key not in _STREAM_FIELDS and self.head.get(key) is None:
                self.head[key] = value
        if event.get("usage"):
            self.usage = event["usage"]
        self._take_prompt_ids(event)  # chat sends them at the top level
        for choice in event.get("choices") or ():
            self._take_choice(choice)

    def _take_choice(self, choice: dict) -> None:
        delta = choice.get("delta")
        thought = None
        if delta is not None:
            piece = delta.get("content")
            for name in REASONING_FIELDS:
                if isinstance(delta.get(name), str):
                    thought = thought if thought is not None else delta[name]  # one text, however many spellings
                    if name not in self.reasoning_fields:
                        self.reasoning_fields.append(name)
        else:
            piece = choice.get("text")
        if piece:
            self.parts.append(piece)
        if thought:
            self.reasoning_parts.append(thought)
        if piece or thought:
            self.content_chunks += 1
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            if self.token_ids is not None:
                self.token_ids.extend(ids)
                self.untold_tokens = 0 if piece else self.untold_tokens + len(ids)
        elif "token_ids" in choice or piece or thought:
            # A token event without its ids (vLLM sends `token_ids: null` unless asked): the ids are incomplete.
            self.token_ids = None
        self._take_prompt_ids(choice)  # completions send them in the first choice chunk
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _take_prompt_ids(self, where: dict) -> None:
        if isinstance(where.get("prompt_token_ids"), list):
            self.prompt_token_ids = list(where["prompt_token_ids"])

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def carried_output(self) -> bool:
        """The stream carried text or reasoning: a cut keeps it, and the next attempt can go on from it."""
        return bool(self.parts or self.reasoning_parts)

    @property
    def chat(self) -> bool:
        return self.head.get("object") == "chat.completion.chunk"

    @property
    def aborted(self) -> bool:
        return self.finish_reason == ABORTED

    @property
    def complete(self) -> bool:
        """[DONE] after an answer that finished: not after an error event, and not after an abort or a failure
        that vLLM reports as a finish reason (both end with [DONE] too)."""
        return (self.done and self.error is None and bool(self.head)
                and self.finish_reason not in (ABORTED, FAILED))

    @property
    def answered(self) -> bool:
        """The answer finished (a finish reason other than an abort or a failure), whatever came after it. A
        stream cut between its finishing chunk and [DONE] (an eviction decided a moment too late, a connection
        that broke there) lost none of the answer: only the closing usage chunk, whose counts the finishing chunk
        carries too (`continuous_usage_stats`), and the fields vLLM sets there alone (`system_fingerprint`)."""
        return bool(self.head) and self.finish_reason is not None and self.finish_reason not in (ABORTED, FAILED)

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        """From usage when the stream sent it (workers ask for it on every chunk); else the count of token ids;
        else one per chunk that carried output, which vLLM does not promise: an event may carry several tokens,
        and a token whose bytes are not yet a whole character comes as an empty delta."""
        if self.usage is not None and "completion_tokens" in self.usage:
            return int(self.usage["completion_tokens"])
        if self.token_ids:
            return len(self.token_ids)
        return self.content_chunks

    @property
    def cached_tokens(self) -> int:
        return int(((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def body(self, kept_text: str = "", earlier: "TokenSums | None" = None, kept_reasoning: str = "",
             kept_reasoning_fields: tuple[str, ...] = (), as_chat: bool = False) -> dict:
        """The non-streamed response: what earlier attempts kept (resumed output) leads the text and the
        reasoning, usage adds `earlier`. `as_chat`: a completion stream that continued a chat (from its token
        ids) answers as that chat, `chat.completion` with vLLM's chat id prefix."""
        head = dict(self.head)
        head["object"] = _CHUNK_OBJECTS.get(head.get("object", ""), head.get("object"))
        if as_chat and not self.chat:
            head["object"] = _CHUNK_OBJECTS["chat.completion.chunk"]
            if isinstance(head.get("id"), str) and head["id"].startswith(_COMPLETION_ID_PREFIX):
                head["id"] = _CHAT_ID_PREFIX + head["id"][len(_COMPLETION_ID_PREFIX):]
        text = kept_text + self.text
        choice: dict = {"index": 0}
        if self.chat or as_chat:
            choice["message"] = message = {"role": "assistant", "content": text}
            spellings = [name for name in REASONING_FIELDS
                         if name in kept_reasoning_fields or name in self.reasoning_fields]
            if spellings:
                if not text:
                    message["content"] = None  # as vLLM answers when all the output was reasoning
                # vLLM's non-streamed answer names it `reasoning`; the older spelling too when the stream used it.
                for name in ("reasoning", *(n for n in spellings if n != "reasoning")):
                    message[name] = kept_reasoning + self.reasoning
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


@dataclass(frozen=True)
class StreamedReply:
    reply: Reply  # 2xx only when the stream completed; the caller assembles the body from `assembly`
    assembly: StreamAssembly
    cut: bool  # the stream began and ended early: `assembly` holds what it carried
    events: bool = True  # False: the answer was not an event stream (an error, or a server that ignored stream)


def cut_reply(headers, assembly: StreamAssembly) -> Reply:
    """The Reply of a stream that began and did not complete, as its end says.

    The gateway's eviction notice (an error event with code `evicted`) and vLLM's `finish_reason: "abort"`
    are evictions: a 429 `evicted` like any other, no budget spent, the next attempt resumes. vLLM's error
    event (`code` the HTTP status, an int) is the request's own server error: budgeted, its message kept. A
    stream that just stopped is a transport error, off the budget when it had carried output.
    """
    error = assembly.error or {}
    code = error.get("code")
    replica = {k: v for k, v in headers.items() if k.lower() != "content-type"}
    chunks = assembly.content_chunks
    if is_eviction(code):
        return Reply(429, {**replica, DROP_REASON_HEADER: code}, json.dumps({"error": error}).encode())
    if assembly.error is not None or assembly.finish_reason == FAILED:
        message = error.get("message") or f"the replica ended the stream with finish_reason {FAILED!r}"
        envelope = {"error": assembly.error or {"message": message, "type": "InternalServerError", "code": 500}}
        return Reply(_failed_stream_status(code), replica, json.dumps(envelope).encode(),
                     error=f"stream failed after {chunks} chunks: {message}")
    if assembly.aborted:
        message = f"the replica aborted the request after {chunks} chunks (finish_reason {ABORTED!r})"
        envelope = {"error": {"message": message, "type": "rate_limit_error", "code": DropReason.EVICTED.value}}
        return Reply(429, {**replica, DROP_REASON_HEADER: DropReason.EVICTED.value}, json.dumps(envelope).encode(),
                     error=message)
    return Reply.transport_error(f"stream cut after {chunks} chunks: the stream ended without [DONE]",
                                 cut_after_output=assembly.carried_output)


def _failed_stream_status(code: object) -> int:
    """The status a failed stream is recorded with: vLLM's `code` when it is a server error of the request.

    The stream had begun, so the way to the replica worked and the request was taken: a 502/503 code, a 4xx or
    no code at all is still this request's own server error, retried within the budget (vLLM reports an
    unexpected exception mid-stream as a 400, which a retry may well not meet again).
    """
    if isinstance(code, int) and not isinstance(code, bool) and 500 <= code < 600 and code not in PATH_STATUSES:
        return code
    return 500
