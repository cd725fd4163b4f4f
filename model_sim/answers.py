"""What the simulator answers, in vLLM's shapes: usage objects, completion and Responses bodies, and the SSE
chunks of a stream (model_sim/protocol.py reads the requests). Bodies and chunks carry vLLM's key sets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from model_sim.errors import error_body, type_for_status
from model_sim.protocol import GenerationParams


def prompt_tokens_details(cached_tokens: int | None, streamed: bool = False) -> dict | None:
    """vLLM's `prompt_tokens_details`, or None when the server does not report them."""
    if cached_tokens is None:
        return None
    if streamed:  # the usage chunk is dumped without None fields
        return {"cached_tokens": cached_tokens}
    return {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The `usage` of a whole (non-streamed) answer; `cached_tokens` None: details off."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": prompt_tokens_details(cached_tokens),
            "completion_tokens_details": None}


def stream_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The `usage` of the final usage chunk (vLLM drops None fields there)."""
    out = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
           "completion_tokens": completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = prompt_tokens_details(cached_tokens, streamed=True)
    return out


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str | None
    token_ids: list[int] | None = None


def completion_body(response_id: str, created: int, model: str, choices: list[Choice], prompt_tokens: int,
                    completion_tokens: int, chat: bool, cached_tokens: int | None = None,
                    system_fingerprint: str | None = None, prompt_ids: list[int] | None = None) -> dict:
    """`prompt_ids` (asked with return_token_ids): the prompt's token ids, and each choice's own output ids."""
    if chat:
        out = [{"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None, "annotations": None,
                                        "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": None,
                "token_ids": c.token_ids if prompt_ids is not None else None,
                "routed_experts": None} for i, c in enumerate(choices)]
    else:
        out = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": None,
                "token_ids": c.token_ids if prompt_ids is not None else None, "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids, "routed_experts": None}
               for i, c in enumerate(choices)]
    body = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": out, "service_tier": None, "system_fingerprint": system_fingerprint,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    if chat:
        body.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def responses_body(response_id: str, message_id: str, created: int, model: str, request: dict,
                   params: GenerationParams, text: str, finish_reason: str | None, prompt_tokens: int,
                   output_tokens: int, cached_tokens: int) -> dict:
    """vLLM's ResponsesResponse as its /v1/responses dumps it (`model_dump(mode="json", by_alias=True)`): one
    assistant message of `output_text`; status `incomplete` (reason max_output_tokens) when the output limit
    ended it. Its usage always counts cached tokens (vLLM's responses do, with or without
    --enable-prompt-tokens-details)."""
    incomplete = finish_reason == "length"
    content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else []
    tools = request.get("tools") or []
    tool_choice = request.get("tool_choice", "auto")
    return {
        "id": response_id, "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"), "metadata": request.get("metadata"), "model": model,
        "object": "response",
        "output": [{"id": message_id, "content": content, "role": "assistant", "status": "completed",
                    "type": "message", "phase": None}],
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "temperature": request.get("temperature") if request.get("temperature") is not None else 1.0,
        "tool_choice": tool_choice if tools or tool_choice not in ("auto", "none") else "none",
        "tools": tools,
        "top_p": request.get("top_p") if request.get("top_p") is not None else 1.0,
        "background": request.get("background") is True, "max_output_tokens": params.max_tokens, "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"), "prompt": None,
        "reasoning": request.get("reasoning"), "service_tier": request.get("service_tier") or "auto",
        "status": "incomplete" if incomplete else "completed", "text": request.get("text"), "top_logprobs": None,
        "truncation": request.get("truncation") or "disabled",
        "usage": {"input_tokens": prompt_tokens,
                  "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0,
                                           "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                  "output_tokens": output_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                            "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                  "total_tokens": prompt_tokens + output_tokens},
        "user": request.get("user"),
        "presence_penalty": request.get("presence_penalty") or 0.0,
        "frequency_penalty": request.get("frequency_penalty") or 0.0,
        "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }


def responses_unfinished(response_id: str, created: int, model: str, request: dict, params: GenerationParams,
                         status: str) -> dict:
    """A response before its output: no output, usage null. Status `queued`: a background response as vLLM
    answers it at once and stores it until it ends; `in_progress`: a stream's first events."""
    body = responses_body(response_id, "", created, model, request, params, "", None, 0, 0, 0)
    body.update(output=[], status=status, usage=None, incomplete_details=None)
    return body


