"""Resume instead of restart: which requests can continue from their partial output, the body that does
it, and what each attempt kept and recomputed.

A resumable request (one choice, no logprobs, no tools, a text prompt) is sent streamed; when its stream is
cut, the attempt keeps the text so far (`attempts.partial_output`, all attempts' text). The next attempt
continues it: `/v1/completions` with prompt + text so far, `/v1/chat/completions` with the partial answer as
a final assistant message and vLLM's `continue_final_message: true`, `add_generation_prompt: false`; the
output limits shrink by what was produced. Other requests are sent as they are and restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from async_processor.stream import StreamAssembly, StreamedReply, TokenSums
from holdback.contract import RESUMABLE_HEADER
from holdback.dispatch import Dispatch, Recorded, Reply, RetryPolicy, Skip, begin, record_outcome
from holdback.models import Attempt
from holdback.results import AttemptFigures

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_LIMITS = {COMPLETIONS: ("max_tokens",), CHAT: ("max_tokens", "max_completion_tokens")}
# Streaming features whose deltas the assembler does not rebuild: such requests restart.
_CHAT_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "audio", "prediction")


def resumable(url: str, body: dict) -> bool:
    """Can this request continue from its partial output with the same final text?"""
    if url not in _LIMITS or body.get("stream") or (body.get("n") or 1) != 1:
        return False
    if url == COMPLETIONS:
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
class Progress:
    """What the request's earlier attempts left: the latest cut stream's text and the usage so far."""

    text: str = ""
    tokens: int = 0  # output tokens of `text`
    computed: int = 0  # prompt + output tokens the attempt that was cut had computed
    earlier: TokenSums = TokenSums()


@dataclass(frozen=True)
class Plan:
    """How this attempt is sent."""

    streamed: bool
    resumed: bool  # continues `progress.text`
    body: bytes
    progress: Progress = Progress()


def plan_attempt(dispatch: Dispatch, progress: Progress, resume: bool) -> Plan:
    body = json.loads(dispatch.body)
    if not resumable(dispatch.url, body):
        return Plan(False, False, dispatch.body.encode(), progress)
    resumed = resume and progress.tokens > 0 and _continue(dispatch.url, body, progress)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return Plan(True, resumed, json.dumps(body).encode(), progress)


def _continue(url: str, body: dict, progress: Progress) -> bool:
    """Rewrite `body` to continue `progress.text`; False (body untouched) when the limits are used up."""
    limits = {k: body[k] for k in _LIMITS[url] if isinstance(body.get(k), int)}
    if any(v - progress.tokens < 1 for v in limits.values()):
        return False  # the cut stream had produced everything: nothing to continue, so restart
    for k, v in limits.items():
        body[k] = v - progress.tokens
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - progress.tokens)
    if url == COMPLETIONS:
        prompt = body["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + progress.text
        return True
    messages = list(body["messages"])
    if body.get("continue_final_message"):
        last = messages[-1]
        messages[-1] = {**last, "content": last["content"] + progress.text}
    else:
        messages.append({"role": "assistant", "content": progress.text})
    body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return True


def headers(dispatch: Dispatch, plan: Plan, gateway_key: str | None, resume: bool) -> dict[str, str]:
    out = dispatch.headers(gateway_key)
    if plan.streamed and resume:
        out[RESUMABLE_HEADER] = "1"  # the gateway's victim policy prefers what can resume
    return out


# --- the database side --------------------------------------------------------------------------------

_attempts = Attempt.__table__
_LATEST_CUT = (
    select(_attempts.c.partial_output, _attempts.c.tokens_kept, _attempts.c.input_tokens, _attempts.c.output_tokens)
    .where(_attempts.c.request_id == bindparam("row_id"), _attempts.c.number < bindparam("number"),
           _attempts.c.partial_output.is_not(None))
    .order_by(_attempts.c.number.desc()).limit(1)
)
_SUMS = (
    select(func.coalesce(func.sum(_attempts.c.input_tokens), 0), func.coalesce(func.sum(_attempts.c.output_tokens), 0),
           func.coalesce(func.sum(_attempts.c.cached_tokens), 0))
    .where(_attempts.c.request_id == bindparam("row_id"), _attempts.c.number < bindparam("number"))
)


def open_attempt(session: Session, row_id: str, worker: str) -> tuple[Dispatch, Progress] | Skip:
    """`holdback.dispatch.begin`, plus the progress of earlier attempts when the request can resume."""
    opened = begin(session, row_id, worker)
    if isinstance(opened, Skip) or opened.attempt == 1 or not resumable(opened.url, json.loads(opened.body)):
        return opened if isinstance(opened, Skip) else (opened, Progress())
    params = {"row_id": row_id, "number": opened.attempt}
    conn = session.connection()
    prompt, output, cached = conn.execute(_SUMS, params).one()
    earlier = TokenSums(int(prompt), int(output), int(cached))
    cut = conn.execute(_LATEST_CUT, params).one_or_none()
    if cut is None:
        return opened, Progress(earlier=earlier)
    text, kept, cut_prompt, cut_output = cut
    return opened, Progress(text, kept + cut_output, cut_prompt + cut_output, earlier)


def attempt_tokens(plan: Plan, sent: StreamedReply) -> AttemptFigures | None:
    """None when no event stream came back: `record_outcome` reads the usage of a plain answer itself."""
    if not sent.events:
        return None
    a: StreamAssembly = sent.assembly
    progress = plan.progress
    kept = progress.tokens if plan.resumed else 0
    redone = max(0, a.prompt_tokens - a.cached_tokens)
    if not plan.resumed:
        redone += min(a.completion_tokens, progress.tokens)  # a restart decodes the lost output again
    recomputed = min(progress.computed, redone)
    partial = None
    if sent.cut and a.text:
        partial = (progress.text if plan.resumed else "") + a.text
    return AttemptFigures(a.prompt_tokens, a.completion_tokens, a.cached_tokens, kept, recomputed, partial)


def streamed_reply(plan: Plan, sent: StreamedReply) -> Reply:
    """The Reply `record_outcome` classifies: a completed stream carries the assembled non-streamed body."""
    if not sent.events or sent.cut or sent.reply.status is None or sent.reply.status >= 300:
        return sent.reply
    kept = plan.progress.text if plan.resumed else ""
    body = sent.assembly.body(kept, plan.progress.earlier)
    return Reply(sent.reply.status, sent.reply.headers, json.dumps(body).encode())


def record_attempt(session: Session, dispatch: Dispatch, reply: Reply, policy: RetryPolicy,
                   tokens: AttemptFigures | None) -> Recorded:
    """`holdback.dispatch.record_outcome`, with this attempt's own token figures on its attempt row."""
    return record_outcome(session, dispatch, reply, policy, figures=tokens)
