"""The OpenAI and vLLM request formats: bodies in, checked as vLLM checks them (answers: model_sim/answers.py).

Parsing raises InvalidRequest with the offending field as `param`; the checks vLLM makes are made in its
order and worded as it words them. Sampling fields the simulator does not model (temperature, top_p, stop,
logprobs, ...) are accepted and ignored, once their types are what vLLM's request model reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from holdback.sim_tokenizer import ChatTemplateError, Tokenizer, chat_switches, content_text, render_chat
from model_sim.errors import EnvelopeError, FieldTypeError, InvalidRequest, ValidationFailed


# vLLM's VLLM_MAX_N_SEQUENCES default: the most choices one request may ask for.
MAX_N = 16384
# vLLM's CompletionRequest.max_tokens default; a chat request without one may use the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class GenerationParams:
    """A generation request's fields, checked for type; `max_tokens` is resolved against the prompt later."""

    # What the body asked for (max_completion_tokens wins on chat), None when it set neither.
    requested_max_tokens: int | None
    # The body field the request's cap came from, as vLLM names it in its errors.
    max_tokens_param: str
    min_tokens: int
    ignore_eos: bool
    priority: int
    stream: bool
    include_usage: bool
    # vLLM's stream_options.continuous_usage_stats: usage on every chunk, so a cut stream still says
    # how many tokens it carried.
    continuous_usage: bool = False
    cache_salt: str | None = None
    n: int = 1
    # vLLM's per-request stream_interval: a stream's tokens go out this many at a time, the first and the last at
    # once (ignored when not streamed).
    stream_interval: int = 1
    # vLLM's return_token_ids: the output's token ids on each choice (and chunk), the prompt's once.
    return_token_ids: bool = False
    # Set by resolve_max_tokens.
    max_tokens: int = 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model(body: dict, served: str) -> None:
    """vLLM's `_check_model`: an absent or empty `model` means the served one, any other name is a 404."""
    model = body.get("model")
    if not model or model == served:
        return
    if not isinstance(model, str):
        raise InvalidRequest(f"\"model\" must be a string, got {model!r}.", "model")
    raise EnvelopeError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", "model")


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    # The final message's content when it is continued (continue_final_message), else None.
    continued: str | None


def chat_prompt(body: dict) -> ChatPrompt:
    """Render `messages` with vLLM's `add_generation_prompt` (default true) and `continue_final_message`, with the
    simulator's chat template (holdback.sim_tokenizer, which the gateway counts prompts with too).

    Continuing the final message leaves it open (no end of turn, no new assistant header), so the
    model writes on in the same message: how an interrupted assistant answer is resumed.
    """
    try:
        add_generation_prompt, continue_final = chat_switches(body)
        text = render_chat(body.get("messages"), add_generation_prompt, continue_final)
    except ChatTemplateError as exc:
        raise InvalidRequest(exc.message, exc.param) from None
    continued = content_text(body["messages"][-1].get("content"), len(body["messages"]) - 1) if continue_final else None
    return ChatPrompt(text, continued)


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


# Sampling parameters the simulator does not model but vLLM types as numbers: a value vLLM's request model would
# not read as one (pydantic's lax mode: a bool, or a string that reads as a number, passes) is refused as it is.
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
INTEGER_FIELDS = ("top_k", "seed")


def _not_a_number(field: str, value) -> FieldTypeError:
    if isinstance(value, str):
        return FieldTypeError(field, "float_parsing", "Input should be a valid number, unable to parse string as a "
                              "number", value)
    return FieldTypeError(field, "float_type", "Input should be a valid number", value)


def _not_an_integer(field: str, value) -> FieldTypeError:
    if isinstance(value, str):
        return FieldTypeError(field, "int_parsing", "Input should be a valid integer, unable to parse string as an "
                              "integer", value)
    if isinstance(value, float):
        return FieldTypeError(field, "int_from_float", "Input should be a valid integer, got a number with a "
                              "fractional part", value)
    return FieldTypeError(field, "int_type", "Input should be a valid integer", value)


def _lax_number(value, integer: bool) -> bool:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return False
    if not isinstance(value, (int, float)):
        return False
    return not integer or float(value).is_integer()


def check_sampling_types(body: dict) -> None:
    for name in NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and not _lax_number(value, integer=False):
            raise _not_a_number(name, value)
    for name in INTEGER_FIELDS:
        value = body.get(name)
        if value is not None and not _lax_number(value, integer=True):
            raise _not_an_integer(name, value)


def _int_field(body: dict, name: str, default, minimum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise _not_an_integer(name, value)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"\"{name}\" must be an integer of at least {minimum}, got {value!r}.", name)
    return value


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"\"{name}\" must be true or false, got {value!r}.", name)
    return value


