"""Resume instead of restart: which requests can continue from their partial output, the body that does
it, and what each attempt kept and recomputed.

A resumable request (one choice, no logprobs, no tools, a text prompt) is sent streamed; when its stream is
cut, the attempt keeps what it carried so far (a `Partial`: all attempts' output, its text in
`attempts.partial_output`, reasoning and token ids in `attempts.partial_state`).
The next attempt continues it from the token ids of the prompt and the output so far (vLLM's `return_token_ids`),
sent as a `/v1/completions` prompt for a chat too: exactly what the model had, so with greedy decoding the answer
is the one an uninterrupted run gives, whatever the chat template does to the text. Without ids (a server that
sends none, a stop string still held back, broken characters in the kept text, a chat with no output limit) it
continues by text: a completion's prompt + text so far; a chat's partial answer as a final assistant message with
vLLM's `continue_final_message: true`, `add_generation_prompt: false`, less its trailing whitespace, which a
template that trims content (Llama 3's `| trim`) leaves out of the prompt, so the model writes it again. The
output limits shrink by what was produced. Other requests are sent as they are and restart. What earlier attempts left (a `Carryover`) is read when the attempt opens
(`holdback.attempts.transactions.open_attempt`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from holdback.attempts.outcomes import Reply
from holdback.attempts.stream import REASONING_FIELDS, StreamAssembly, StreamedReply, TokenSums
from holdback.contract import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, RESUMABLE_HEADER, inference_endpoint
from holdback.results import AttemptFigures

if TYPE_CHECKING:  # the open attempt's module reads a carryover from the database: it imports this one
    from holdback.attempts.transactions import OpenAttempt

# Streaming features whose deltas the assembler does not rebuild: such requests restart.
_CHAT_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "audio", "prediction")
# vLLM's per-chunk ids and rendered prompt, which the assembled body leaves out: a caller who asks for them gets
# vLLM's own non-streamed answer.
_STREAM_METADATA = ("return_token_ids", "return_prompt_text")
# Tokens per event the workers ask of a resumable stream (vLLM's per-request `stream_interval`, which 0.32 and 0.34
# know and an older vLLM ignores): nobody reads a batch stream token by token, and each event costs the replica's
# API server, the gateway and the worker the same work whatever it carries. At 8, a batch beside realtime on the
# real engine takes as long as under vLLM's own priority scheduler (1.00x against 1.08x at 1: docs/benchmarks.md,
# "Fewer events per batch stream"); an eviction loses at most 7 tokens vLLM made but had not sent, decoded again.
STREAM_INTERVAL = 8
# A broken character: what vLLM streams for bytes that are not (or not yet) valid UTF-8.
REPLACEMENT_CHARACTER = "\ufffd"
# A chat's fields that only its renderer reads (or that say something else on /v1/completions): a chat continued
# from its token ids is sent without them, since the ids are the prompt as already rendered (and truncated).
_CHAT_ONLY = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
              "documents", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
              "max_completion_tokens", "reasoning_effort", "include_reasoning", "mm_processor_kwargs",
              "media_io_kwargs", "add_special_tokens", "truncate_prompt_tokens", "echo")


def resumable(url: str, body: dict) -> bool:
    """Can this request continue from its partial output with the same final text?"""
    endpoint = inference_endpoint(url)
    if endpoint is None or not endpoint.resumable or body.get("stream") or (body.get("n") or 1) != 1:
        return False
    if any(body.get(k) for k in _STREAM_METADATA):
        return False
    if url == COMPLETIONS_ENDPOINT.path:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return (isinstance(prompt, str) and body.get("logprobs") is None and not body.get("echo")
                and (body.get("best_of") or 1) == 1 and not body.get("suffix"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or body.get("logprobs") or body.get("top_logprobs"):
        return False
    if any(body.get(k) for k in _CHAT_UNSUPPORTED):
        return False
    last = messages[-1]
    return not body.get("continue_final_message") or (isinstance(last, dict) and isinstance(last.get("content"), str))


@dataclass(frozen=True)
class Carryover:
    """What the request's earlier attempts left: the latest cut stream's output and the usage so far."""

    text: str = ""
    tokens: int = 0  # output tokens of `text` (and `reasoning`)
    computed: int = 0  # prompt + output tokens the attempt that was cut had computed
    earlier: TokenSums = TokenSums()
    reasoning: str = ""  # a chat's reasoning so far
    reasoning_fields: tuple[str, ...] = ()  # the spellings its stream used (`reasoning`, `reasoning_content`)
    # The prompt and the output so far as token ids (completions): the prompt that continues it exactly.
    context_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SendPlan:
    """How this attempt goes on the wire: streamed or as it is, resumed or not, and the body sent.

    Apart from `OpenAttempt` because it is made outside the open transaction, from the attempt and the
    runtime's resume switch; the stream arithmetic (`attempt_tokens`, `streamed_reply`) needs only this."""

    streamed: bool
    resumed: bool  # continues `carryover.text`
    body: bytes
    carryover: Carryover = Carryover()
    # The path it is sent to when not the row's own: a chat continued from its token ids goes to /v1/completions,
    # and its answer is assembled as the chat's.
    path: str | None = None


