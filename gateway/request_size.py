"""The size of a request as vLLM runs it: its prompt after truncation, its output limit and its sequences.

What vLLM reads of a body once its prompt is counted (gateway/tokenization.py counts it): `truncate_prompt_tokens`
(and a Responses body's `truncation`), the output-limit fields in its order of precedence, its defaults, `n` and
`best_of`. A value vLLM would refuse counts as none: the replica answers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from holdback.contract import CHAT_ENDPOINT, inference_endpoint

# What vLLM generates for a /v1/completions request without max_tokens (its CompletionRequest default).
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class OutputLimit:
    tokens: int
    param: str | None
    sequences: int


def _count_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def truncated_prompt(body: Mapping[str, Any], path: str, prompt_tokens: int, context: int | None) -> int:
    """The prompt as vLLM runs it under the body's `truncate_prompt_tokens`: its last N tokens; -1 keeps the context
    less the one token held for output (the whole context for embeddings). A value vLLM refuses (above the context,
    not an integer) or -1 with the context unknown leaves the count: the replica answers it."""
    keep = body.get("truncate_prompt_tokens")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or (context is not None and keep > context):
        return prompt_tokens
    if keep == -1:
        if context is None:
            return prompt_tokens
        endpoint = inference_endpoint(path)
        keep = context if endpoint is not None and not endpoint.generates else context - 1
    return min(prompt_tokens, keep)


def output_limit(body: Mapping[str, Any], path: str, *, default: int, context: int | None,
                 prompt_tokens: int) -> OutputLimit:
    """Per-sequence output as vLLM reads it: chat takes max_completion_tokens when set, else max_tokens, else
    generates to the end of the context (`context` − prompt; `default` when the context is not known);
    /v1/completions reads only max_tokens, else 16. A value vLLM would refuse (0, a string) counts as none: the
    replica answers it. Sequences: n, or best_of when larger, each with its own output."""
    endpoint = inference_endpoint(path)
    if endpoint is not None and not endpoint.generates:
        return OutputLimit(0, None, 1)  # embeddings generate nothing
    sequences = max(_count_field(body, "n") or 1, _count_field(body, "best_of") or 1)
    if endpoint is CHAT_ENDPOINT:
        limits = CHAT_ENDPOINT.limit_params
        param = next((p for p in limits if body.get(p) is not None), limits[-1])
        fallback = max(1, context - prompt_tokens) if context else default
    else:
        param, fallback = "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS
    value = _count_field(body, param)
    if value is None:
        return OutputLimit(fallback, None, sequences)
    return OutputLimit(value, param, sequences)
