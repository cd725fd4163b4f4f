"""The OpenAI and vLLM wire formats: request bodies in, response bodies and SSE chunks out.

Parsing raises InvalidRequest with the offending field as `param`. Sampling fields the simulator
does not model (temperature, top_p, stop, logprobs, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from model_sim.errors import InvalidRequest
from model_sim.tokenizer import Tokenizer

CHAT_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


@dataclass
class GenerationParams:
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    priority: int
    stream: bool
    include_usage: bool
    # vLLM's stream_options.continuous_usage_stats: usage on every chunk, so a cut stream still says
    # how many tokens it carried.
    continuous_usage: bool = False
    cache_salt: str | None = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return  # vLLM serves its one model when the field is absent
    if not isinstance(model, str) or model != served:
        raise InvalidRequest(f"The model `{model}` does not exist. Set \"model\" to \"{served}\".", "model")


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    # The final message's content when it is continued (continue_final_message), else None.
    continued: str | None


def chat_prompt(body: dict) -> ChatPrompt:
    """Render `messages` with vLLM's `add_generation_prompt` (default true) and `continue_final_message`.

    Continuing the final message leaves it open (no end of turn, no new assistant header), so the
    model writes on in the same message: how an interrupted assistant answer is resumed.
    """
    add_generation_prompt = _bool_field(body, "add_generation_prompt", True)
    continue_final = _bool_field(body, "continue_final_message")
    if continue_final and add_generation_prompt:
        raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to true; "
                             "send \"add_generation_prompt\": false to continue the final message.",
                             "continue_final_message")
    text = render_chat(body.get("messages"), add_generation_prompt, continue_final)
    continued = _content_text(body["messages"][-1].get("content"), len(body["messages"]) - 1) if continue_final else None
    return ChatPrompt(text, continued)


def render_chat(messages, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The simulator's chat template: one `<|role|>` header per message, then the assistant header."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("\"messages\" is required: send a non-empty list of {\"role\", \"content\"} objects.",
                             "messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with \"role\" and \"content\".", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}.", "messages")
        parts.append(f"<|{role}|>\n{_content_text(message.get('content'), i)}\n")
    if continue_final_message:
        parts[-1] = parts[-1][:-1]  # the final message stays open
    elif add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise InvalidRequest(
                    f"messages[{index}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                    "the simulator accepts text only.", "messages")
        return "\n".join(texts)
    raise InvalidRequest(f"messages[{index}].content must be a string or a list of text parts.", "messages")


def completion_prompt_ids(prompt, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return completion_prompt_ids(prompt[0], tokenizer)
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("Send one prompt per request; the simulator does not batch several prompts.", "prompt")
    raise InvalidRequest("\"prompt\" is required: a string, or a non-empty list of non-negative token ids.", "prompt")


def _int_field(body: dict, name: str, default, minimum: int):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < minimum:
        raise InvalidRequest(f"\"{name}\" must be an integer of at least {minimum}, got {value!r}.", name)
    return value


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"\"{name}\" must be true or false, got {value!r}.", name)
    return value


def parse_generation(body: dict, prompt_token_ids: list[int], default_max_tokens: int, chat: bool) -> GenerationParams:
    max_tokens = _int_field(body, "max_tokens", None, 1)
    if chat:
        max_completion = _int_field(body, "max_completion_tokens", None, 1)
        if max_completion is not None:
            max_tokens = max_completion
    if max_tokens is None:
        max_tokens = default_max_tokens
    min_tokens = _int_field(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise InvalidRequest(f"\"min_tokens\" ({min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise InvalidRequest("\"n\" must be 1: the simulator returns one choice per request.", "n")
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_int(priority):
        raise InvalidRequest(f"\"priority\" must be an integer (lower runs first), got {priority!r}.", "priority")
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest("\"stream_options\" can only be set when \"stream\" is true.", "stream_options")
        if not isinstance(options, dict):
            raise InvalidRequest("\"stream_options\" must be an object such as {\"include_usage\": true}.",
                                 "stream_options")
        include_usage = _bool_field(options, "include_usage")
        continuous_usage = _bool_field(options, "continuous_usage_stats")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequest("\"cache_salt\" must be a non-empty string if provided.", "cache_salt")
    return GenerationParams(
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_bool_field(body, "ignore_eos"),
        priority=priority,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage,
        cache_salt=cache_salt,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    prompt_tokens: int, completion_tokens: int, chat: bool, cached_tokens: int | None = None) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class SseFormatter:
    """Pre-rendered chunk templates: one stream costs one json.dumps of the token text per token."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool):
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{json.dumps(response_id)},"object":"{obj}","created":{created},'
                      f'"model":{json.dumps(model)},"choices":[')
        self._field = '{"index":0,"delta":{"content":' if chat else '{"index":0,"text":'
        self._close = "}," if chat else ","
        self.role_sent = not chat

    def tokens(self, texts: list[str], finish_reason: str | None, prompt_tokens: int | None = None,
               sent: int = 0) -> bytes:
        """Chunks for `texts`; with `prompt_tokens` (continuous usage) each carries the usage so far."""
        out = []
        if not self.role_sent:
            tail = self._usage_tail(prompt_tokens, sent)
            out.append(f'{self._head}{{"index":0,"delta":{{"role":"assistant","content":""}},'
                       f'"logprobs":null,"finish_reason":null}}]{tail}}}\n\n')
            self.role_sent = True
        last = len(texts) - 1
        for i, text in enumerate(texts):
            reason = json.dumps(finish_reason) if (i == last and finish_reason) else "null"
            tail = self._usage_tail(prompt_tokens, sent + i + 1)
            out.append(f'{self._head}{self._field}{json.dumps(text)}{self._close}'
                       f'"logprobs":null,"finish_reason":{reason}}}]{tail}}}\n\n')
        return "".join(out).encode()

    @staticmethod
    def _usage_tail(prompt_tokens: int | None, completion_tokens: int) -> str:
        if prompt_tokens is None:
            return ""
        return f',"usage":{json.dumps(usage(prompt_tokens, completion_tokens))}'


    def finish_only(self, finish_reason: str) -> bytes:
        empty = '{"index":0,"delta":{},' if self.chat else '{"index":0,"text":"",'
        return f'{self._head}{empty}"logprobs":null,"finish_reason":{json.dumps(finish_reason)}}}]}}\n\n'.encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        body = usage(prompt_tokens, completion_tokens, cached_tokens)
        return f'{self._head}],"usage":{json.dumps(body)}}}\n\n'.encode()

    DONE = b"data: [DONE]\n\n"

    @staticmethod
    def error(message: str, code: int) -> bytes:
        body = {"error": {"message": message, "type": "server_error" if code >= 500 else "invalid_request_error",
                          "param": None, "code": code}}
        return f"data: {json.dumps(body)}\n\n".encode()