def plan_attempt(attempt: OpenAttempt, carryover: Carryover, resume: bool,
                 stream_interval: int = STREAM_INTERVAL) -> SendPlan:
    """How to send this attempt; a resumed plan's `carryover` is what it continues (see `_resume_point`).

    A `stream_interval` above 1 asks vLLM to send the stream's tokens that many at a time (the first and the
    last at once): nobody reads a batch stream token by token, and each event costs the replica's API server,
    the gateway and this worker the same work whatever it carries. An eviction then loses at most that many
    tokens the replica had made but not yet sent; the resume prefills them again. A caller's own value stays."""
    body = json.loads(attempt.body)
    if not resumable(attempt.url, body):
        return SendPlan(False, False, attempt.body.encode(), carryover)
    point = _resume_point(attempt.url, body, carryover) if resume and carryover.tokens > 0 else None
    path = None
    if point is not None and point.context_ids and attempt.url == CHAT_ENDPOINT.path:
        body, path = _chat_as_completion(body), COMPLETIONS_ENDPOINT.path
    resumed = point is not None and _continue(path or attempt.url, body, point)
    if not resumed:
        body, path = json.loads(attempt.body), None
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if stream_interval > 1:
        body.setdefault("stream_interval", stream_interval)
    body["return_token_ids"] = True  # so a cut stream leaves the ids a resume continues from
    return SendPlan(True, resumed, json.dumps(body).encode(), point if resumed else carryover, path)


def _resume_point(url: str, body: dict, carryover: Carryover) -> Carryover | None:
    """What a resume continues; None when the request should restart instead."""
    if carryover.context_ids and _text_keeps_up_with_ids(body) and (
            url == COMPLETIONS_ENDPOINT.path or _chat_continues_by_ids(body, carryover)):
        return carryover
    # Resuming by text tokenizes the kept text again. A trailing U+FFFD is a character whose bytes were cut
    # (or were never valid UTF-8): tokenized again it is the replacement character itself, not the bytes the
    # model produced, and the model would go on after a character it never wrote. Those characters are given
    # up and generated again. Each came from at least one token, so the tokens kept drop by one per
    # character: the count may stay a little high (a character of several tokens), which only lowers the
    # resumed output limit, so the caller's limit is never passed.
    text = carryover.text.rstrip(REPLACEMENT_CHARACTER)
    if not text:
        # No answer text yet (only reasoning, or only broken characters): continuing the answer would drop the
        # reasoning that was to lead it, so the request starts over.
        return None
    broken = len(carryover.text) - len(text)
    tokens = carryover.tokens - broken
    if url == CHAT_ENDPOINT.path and text != text.rstrip():
        # A template that trims content leaves the trailing whitespace out of the continued prompt while the
        # answer would keep it: the model writes it again (twice, in the answer). Given up, it is written once,
        # by the model, on every template. A run of whitespace ends on at least one whole token (tokenizers split
        # whitespace from words), so one token less never lets the resumed limit pass the caller's.
        text, tokens = text.rstrip(), tokens - 1
        if not text:
            return None
    return dataclasses.replace(carryover, text=text, tokens=max(0, tokens), context_ids=None)


def _chat_continues_by_ids(body: dict, carryover: Carryover) -> bool:
    """Whether a chat with the ids of its cut stream goes on from them (through /v1/completions): it needs answer
    text (reasoning alone restarts, as by text), an output limit (a completion's default is 16 tokens, a chat's
    the rest of the context, which the workers do not know), and no broken character in the text: vLLM primes
    its detokenizer with the prompt's ids, and after bytes that are not UTF-8 its first text can differ from the
    uninterrupted stream's (seen on 0.32), while by text those characters are given up and written again."""
    return (bool(carryover.text) and REPLACEMENT_CHARACTER not in carryover.text and not body.get("echo")
            and any(isinstance(body.get(k), int) for k in CHAT_ENDPOINT.limit_params))


def _chat_as_completion(chat: dict) -> dict:
    """The chat's body as a completion of the same model with the same sampling; `_continue` sets the prompt
    (the ids) and the limit (a chat's `max_completion_tokens` wins over its `max_tokens`, as vLLM reads it)."""
    limit = next(chat[k] for k in CHAT_ENDPOINT.limit_params if isinstance(chat.get(k), int))
    body = {k: v for k, v in chat.items() if k not in _CHAT_ONLY}
    body["max_tokens"] = limit
    return body


def _text_keeps_up_with_ids(body: dict) -> bool:
    """False when vLLM holds text back behind the ids: while a stop string could still match (`stop` without
    `include_stop_str_in_output`) the last characters are not streamed yet, so resuming from the ids would
    lose them; such a request resumes by text."""
    return not body.get("stop") or bool(body.get("include_stop_str_in_output"))


