"""The events of a streamed /v1/responses answer as vLLM 0.32 writes them for a text answer: each framed
`event: <type>` then `data: <json>` (compact, no `[DONE]` at the end), numbered by `sequence_number` from 0.

The order (recorded from the CPU build, tests/fixtures/vllm/responses_stream.sse): response.created and
response.in_progress (the response with status `in_progress`, no output, usage null), then for the message
response.output_item.added, response.content_part.added, one response.output_text.delta per output, and
response.output_text.done, response.content_part.done, response.output_item.done, and last response.completed with
the whole response (the same body a non-streamed request gets, `incomplete` when the output limit ended it).
"""

from __future__ import annotations

import json


class ResponseEventStream:
    """One response's events, numbered in the order they are made."""

    def __init__(self, message_id: str):
        self.message_id = message_id
        self.sequence_number = 0
        self.text = ""  # the message's text so far

    def _event(self, payload: dict) -> bytes:
        payload["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        # vLLM dumps its event models, whose fields are in alphabetical order.
        ordered = dict(sorted(payload.items()))
        data = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()

    def opening(self, response: dict) -> bytes:
        """response.created and response.in_progress, each with the response as it starts (no output yet)."""
        return b"".join(self._event({"type": kind, "response": response})
                        for kind in ("response.created", "response.in_progress"))

    def message_opened(self) -> bytes:
        item = {"id": self.message_id, "content": [], "role": "assistant", "status": "in_progress",
                "type": "message", "phase": None}
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return (self._event({"type": "response.output_item.added", "output_index": 0, "item": item})
                + self._event({"type": "response.content_part.added", "output_index": 0, "content_index": 0,
                               "item_id": self.message_id, "part": part}))

    def delta(self, text: str) -> bytes:
        self.text += text
        return self._event({"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
                            "item_id": self.message_id, "delta": text, "logprobs": []})

    def message_done(self) -> bytes:
        part = {"annotations": [], "text": self.text, "type": "output_text", "logprobs": None}
        item = {"id": self.message_id, "content": [part] if self.text else [], "role": "assistant",
                "status": "completed", "type": "message", "phase": None}
        where = {"output_index": 0, "content_index": 0, "item_id": self.message_id}
        return (self._event({"type": "response.output_text.done", **where, "text": self.text, "logprobs": []})
                + self._event({"type": "response.content_part.done", **where, "part": part})
                + self._event({"type": "response.output_item.done", "output_index": 0, "item": item}))

    def completed(self, response: dict) -> bytes:
        return self._event({"type": "response.completed", "response": response})