def parse_generation(body: dict, chat: bool, priority_header: str | None = None) -> GenerationParams:
    """The fields of a chat or completions body. On /v1/completions only `max_tokens` counts.

    `priority_header` is vLLM's `X-Vllm-Priority`: an integer there overrides the body's `priority`.
    """
    check_sampling_types(body)
    max_tokens = _int_field(body, "max_tokens", None)
    param = "max_tokens"
    if chat:
        max_completion = _int_field(body, "max_completion_tokens", None)
        if max_completion is not None:
            max_tokens, param = max_completion, "max_completion_tokens"
    elif max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS  # absent or null, as vLLM's CompletionRequest: 16
    min_tokens = _int_field(body, "min_tokens", 0)
    if min_tokens < 0:
        raise ValidationFailed(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    n = _int_field(body, "n", 1)
    if n < 1:
        raise ValidationFailed(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise ValidationFailed(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                               "VLLM_MAX_N_SEQUENCES environment variable.")
    priority = _priority(body, priority_header)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options:
        if not stream:
            raise InvalidRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(options, dict):
            raise InvalidRequest("\"stream_options\" must be an object such as {\"include_usage\": true}.",
                                 "stream_options")
        include_usage = _bool_field(options, "include_usage")
        continuous_usage = _bool_field(options, "continuous_usage_stats")
    return GenerationParams(
        requested_max_tokens=max_tokens,
        max_tokens_param=param,
        min_tokens=min_tokens,
        ignore_eos=_bool_field(body, "ignore_eos"),
        priority=priority,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage,
        cache_salt=_cache_salt(body),
        n=n,
        stream_interval=_int_field(body, "stream_interval", 1, minimum=1),
        return_token_ids=_bool_field(body, "return_token_ids"),
    )


def _priority(body: dict, header: str | None) -> int:
    """The body's `priority` (0 when absent), overridden by an integer `X-Vllm-Priority` header."""
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_int(priority):
        raise _not_an_integer("priority", priority)
    if header is not None:
        try:
            priority = int(header)
        except ValueError:
            pass  # vLLM ignores a header it cannot read
    return priority


def _cache_salt(body: dict) -> str | None:
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequest("\"cache_salt\" must be a non-empty string if provided.", "cache_salt")
    return cache_salt


def parse_responses(body: dict, priority_header: str | None = None) -> GenerationParams:
    """The fields of a /v1/responses body: its cap is `max_output_tokens` (none: the rest of the context, as a
    chat)."""
    stream = _bool_field(body, "stream")
    return GenerationParams(
        requested_max_tokens=_int_field(body, "max_output_tokens", None),
        max_tokens_param="max_output_tokens",
        min_tokens=0,
        ignore_eos=_bool_field(body, "ignore_eos"),
        priority=_priority(body, priority_header),
        stream=stream,
        include_usage=False,
        cache_salt=_cache_salt(body),
    )


def truncated(prompt_ids: list[int], body: dict, max_model_len: int, generates: bool = True) -> list[int]:
    """The prompt as vLLM runs it under the body's `truncate_prompt_tokens` (completions, chat, embeddings) or a
    Responses body's `truncation: "auto"`: its last N tokens; -1 (and "auto" with `max_output_tokens` set) keeps
    the context less one token held for output (the whole context for embeddings). An N above the context is
    refused; N = 0 leaves an empty prompt, which the engine refuses."""
    keep = body.get("truncate_prompt_tokens")
    if body.get("truncation") == "auto":
        keep = -1 if body.get("max_output_tokens") is not None else max_model_len
    if keep is None:
        return prompt_ids
    if not _is_int(keep) or keep < -1:
        raise InvalidRequest(f"\"truncate_prompt_tokens\" must be an integer of -1 or more, got {keep!r}.",
                             "truncate_prompt_tokens")
    if keep > max_model_len:
        raise ValidationFailed(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                               f"{max_model_len}. Please request a smaller truncation size.",
                               "truncate_prompt_tokens", keep)
    if keep == -1:
        keep = max_model_len - 1 if generates else max_model_len
    return prompt_ids[len(prompt_ids) - keep:] if 0 < keep < len(prompt_ids) else (prompt_ids if keep else [])


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, prompt_is_text: bool = True) -> None:
    """vLLM's refusal of a prompt longer than the context, generation and embeddings alike."""
    if num_prompt_tokens <= max_model_len:
        return
    # vLLM's tokenizer truncates text at max_model_len + 1 tokens, so it only knows "at least" that many.
    count, qualifier = (max_model_len + 1, "at least ") if prompt_is_text else (num_prompt_tokens, "")
    raise ValidationFailed(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.", "input_tokens", count)


def resolve_max_tokens(params: GenerationParams, num_prompt_tokens: int, max_model_len: int,
                       default_max_tokens: int | None = None, prompt_is_text: bool = True) -> int:
    """vLLM's checks and `get_max_tokens`, in its order; sets and returns `params.max_tokens`.

    A cap above the context is refused, a prompt longer than the context is refused, and a cap that
    does not fit beside the prompt is clamped to what does (vLLM answers 200, not 400). Without a cap the
    request may use the rest of the context, or `default_max_tokens` when the server sets one.
    """
    requested = params.requested_max_tokens
    if requested is not None and requested > max_model_len:
        raise ValidationFailed(
            f"{params.max_tokens_param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.", params.max_tokens_param, requested)
    check_prompt_length(num_prompt_tokens, max_model_len, prompt_is_text)
    fallback = requested if requested is not None else default_max_tokens
    max_tokens = max_model_len - num_prompt_tokens if fallback is None else min(fallback,
                                                                                 max_model_len - num_prompt_tokens)
    if max_tokens < 1:
        raise ValidationFailed(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if params.min_tokens > max_tokens:
        raise ValidationFailed(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                               f"got {params.min_tokens}.")
    params.max_tokens = max_tokens
    return max_tokens


# -- response bodies ----------------------------------------------------------------------------------------
# Key sets and order as vLLM's pydantic models dump them (ChatCompletionResponse, CompletionResponse, UsageInfo).
