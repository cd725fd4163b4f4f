"""Streamed tokens as the KV ledger needs them: the reservation of a relayed event stream follows its output.

`StreamTokenCount` sees each relayed chunk and revises the request's reservation through flow control only when
its blocks change (`KvLedger.revision_due`) or the generation finished, not per token. The tokens are vLLM's own
running count when the stream carries one (`usage.completion_tokens` in every chunk, asked with
`stream_options.continuous_usage_stats`: several tokens may come in one event, and a token whose bytes are not yet
a whole character comes as an empty one), else one per `data: {` event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.flow.interface import FlowControl
    from gateway.flow.ledger import Reservation
    from gateway.flow.request import FlowRequest

_EVENT = b"data: {"
_FINISHED, _FINISHED_SPACED = b'"finish_reason":"', b'"finish_reason": "'
# vLLM's running count in each chunk of a stream asked for `stream_options.continuous_usage_stats`.
_COMPLETION_TOKENS = b'"completion_tokens":'


class StreamTokenCount:
    __slots__ = ("controller", "req", "res", "ledger", "tokens", "due", "usage")

    def __init__(self, controller: FlowControl, req: FlowRequest, res: Reservation):
        self.controller, self.req, self.res = controller, req, res
        ledger = controller.ledger
        assert ledger is not None, "a reservation is held: admission is on, so there is a ledger"
        self.ledger = ledger
        self.tokens = 0
        self.due = ledger.revision_due(res)
        self.usage = False  # the stream carries usage: events are not counted any more

    def count(self, chunk: bytes) -> None:
        reported = completion_tokens(chunk)
        if reported is not None:
            self.usage = True
            self.tokens = max(self.tokens, reported)
        elif not self.usage:
            self.tokens += chunk.count(_EVENT)
        lease = self.req.lease
        if lease is not None:  # what a victim policy reads to know how much of its last block a resume refills
            lease.tokens_relayed = self.tokens
        done = _FINISHED in chunk or _FINISHED_SPACED in chunk
        if done or self.tokens >= self.due:
            self.controller.revise(self.req, self.tokens, done=done)
            self.due = self.ledger.revision_due(self.res)


def completion_tokens(chunk: bytes) -> int | None:
    """The last `"completion_tokens": N` in `chunk` (None when there is none, or its digits are cut off)."""
    at = chunk.rfind(_COMPLETION_TOKENS)
    if at < 0:
        return None
    start = at + len(_COMPLETION_TOKENS)
    while start < len(chunk) and chunk[start] == 0x20:
        start += 1
    end = start
    while end < len(chunk) and 0x30 <= chunk[end] <= 0x39:
        end += 1
    if end == start or end == len(chunk):  # no digits, or the number may go on in the next chunk
        return None
    return int(chunk[start:end])
