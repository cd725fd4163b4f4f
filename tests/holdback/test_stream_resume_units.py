"""Stream assembly and resume planning as plain functions: which requests resume, the continuing body, the
assembled body and summed usage, and what a cut stream turns into."""

from __future__ import annotations

import json

import pytest

from holdback.attempts.resume import STREAM_INTERVAL, Carryover, SendPlan, plan_attempt, resumable, streamed_reply
from holdback.attempts.outcomes import classify
from holdback.attempts.stream import StreamAssembly, StreamedReply, TokenSums, cut_reply, summed_usage
from holdback.attempts.transactions import OpenAttempt
from holdback.models import AttemptOutcome

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def an_attempt(url: str, body: dict) -> OpenAttempt:
    return OpenAttempt(request_id="r1", batch_id="b1", tenant_id="t1", custom_id="c1", url=url, body=json.dumps(body),
                       deadline=None, attempt_id=1, number=2, transient_failures=0)


@pytest.mark.parametrize("url, body, expected", [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, True),
    (COMPLETIONS, {"prompt": "hi"}, True),
    (COMPLETIONS, {"prompt": ["hi"]}, True),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, False),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, False),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, False),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 0}, False),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, False),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, False),  # token ids: the text so far cannot be appended
    (COMPLETIONS, {"prompt": "hi", "stream": True}, False),  # the caller's own stream is left alone
    ("/v1/embeddings", {"input": "hi"}, False),
])
def test_which_requests_resume(url, body, expected):
    assert resumable(url, body) is expected


def test_a_chat_resume_continues_the_final_message_and_shrinks_the_limits():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20, "min_tokens": 3}
    plan = plan_attempt(an_attempt(CHAT, body), Carryover(text=" the of and", tokens=3), resume=True)
    sent = json.loads(plan.body)
    assert plan.streamed and plan.resumed
    assert sent["messages"][-1] == {"role": "assistant", "content": " the of and"}
    assert (sent["max_completion_tokens"], sent["min_tokens"]) == (17, 0)
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert "max_tokens" not in sent, "only the limits the caller set are sent"


def test_a_caller_continuing_its_own_message_gets_the_text_appended_to_it():
    body = {"messages": [{"role": "assistant", "content": "Once"}], "continue_final_message": True,
            "add_generation_prompt": False, "max_tokens": 10}
    sent = json.loads(plan_attempt(an_attempt(CHAT, body), Carryover(text=" the", tokens=1), resume=True).body)
    assert sent["messages"] == [{"role": "assistant", "content": "Once the"}] and sent["max_tokens"] == 9


def test_nothing_left_to_continue_or_resume_off_means_restart():
    body = {"prompt": "hi", "max_tokens": 3}
    used_up = plan_attempt(an_attempt(COMPLETIONS, body), Carryover(text=" the of and", tokens=3), resume=True)
    off = plan_attempt(an_attempt(COMPLETIONS, body), Carryover(text=" the", tokens=1), resume=False)
    for plan in (used_up, off):
        assert plan.streamed and not plan.resumed
        assert json.loads(plan.body)["prompt"] == "hi" and json.loads(plan.body)["max_tokens"] == 3


def test_a_stream_interval_is_asked_of_resumable_streams_only_and_a_callers_own_is_kept():
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}

    def sent(url: str, body: dict, interval: int) -> dict:
        plan = plan_attempt(an_attempt(url, body), Carryover(), resume=True, stream_interval=interval)
        return json.loads(plan.body)

    assert sent(CHAT, chat, 16)["stream_interval"] == 16
    assert sent(COMPLETIONS, {"prompt": "hi", "max_tokens": 5}, 8)["stream_interval"] == 8
    assert "stream_interval" not in sent(CHAT, chat, 1), "1 is every token: the field is not sent"
    assert sent(CHAT, {**chat, "stream_interval": 4}, 16)["stream_interval"] == 4
    not_resumable = {**chat, "n": 2}
    assert "stream_interval" not in sent(CHAT, not_resumable, 16), "a request sent as it is gets nothing added"


def test_the_workers_default_stream_options_are_the_ones_the_makespan_bench_feeds_vllm():
    # `bench.makespan --workers-streaming` feeds vLLM priority what the workers ask of a batch stream by default; a
    # benchmark uses public interfaces only, so it keeps its own copy, which must follow the workers'.
    from bench.makespan import WORKERS_STREAM_INTERVAL, WORKERS_STREAM_OPTIONS

    body = json.loads(plan_attempt(an_attempt(COMPLETIONS, {"prompt": "hi", "max_tokens": 5}), Carryover(),
                                   resume=True).body)
    assert body["stream_options"] == WORKERS_STREAM_OPTIONS
    assert body["stream_interval"] == STREAM_INTERVAL == WORKERS_STREAM_INTERVAL == 8


def events(*payloads: dict | str) -> StreamAssembly:
    a = StreamAssembly()
    for p in payloads:
        a.feed(p.encode() if isinstance(p, str) else json.dumps(p).encode())
    return a


HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}


def test_the_assembled_body_has_the_non_streamed_shape_and_summed_usage():
    a = events({**HEAD, "choices": [{"index": 0, "text": " of", "logprobs": None, "finish_reason": None}]},
               {**HEAD, "choices": [{"index": 0, "text": " and", "logprobs": None, "finish_reason": "length",
                                     "stop_reason": None}]},
               {**HEAD, "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8,
                                                  "prompt_tokens_details": {"cached_tokens": 4}}},
               "[DONE]")
    assert a.complete and a.completion_tokens == 2
    body = a.body(" the", TokenSums(prompt_tokens=5, completion_tokens=1, cached_tokens=0))
    assert body == {**HEAD, "choices": [{"index": 0, "text": " the of and", "logprobs": None,
                                         "finish_reason": "length", "stop_reason": None}],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
                              "prompt_tokens_details": {"cached_tokens": 4}}}
    assert summed_usage({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, TokenSums()) == {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "one attempt: its usage unchanged"


def test_a_cut_stream_is_an_eviction_or_a_transport_error_and_keeps_what_it_carried():
    chunk = {**HEAD, "choices": [{"index": 0, "text": " the", "finish_reason": None}]}
    evicted = events(chunk, {"error": {"message": "evicted", "type": "rate_limit_error", "code": "evicted"}})
    reply = cut_reply({"x-sim-replica": "0", "Content-Type": "text/event-stream"}, evicted)
    outcome = classify(reply.status, reply.headers)
    assert outcome.kind is AttemptOutcome.evicted and reply.replica == "0"
    assert evicted.text == " the" and not evicted.complete and evicted.completion_tokens == 1

    broken = events(chunk)  # no [DONE], no error event: the connection just ended
    reply = cut_reply({}, broken)
    assert classify(reply.status, reply.headers).kind is AttemptOutcome.transport_error
    assert "after 1 chunks" in reply.error
    plan = SendPlan(streamed=True, resumed=False, body=b"{}")
    assert streamed_reply(plan, StreamedReply(reply, broken, cut=True)) is reply, "a cut stream is never a success"