def _continue(url: str, body: dict, carryover: Carryover) -> bool:
    """Rewrite `body` to continue `carryover.text`; False (body untouched) when the limits are used up."""
    limits = {k: body[k] for k in inference_endpoint(url).limit_params if isinstance(body.get(k), int)}
    if any(v - carryover.tokens < 1 for v in limits.values()):
        return False  # the cut stream had produced everything: nothing to continue, so restart
    for k, v in limits.items():
        body[k] = v - carryover.tokens
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - carryover.tokens)
    if url == COMPLETIONS_ENDPOINT.path:
        if carryover.context_ids:
            # vLLM takes a list of ints as the prompt's token ids. Those ids are the prompt as it was already
            # truncated, so truncating them again would cut into the prompt a second time.
            body["prompt"] = list(carryover.context_ids)
            body.pop("truncate_prompt_tokens", None)
            return True
        prompt = body["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + carryover.text
        return True
    messages = list(body["messages"])
    if body.get("continue_final_message"):
        last = messages[-1]
        messages[-1] = {**last, "content": last["content"] + carryover.text}
    else:
        messages.append({"role": "assistant", "content": carryover.text})
    body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return True


def send_headers(attempt: OpenAttempt, plan: SendPlan, gateway_key: str | None, resume: bool) -> dict[str, str]:
    out = attempt.headers(gateway_key)
    if plan.streamed and resume:
        out[RESUMABLE_HEADER] = "1"  # the gateway's victim policy prefers what can resume
    return out


# --- what a cut attempt keeps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partial:
    """What a cut attempt keeps for the next one, all attempts' output so far: the answer's text
    (`attempts.partial_output`, only ever text) and what else continuing it needs (`attempts.partial_state`)."""

    text: str
    reasoning: str = ""
    reasoning_fields: tuple[str, ...] = ()
    context_ids: tuple[int, ...] | None = None  # see `Carryover.context_ids`
    # Output tokens left out of `context_ids` because vLLM had not streamed their text yet (the bytes of a
    # character not yet whole): resumed from the ids they would break that character, so they are generated again.
    untold: int = 0

    def state(self) -> dict | None:
        """The `partial_state` column's value: None when the text is all there is."""
        state: dict = {}
        if self.reasoning or self.reasoning_fields:
            state.update(reasoning=self.reasoning, reasoning_fields=list(self.reasoning_fields))
        if self.context_ids is not None:
            state.update(context_ids=list(self.context_ids), untold=self.untold)
        return state or None

    @classmethod
    def read(cls, text: str, state: object) -> "Partial":
        """The columns read back; whatever in `state` is malformed is left out (a resume by text, not a crash)."""
        if not isinstance(state, dict):
            return cls(text)
        ids, fields, untold = state.get("context_ids"), state.get("reasoning_fields"), state.get("untold")
        ids_ok = isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        return cls(text, str(state.get("reasoning") or ""),
                   tuple(f for f in fields if f in REASONING_FIELDS) if isinstance(fields, list) else (),
                   tuple(ids) if ids_ok else None, untold if ids_ok and isinstance(untold, int) else 0)


def attempt_tokens(plan: SendPlan, sent: StreamedReply) -> AttemptFigures | None:
    """None when no event stream came back: `record_outcome` reads the usage of a plain answer itself."""
    if not sent.events:
        return None
    a: StreamAssembly = sent.assembly
    carryover = plan.carryover
    kept = carryover.tokens if plan.resumed else 0
    redone = max(0, a.prompt_tokens - a.cached_tokens)
    if not plan.resumed:
        redone += min(a.completion_tokens, carryover.tokens)  # a restart decodes the lost output again
    recomputed = min(carryover.computed, redone)
    partial = None
    if sent.cut and a.carried_output:
        before = carryover if plan.resumed else Carryover()
        fields = tuple(f for f in REASONING_FIELDS if f in before.reasoning_fields or f in a.reasoning_fields)
        # The ids of the prompt as vLLM saw it and of what it generated: whether this attempt was sent by ids,
        # by text or afresh, they are exactly what the model had when the stream was cut.
        context, untold = None, 0
        if a.prompt_token_ids is not None and a.token_ids is not None:
            untold = a.untold_tokens
            context = (*a.prompt_token_ids, *a.token_ids[:len(a.token_ids) - untold])
        partial = Partial(before.text + a.text, before.reasoning + a.reasoning, fields, context, untold)
    if partial is None:
        return AttemptFigures(a.prompt_tokens, a.completion_tokens, a.cached_tokens, kept, recomputed, None)
    return AttemptFigures(a.prompt_tokens, a.completion_tokens, a.cached_tokens, kept, recomputed, partial.text,
                          partial.state())


def streamed_reply(plan: SendPlan, sent: StreamedReply) -> Reply:
    """The Reply `record_outcome` classifies: a completed stream carries the assembled non-streamed body."""
    if not sent.events or sent.cut or sent.reply.status is None or sent.reply.status >= 300:
        return sent.reply
    kept = plan.carryover if plan.resumed else Carryover(earlier=plan.carryover.earlier)
    body = sent.assembly.body(kept.text, kept.earlier, kept.reasoning, kept.reasoning_fields,
                              as_chat=plan.path is not None)
    return Reply(sent.reply.status, sent.reply.headers, json.dumps(body).encode())