class SseFormatter:
    """Chunks as vLLM streams them, from pre-rendered templates: one json.dumps of the token text per token.

    Chat: a head chunk per choice with the role (and `prompt_token_ids`/`prompt_text` null), then one chunk per
    token with `token_ids: null`, the last one with `finish_reason` and `stop_reason`. Completions: one chunk per
    token. The fingerprint rides on the final usage chunk, or on each finish chunk when there is none.
    """

    def __init__(self, response_id: str, created: int, model: str, chat: bool, system_fingerprint: str,
                 include_usage: bool = False, prompt_ids: list[int] | None = None):
        self.chat = chat
        # return_token_ids: the prompt's ids on the chat head chunk or each choice's first chunk, and each chunk's
        # own output ids (null otherwise, as vLLM sends them).
        self.prompt_ids = json.dumps(prompt_ids, separators=(",", ":")) if prompt_ids is not None else None
        self.with_ids = prompt_ids is not None
        self.fingerprint = system_fingerprint
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{json.dumps(response_id)},"object":"{obj}","created":{created},'
                      f'"model":{json.dumps(model)},"choices":[')
        self.role_sent = not chat

    def roles(self, n: int, prompt_tokens: int | None = None) -> bytes:
        """The chat head chunks, one per choice; with `prompt_tokens` (continuous usage) each carries usage."""
        self.role_sent = True
        tail = self._usage_tail(prompt_tokens, 0)
        return "".join(f'{self._head}{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                       f'"finish_reason":null}}]{tail},"prompt_token_ids":{self.prompt_ids or "null"},'
                       f'"prompt_text":null}}\n\n' for i in range(n)).encode()

    def tokens(self, index: int, texts: list[str], finish_reason: str | None, prompt_tokens: int | None = None,
               sent: int = 0, ids: list[int] | None = None) -> bytes:
        """One chunk per text of choice `index`; the last ends the choice when `finish_reason` is set. `ids`: the
        texts' token ids (sent with return_token_ids)."""
        out = []
        last = len(texts) - 1
        for i, text in enumerate(texts):
            out.append(self._chunk(index, json.dumps(text), finish_reason if i == last else None,
                                   prompt_tokens, sent + i + 1, ids[i:i + 1] if ids is not None else None))
        return "".join(out).encode()

    def joined(self, index: int, texts: list[str], finish_reason: str | None, prompt_tokens: int | None = None,
               sent: int = 0, ids: list[int] | None = None) -> bytes:
        """One chunk carrying every text of choice `index` (a stream interval's tokens, as vLLM joins them)."""
        return self._chunk(index, json.dumps("".join(texts)), finish_reason, prompt_tokens, sent + len(texts),
                           ids).encode()

    def finish_only(self, index: int, finish_reason: str, prompt_tokens: int | None = None, sent: int = 0) -> bytes:
        """A finish without a new token (an abort): empty text, as vLLM sends it."""
        return self._chunk(index, '""', finish_reason, prompt_tokens, sent).encode()

    def _chunk(self, index: int, text: str, finish_reason: str | None, prompt_tokens: int | None,
               completion_tokens: int, ids: list[int] | None = None) -> str:
        ending = (f'"finish_reason":{json.dumps(finish_reason)},"stop_reason":null' if finish_reason
                  else '"finish_reason":null')
        token_ids = json.dumps(ids, separators=(",", ":")) if ids is not None and self.with_ids else "null"
        if self.chat:
            choice = f'{{"index":{index},"delta":{{"content":{text}}},"logprobs":null,{ending},"token_ids":{token_ids}}}'
        else:
            first = self.with_ids and ids is not None and completion_tokens == len(ids)  # the choice's first chunk
            prompt_ids = self.prompt_ids if first else "null"
            choice = (f'{{"index":{index},"text":{text},"logprobs":null,"finish_reason":'
                      f'{json.dumps(finish_reason)},"stop_reason":null,"prompt_token_ids":{prompt_ids},'
                      f'"token_ids":{token_ids}}}')
        tail = self._usage_tail(prompt_tokens, completion_tokens)
        if finish_reason and not self.include_usage:
            tail += f',"system_fingerprint":{json.dumps(self.fingerprint)}'
        return f"{self._head}{choice}]{tail}}}\n\n"

    def _usage_tail(self, prompt_tokens: int | None, completion_tokens: int) -> str:
        if prompt_tokens is None:
            return ""
        body = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}
        if self.chat:
            body["completion_tokens_details"] = None
        return f',"usage":{json.dumps(body, separators=(",", ":"))}'

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        body = json.dumps(stream_usage(prompt_tokens, completion_tokens, cached_tokens), separators=(",", ":"))
        return f'{self._head}],"usage":{body},"system_fingerprint":{json.dumps(self.fingerprint)}}}\n\n'.encode()

    DONE = b"data: [DONE]\n\n"

    @staticmethod
    def error(message: str, code: int) -> bytes:
        """vLLM's streaming error event (json.dumps with its default separators); [DONE] follows it."""
        body = error_body(code, message, type_for_status(code), None)
        return f"data: {json.dumps(body)}\n\n".encode()
