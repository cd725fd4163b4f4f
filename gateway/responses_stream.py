"""An evicted /v1/responses stream ends with the Responses API's own events, not a chat-style error.

`RelayedResponseEvents` reads the events of a streamed /v1/responses answer as they are relayed (the response vLLM
announced in response.created / response.in_progress, its output items and their text so far, the last
`sequence_number`), so that when flow control evicts the request the gateway can end the stream as the Responses API
ends a failed one: an `error` event (`code` the drop reason, `evicted`, and the message saying to retry at once),
then `response.failed` with the same response, `status: "failed"`, `error` (`rate_limit_exceeded`, the nearest of
the codes OpenAI defines there, and the same message) and the output so far (its unfinished items `incomplete`),
numbered after the last event the caller got. vLLM itself writes no such
events (its Responses stream is cut when generation fails), so these are the gateway's own.
"""

from __future__ import annotations

import json
from typing import Callable

# Events that carry the whole response, and the deltas that add to an output item.
_LIFECYCLE = frozenset({"response.created", "response.queued", "response.in_progress"})
_TEXT_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                          "response.refusal.delta"})
# `response.error.code` is one of a closed list in OpenAI's API (typed clients refuse others); the drop reason
# itself travels in the `error` event, whose code is free.
FAILED_CODE = "rate_limit_exceeded"
_ARGUMENT_DELTAS = frozenset({"response.function_call_arguments.delta", "response.custom_tool_call_input.delta",
                              "response.mcp_call_arguments.delta"})


class RelayedResponseEvents:
    """What a relayed Responses stream has said so far. `see` takes each relayed body chunk (events may be split
    across chunks) and never raises: a stream it cannot read is relayed all the same."""

    __slots__ = ("response_id", "response", "sequence_number", "items", "_pending")

    def __init__(self, response_id: str | None = None):
        self.response_id = response_id  # the id the gateway gave the response, if it named it
        self.response: dict | None = None
        self.sequence_number: int | None = None
        self.items: dict[int, dict] = {}  # output_index -> the item with its content so far
        self._pending = bytearray()

    def tap(self, counter: Callable[[bytes], None] | None) -> Callable[[bytes], None]:
        """The relay's per-chunk callback: this reader, then the stream's token counter (if any)."""
        if counter is None:
            return self.see

        def both(chunk: bytes) -> None:
            self.see(chunk)
            counter(chunk)
        return both

    def see(self, chunk: bytes) -> None:
        self._pending += chunk
        while (end := self._pending.find(b"\n\n")) >= 0:
            block = bytes(self._pending[:end])
            del self._pending[:end + 2]
            try:
                self._event(block)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                continue  # not an event of the shape expected: the caller got it as it came

    def _event(self, block: bytes) -> None:
        data = b"".join(line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:"))
        event = json.loads(data) if data.startswith(b"{") else None
        if not isinstance(event, dict):
            return
        if isinstance(event.get("sequence_number"), int):
            self.sequence_number = event["sequence_number"]
        kind = event.get("type")
        if kind in _LIFECYCLE and isinstance(event.get("response"), dict):
            self.response = event["response"]
        elif kind in ("response.output_item.added", "response.output_item.done"):
            self.items[event["output_index"]] = event["item"]
        elif kind in ("response.content_part.added", "response.content_part.done"):
            content = self.items[event["output_index"]].setdefault("content", [])
            index = event["content_index"]
            content.extend({} for _ in range(index + 1 - len(content)))
            content[index] = event["part"]
        elif kind in _TEXT_DELTAS:
            part = self.items[event["output_index"]]["content"][event["content_index"]]
            field = "refusal" if kind == "response.refusal.delta" else "text"
            part[field] = part.get(field, "") + event["delta"]
        elif kind in _ARGUMENT_DELTAS:
            item = self.items[event["output_index"]]
            field = "input" if kind == "response.custom_tool_call_input.delta" else "arguments"
            item[field] = item.get(field, "") + event["delta"]

    def failed(self, code: str, message: str) -> bytes:
        """The events that end the stream: `error` (`code`: the drop reason), then `response.failed` with the
        output so far."""
        number = 0 if self.sequence_number is None else self.sequence_number + 1
        output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress" else item
                  for _, item in sorted(self.items.items())]
        response = dict(self.response) if self.response is not None else \
            {"id": self.response_id, "object": "response"}
        response.update(status="failed", error={"code": FAILED_CODE, "message": message}, output=output,
                        incomplete_details=None)
        # An event cut mid-way is ended first, so that these two are read as events of their own.
        head = b"\n\n" if self._pending.strip() else b""
        return head + _sse("error", {"code": code, "message": message, "param": None, "sequence_number": number}) \
            + _sse("response.failed", {"response": response, "sequence_number": number + 1})


def _sse(kind: str, payload: dict) -> bytes:
    """An event framed as vLLM frames its Responses events: `event:` and `data:` lines, the fields in order."""
    data = json.dumps(dict(sorted({**payload, "type": kind}.items())), separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()
