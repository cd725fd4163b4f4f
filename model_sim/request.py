"""One generation request inside the engine: its tokens, its progress and its status.

Status moves only in the scheduler: WAITING → RUNNING → (PREEMPTED → RUNNING)* → FINISHED_*.
A preempted request keeps the output it already streamed; it recomputes prompt + output (vLLM
v1's recompute preemption) and then continues where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason for a finished status."""
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Decided at arrival by the output-length sampler; never more than max_tokens.
    target_output_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    external_id: str | None = None
    # Output position of the first generated token: a continued request picks up its own text there.
    output_offset: int = 0
    # vLLM's `cache_salt`: folded into the first block's hash, so only requests with the same salt
    # share prefix-cache blocks.
    cache_salt: str | None = None
    # The body's `n` and this request's choice in it: each choice is a request of its own, as in vLLM.
    n: int = 1
    choice_index: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix-cache hit at the first admission, in tokens (-1 until admitted).
    num_cached_tokens: int = -1
    # Of those, the tokens loaded from the offload tier rather than found on the GPU.
    num_loaded_tokens: int = 0
    num_preemptions: int = 0
    # Chain hashes of this request's full blocks, computed once and kept across preemptions.
    block_hashes: list[int] = field(default_factory=list)

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Time between the two newest output tokens (None before the second token).
    token_gap: float | None = None
    finished_time: float | None = None
    # Why the runtime failed this request (e.g. out of KV memory); None for a normal finish or a client abort.
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_decoding(self) -> bool:
        """True when the next step computes exactly the newest output token."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def max_kv_tokens(self) -> int:
        """Most tokens this request will ever hold in the KV cache (the last output token is never fed back)."""
        return self.num_prompt_tokens + self.max_tokens - 1
