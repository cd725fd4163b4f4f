"""Replies as real vLLM writes them, read by the worker: the bytes vLLM 0.32.0 sent (tests/fixtures/vllm/), and
streams derived from them where vLLM needs a server we cannot start here (an abort, token ids, reasoning).

A failed stream (an error event with an integer `code`, then [DONE]) is a budgeted server error that keeps its
output; `finish_reason: "abort"` is an eviction that resumes; completions resume from token ids; what a cut
keeps is its text in `partial_output` (whatever that text says) and the rest in `partial_state`; the assembled
body has no chunk-head nulls and has the fingerprint and the reasoning; tokens are counted from usage, then
ids; both spellings of the objective and fairness headers go out; a stream that breaks after output retries off
the budget. Plain functions, a SQLite file and an in-process socket server: no process is started, except by the
two tests on the suite's backend (its JSON column, and migration 0008 over rows written before it).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from alembic import command
from sqlalchemy import inspect, select, text

from holdback.attempts.resume import (Carryover, Partial, SendPlan, attempt_tokens, plan_attempt, resumable,
                                      streamed_reply)
from holdback.attempts.send import event_lines, send_streamed
from holdback.attempts.stream import StreamAssembly, StreamedReply, cut_reply
from holdback.contract import is_eviction, is_no_endpoints
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.attempts.headers import request_headers
from holdback.attempts.outcomes import Reply, classify
from holdback.attempts.retry import RetryPolicy
from holdback.attempts.transactions import Disposition, OpenAttempt, open_attempt, record_attempt
from holdback.models import Attempt, AttemptOutcome, Batch, RequestRow, Tenant
from holdback.schema import alembic_config, upgrade

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENGINE_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def payloads(name: str) -> list[bytes]:
    """The `data:` payloads of a captured stream, byte for byte."""
    return [line[5:].strip() for line in (FIXTURES / name).read_bytes().splitlines() if line.startswith(b"data:")]


def events(name: str) -> list[dict | str]:
    """A captured stream parsed, to derive a stream vLLM would send in a case we cannot capture here."""
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads(name)]


def choices_of(event: dict | str) -> list[dict]:
    return (event.get("choices") or []) if isinstance(event, dict) else []


def fold(items: list[bytes | dict | str]) -> StreamAssembly:
    a = StreamAssembly()
    for item in items:
        if isinstance(item, dict):
            item = json.dumps(item)
        a.feed(item if isinstance(item, bytes) else item.encode())
    return a


def an_attempt(url: str, body: dict, number: int = 2) -> OpenAttempt:
    return OpenAttempt(request_id="r1", batch_id="b1", tenant_id="t1", custom_id="c1", url=url, body=json.dumps(body),
                       deadline=None, attempt_id=1, number=number, transient_failures=0)


# --- 1. a stream vLLM failed -------------------------------------------------------------------------------


def test_drop_reason_families_take_any_value_and_an_int_code_is_never_an_eviction():
    assert is_eviction("evicted") and is_eviction(" Evicted-kv-pressure ") and is_no_endpoints("rejected-no-endpoints")
    for value in (500, 429, 0, None, "", ["evicted"], {"code": "evicted"}, 1.5, True):
        assert not is_eviction(value) and not is_no_endpoints(value)


def test_a_stream_vllm_failed_is_the_requests_own_server_error_and_keeps_its_output():
    a = fold(payloads("chat_stream_engine_error.sse"))
    assert a.done and a.error["code"] == 500 and not a.complete, "the error event, then [DONE]: not complete"
    reply = cut_reply({"x-holdback-replica": "r0", "Content-Type": "text/event-stream"}, a)
    outcome = classify(reply.status, reply.headers)
    assert (outcome.kind, outcome.status, outcome.transient, outcome.path_failure) == (
        AttemptOutcome.server_error, 500, True, False)
    assert ENGINE_MESSAGE in reply.error and reply.replica == "r0"
    assert json.loads(reply.body)["error"]["message"] == ENGINE_MESSAGE
    plan = SendPlan(streamed=True, resumed=False, body=b"{}")
    sent = StreamedReply(reply, a, cut=True)
    assert streamed_reply(plan, sent) is reply, "never a success"
    figures = attempt_tokens(plan, sent)
    assert (figures.partial, figures.partial_state, figures.output, figures.prompt) == (" 514vict", None, 147, 9)


@pytest.mark.parametrize("code, status", [(503, 500), (502, 500), (400, 500), (None, 500), ("boom", 500),
                                          (504, 504)])
def test_a_failed_streams_status_is_vllms_own_server_error_else_500(code, status):
    # The stream had begun: whatever the code, the way to the replica worked and the request was taken.
    a = fold([*payloads("chat_stream_engine_error.sse")[:2], {"error": {"message": "x", "code": code}}])
    reply = cut_reply({}, a)
    assert reply.status == status and classify(reply.status, reply.headers).transient


def test_the_gateways_eviction_notice_is_still_an_eviction():
    head = payloads("chat_stream.sse")[:2]
    a = fold([*head, {"error": {"message": "evicted", "type": "rate_limit_error", "param": None, "code": "evicted"}}])
    reply = cut_reply({}, a)
    outcome = classify(reply.status, reply.headers)
    assert outcome.evicted and not outcome.transient and outcome.drop_reason == "evicted"


# --- the database: what an attempt records and what the next one continues ------------------------------------


@pytest.fixture
def db(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'holdback.db'}")
    upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def new_row(db, url: str, body: dict) -> str:
    with transaction(db) as s:
        t = Tenant(name=f"t{time.time_ns()}")
        s.add(t)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint=url, input_file_id="file-x", completion_window="24h",
                  window_seconds=86400, status="in_progress", total=1, expires_at=int(time.time() + 3600))
        s.add(b)
        s.flush()
        row = RequestRow(batch_id=b.id, tenant_id=t.id, line=1, custom_id="c0", url=url, body=json.dumps(body),
                         status="queued")
        s.add(row)
        s.flush()
        return row.id


def one_attempt(db, row_id: str, sent: StreamedReply, policy=RetryPolicy(base=0.1, cap=1.0)):
    """Open an attempt, plan it, take `sent` as what came back, record it: (plan, recorded)."""
    with transaction(db) as s:
        opened = open_attempt(s, row_id, "w-test")
    plan = plan_attempt(opened, opened.carryover, resume=True)
    with transaction(db) as s:
        recorded = record_attempt(s, opened, streamed_reply(plan, sent), policy, attempt_tokens(plan, sent))
    return plan, recorded


def cut(a: StreamAssembly) -> StreamedReply:
    return StreamedReply(cut_reply({}, a), a, cut=True)


def done(a: StreamAssembly) -> StreamedReply:
    assert a.complete
    return StreamedReply(Reply(200, {}), a, cut=False)


def test_a_failed_stream_is_recorded_budgeted_and_the_retry_resumes_from_its_output(db):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    row_id = new_row(db, CHAT, body)
    _, rec = one_attempt(db, row_id, cut(fold(payloads("chat_stream_engine_error.sse"))))
    assert rec.disposition is Disposition.retry and rec.outcome.kind is AttemptOutcome.server_error
    with db() as s:
        row, attempt = s.get(RequestRow, row_id), s.query(Attempt).filter_by(request_id=row_id).one()
        assert (row.status, row.transient_failures, row.evictions) == ("retry_wait", 1, 0)
        assert (attempt.outcome, attempt.status_code, attempt.output_tokens) == ("server_error", 500, 147)
        assert ENGINE_MESSAGE in attempt.error and attempt.partial_output == " 514vict"
    plan, _ = one_attempt(db, row_id, done(fold(payloads("chat_stream.sse"))))
    sent = json.loads(plan.body)
    assert plan.resumed and sent["messages"][-1] == {"role": "assistant", "content": " 514vict"}
    assert sent["max_tokens"] == 200 - 147 and sent["continue_final_message"] is True


# --- 2. a stream vLLM aborted ------------------------------------------------------------------------------


def aborted_chat() -> list[dict | str]:
    """chat_stream.sse as vLLM ends a request aborted at the server: the last choice's finish_reason `abort`."""
    out = events("chat_stream.sse")
    for event in out:
        for choice in choices_of(event):
            if choice.get("finish_reason") == "length":
                choice["finish_reason"] = "abort"
    return out


def test_a_stream_vllm_aborted_is_an_eviction_never_a_success():
    a = fold(aborted_chat())
    assert a.done and a.aborted and not a.complete
    reply = cut_reply({"x-holdback-replica": "r1"}, a)
    outcome = classify(reply.status, reply.headers)
    assert outcome.evicted and not outcome.transient and reply.replica == "r1" and "abort" in reply.error
    assert streamed_reply(SendPlan(True, False, b"{}"), StreamedReply(reply, a, cut=True)) is reply


def test_an_aborted_stream_spends_no_budget_and_the_retry_resumes(db):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    row_id = new_row(db, CHAT, body)
    policy = RetryPolicy(base=0.1, cap=1.0, transient_budget=1)  # one transient failure would fail the row
    _, rec = one_attempt(db, row_id, cut(fold(aborted_chat())), policy)
    assert rec.disposition is Disposition.retry and rec.outcome.evicted
    with db() as s:
        row = s.get(RequestRow, row_id)
        assert (row.status, row.evictions, row.transient_failures) == ("retry_wait", 1, 0)
    plan, rec = one_attempt(db, row_id, done(fold(payloads("chat_stream.sse"))), policy)
    assert plan.resumed and json.loads(plan.body)["max_tokens"] == 10 - 4
    assert rec.final_status.value == "succeeded"
    with db() as s:
        answer = json.loads(s.get(RequestRow, row_id).response_body)
    assert answer["choices"][0]["message"]["content"] == "ps{ 670wh" * 2


# --- 3. completions resume by token ids ----------------------------------------------------------------------

PROMPT_IDS = [1, 450, 4996]


def completion_with_ids(texts_and_ids: list[tuple[str, list[int]]], finish: str | None = None) -> list[dict]:
    """completion_stream.sse's chunks as vLLM sends them with `return_token_ids`: the prompt's ids in the first
    choice chunk, each chunk's generated ids in `token_ids`."""
    template = events("completion_stream.sse")[0]
    out = []
    for i, (text, ids) in enumerate(texts_and_ids):
        chunk = json.loads(json.dumps(template))
        choice = chunk["choices"][0]
        choice.update(text=text, token_ids=ids, prompt_token_ids=PROMPT_IDS if i == 0 else None)
        if finish is not None and i == len(texts_and_ids) - 1:
            choice["finish_reason"] = finish
        out.append(chunk)
    return out


def test_completions_ask_for_token_ids_and_the_real_nulls_mean_none_came():
    plan = plan_attempt(an_attempt(COMPLETIONS, {"prompt": "hi", "max_tokens": 5}, number=1), Carryover(), True)
    assert json.loads(plan.body)["return_token_ids"] is True
    chat = plan_attempt(an_attempt(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, number=1), Carryover(),
                        True)
    assert json.loads(chat.body)["return_token_ids"] is True, "a cut chat resumes from its ids too"
    a = fold(payloads("completion_stream.sse"))  # vLLM's own `token_ids: null`: not asked for
    assert a.token_ids is None and a.prompt_token_ids is None


def test_a_cut_completion_resumes_from_the_prompt_and_output_ids_and_keeps_vllms_text():
    # Bytes that are not valid UTF-8 stream as U+FFFD: tokenizing the text again would not give these ids back.
    first = completion_with_ids([(" st", [301]), ("\ufffd", [231, 232]), (" 810", [302])])
    a = fold(first)
    assert a.token_ids == [301, 231, 232, 302] and a.prompt_token_ids == PROMPT_IDS and a.completion_tokens == 4
    figures = attempt_tokens(SendPlan(True, False, b"{}"), StreamedReply(Reply.transport_error("reset"), a, cut=True))
    kept = Partial.read(figures.partial, figures.partial_state)
    assert kept.text == " st\ufffd 810" and kept.context_ids == (*PROMPT_IDS, 301, 231, 232, 302)

    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 10, "truncate_prompt_tokens": 100}
    progress = Carryover(kept.text, 4, 7, context_ids=kept.context_ids)
    plan = plan_attempt(an_attempt(COMPLETIONS, body), progress, resume=True)
    sent = json.loads(plan.body)
    assert plan.resumed and sent["prompt"] == [*PROMPT_IDS, 301, 231, 232, 302] and sent["max_tokens"] == 6
    assert "truncate_prompt_tokens" not in sent, "the ids are the prompt as already truncated"

    rest = fold([*completion_with_ids([(" and", [303])], finish="length"), *events("completion_stream.sse")[3:]])
    answer = json.loads(streamed_reply(plan, done(rest)).body)
    assert answer["choices"][0]["text"] == " st\ufffd 810 and", "the text vLLM sent, pieces concatenated"


def test_ids_whose_character_vllm_had_not_streamed_yet_are_generated_again():
    # A token whose bytes are not yet a whole character streams as an empty delta; resumed from its id, the
    # character would break at the seam, so it is left out and its token counted as not kept.
    a = fold(completion_with_ids([(" st", [301]), ("", [228]), ("", [189])]))
    assert a.untold_tokens == 2
    figures = attempt_tokens(SendPlan(True, False, b"{}"), StreamedReply(Reply.transport_error("reset"), a, cut=True))
    kept = Partial.read(figures.partial, figures.partial_state)
    assert (kept.text, kept.context_ids, kept.untold) == (" st", (*PROMPT_IDS, 301), 2)


def test_the_ids_survive_the_database_and_drop_untold_tokens_from_the_count(db):
    row_id = new_row(db, COMPLETIONS, {"model": "tiny", "prompt": "Once upon", "max_tokens": 10})
    stream = completion_with_ids([(" st", [301]), (" 810", [302]), ("", [228])])
    _, rec = one_attempt(db, row_id, cut(fold(stream)))
    assert rec.disposition is Disposition.retry and not rec.outcome.transient, "a bare cut after output"
    with db() as s:
        attempt = s.query(Attempt).filter_by(request_id=row_id).one()
        assert attempt.partial_output == " st 810", "the text column holds only the text"
        assert attempt.partial_state == {"context_ids": [*PROMPT_IDS, 301, 302], "untold": 1}
    with transaction(db) as s:
        progress = open_attempt(s, row_id, "w-test").carryover
    assert progress.context_ids == (*PROMPT_IDS, 301, 302) and progress.text == " st 810"
    assert progress.tokens == 2, "three tokens came, the last one's text had not"


# --- 3b. chats resume by token ids (through /v1/completions), else by text -------------------------------------


def chat_with_ids(texts_and_ids: list[tuple[str, list[int]]]) -> list[dict]:
    """chat_stream.sse's chunks as vLLM 0.32 sends them with `return_token_ids`: the prompt's ids at the top level
    of the first chunk, each chunk's generated ids in its choice's `token_ids`."""
    head, template = events("chat_stream.sse")[:2]
    head = {**head, "prompt_token_ids": PROMPT_IDS}
    out = [head]
    for piece, ids in texts_and_ids:
        chunk = json.loads(json.dumps(template))
        chunk["choices"][0].update(delta={"content": piece}, token_ids=ids)
        out.append(chunk)
    return out


def test_a_cut_chat_resumes_from_its_ids_as_a_completion_and_answers_as_the_chat():
    # A template that trims content (Llama 3's `| trim`) would drop the kept text's trailing "\n\n" from a prompt
    # continued by text: from the ids, the model has exactly what it had when the stream was cut.
    a = fold(chat_with_ids([("Once", [301]), (" upon.\n\n", [302, 303])]))
    figures = attempt_tokens(SendPlan(True, False, b"{}"), StreamedReply(Reply.transport_error("reset"), a, cut=True))
    kept = Partial.read(figures.partial, figures.partial_state)
    assert (kept.text, kept.context_ids) == ("Once upon.\n\n", (*PROMPT_IDS, 301, 302, 303))

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10,
            "max_tokens": 50, "temperature": 0, "chat_template": "{{ messages }}", "min_tokens": 5}
    plan = plan_attempt(an_attempt(CHAT, body), Carryover(kept.text, 3, 6, context_ids=kept.context_ids), True)
    sent = json.loads(plan.body)
    assert plan.resumed and plan.path == COMPLETIONS
    assert sent["prompt"] == [*PROMPT_IDS, 301, 302, 303] and sent["max_tokens"] == 10 - 3, "max_completion_tokens wins"
    assert (sent["min_tokens"], sent["temperature"], sent["return_token_ids"]) == (2, 0, True)
    assert not {"messages", "chat_template", "max_completion_tokens", "continue_final_message"} & sent.keys()

    rest = fold([*completion_with_ids([("The", [304]), (" end", [305])], finish="length"),
                 *events("completion_stream.sse")[3:]])
    answer = json.loads(streamed_reply(plan, done(rest)).body)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Once upon.\n\nThe end"}
    assert answer["choices"][0]["finish_reason"] == "length" and "text" not in answer["choices"][0]


@pytest.mark.parametrize("change, text", [
    ({"max_completion_tokens": None}, "Once upon"),  # no limit: a completion's default (16) is not a chat's
    ({"stop": ["."]}, "Once upon"),  # the stop string's last characters may be held back
    ({}, "Once \ufffd upon"),  # bytes that are not UTF-8: vLLM's detokenizer may not go on as it went
])
def test_a_chat_resumes_by_text_where_its_ids_would_not_continue_it_exactly(change, text):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10, **change}
    plan = plan_attempt(an_attempt(CHAT, body), Carryover(text, 2, 5, context_ids=(*PROMPT_IDS, 301, 302)), True)
    assert plan.resumed and plan.path is None
    assert json.loads(plan.body)["messages"][-1] == {"role": "assistant", "content": text}


def test_a_chat_resumed_by_text_gives_up_its_trailing_whitespace_for_the_model_to_write_again():
    # Llama 3's template trims the continued message: the prompt ends at "upon." and the model writes "\n\n"
    # again, which the kept "\n\n" before it would double. Without it the answer has it once on every template.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    plan = plan_attempt(an_attempt(CHAT, body), Carryover("Once upon.\n\n", 4), resume=True)
    sent = json.loads(plan.body)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Once upon."}
    assert sent["max_tokens"] == 10 - 3, "the whitespace's token is written again"
    rest = fold(payloads("chat_stream.sse"))
    answer = json.loads(streamed_reply(plan, done(rest)).body)
    assert answer["choices"][0]["message"]["content"] == "Once upon.ps{ 670wh"
    only_whitespace = plan_attempt(an_attempt(CHAT, body), Carryover(" \n", 2), resume=True)
    assert not only_whitespace.resumed, "nothing but whitespace kept: it starts again"


# An answer may say anything, the opening of the combined value rows held before migration 0008 included.
OLD_OPENING = '{"holdback_partial":1,'
LOOKALIKE = OLD_OPENING + '"text":"not this","context_ids":[7]}'


def chat_saying(opening: str) -> list[dict | str]:
    """aborted_chat() whose answer opens with `opening`."""
    out = aborted_chat()
    first = next(c for e in out[1:] for c in choices_of(e) if c["delta"].get("content"))
    first["delta"]["content"] = opening + first["delta"]["content"]
    return out


def test_an_answer_that_opens_like_the_old_combined_value_is_kept_and_resumed_as_text(db):
    assert Partial.read(LOOKALIKE, None) == Partial(LOOKALIKE)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    row_id = new_row(db, CHAT, body)
    one_attempt(db, row_id, cut(fold(chat_saying(LOOKALIKE))))
    with db() as s:
        attempt = s.query(Attempt).filter_by(request_id=row_id).one()
        assert (attempt.partial_output, attempt.partial_state) == (LOOKALIKE + "ps{ 670wh", None)
    plan, _ = one_attempt(db, row_id, done(fold(payloads("chat_stream.sse"))))
    assert plan.resumed and json.loads(plan.body)["messages"][-1]["content"] == LOOKALIKE + "ps{ 670wh"


@pytest.fixture
def suite_db(backend):
    """The suite's backend: PostgreSQL under HOLDBACK_TEST_BACKEND=services (its JSON type), else SQLite."""
    engine = make_engine(backend.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def test_text_and_state_round_trip_on_the_suites_backend(suite_db):
    db = suite_db
    with_ids = new_row(db, COMPLETIONS, {"model": "tiny", "prompt": "Once upon", "max_tokens": 10})
    one_attempt(db, with_ids, cut(fold(completion_with_ids([(OLD_OPENING + "\u00e9", [301]), ("", [228])]))))
    text_only = new_row(db, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    one_attempt(db, text_only, cut(fold(chat_saying(LOOKALIKE))))
    with db() as s:
        kept = dict(s.execute(select(Attempt.request_id, Attempt.partial_state)).all())
        no_state = s.scalars(select(Attempt.request_id).where(Attempt.partial_state.is_(None))).all()
    assert kept[with_ids] == {"context_ids": [*PROMPT_IDS, 301], "untold": 1}
    assert no_state == [text_only], "nothing beyond text is SQL NULL, not JSON null"
    with transaction(db) as s:
        progress = open_attempt(s, with_ids, "w-test").carryover
    assert (progress.text, progress.context_ids, progress.tokens) == (OLD_OPENING + "\u00e9", (*PROMPT_IDS, 301), 1)
    with transaction(db) as s:
        progress = open_attempt(s, text_only, "w-test").carryover
    assert (progress.text, progress.context_ids) == (LOOKALIKE + "ps{ 670wh", None)


def _migrate(engine, fn, revision: str) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        fn(cfg, revision)


def test_migration_0008_splits_the_rows_written_before_it_and_its_downgrade_joins_them_again(backend):
    engine = make_engine(backend.database_url)
    db = make_sessionmaker(engine)
    ids = {"holdback_partial": 1, "text": " st 810", "context_ids": [*PROMPT_IDS, 301, 302], "untold": 1}
    thought = {"holdback_partial": 1, "text": "", "reasoning": "ps{", "reasoning_fields": ["reasoning"]}
    old = {  # partial_output as the code before 0008 wrote it
        "ids": json.dumps(ids, separators=(",", ":")),
        "reasoning": json.dumps(thought, separators=(",", ":")),
        "text": "plain",
        "cut lookalike": OLD_OPENING + '"text":"half',  # not JSON: that code read it as text too
        "lookalike without text": OLD_OPENING + '"context_ids":[1]}',
        "none": None,
    }
    try:
        # Written through the models before going down: they map today's columns (batches.cancelled, 0009).
        rows = {name: new_row(db, COMPLETIONS, {"model": "tiny", "prompt": "Once upon", "max_tokens": 10})
                for name in old}
        _migrate(engine, command.downgrade, "0007")
        with transaction(db) as s:
            for name, row_id in rows.items():
                s.execute(text("INSERT INTO attempts (request_id, batch_id, number, started_at, evicted, input_tokens,"
                               " output_tokens, partial_output) SELECT id, batch_id, 1, 0, false, 3, 2, :partial"
                               " FROM request_rows WHERE id = :r"), {"r": row_id, "partial": old[name]})
                s.execute(text("UPDATE request_rows SET attempts = 1, status = 'retry_wait' WHERE id = :r"),
                          {"r": row_id})
        _migrate(engine, command.upgrade, "head")
        with db() as s:
            stored = {row_id: (partial, state) for row_id, partial, state in
                      s.execute(select(Attempt.request_id, Attempt.partial_output, Attempt.partial_state))}
        assert {name: stored[row_id] for name, row_id in rows.items()} == {
            "ids": (" st 810", {"context_ids": [*PROMPT_IDS, 301, 302], "untold": 1}),
            "reasoning": ("", {"reasoning": "ps{", "reasoning_fields": ["reasoning"]}),
            "text": ("plain", None), "cut lookalike": (old["cut lookalike"], None),
            "lookalike without text": (old["lookalike without text"], None), "none": (None, None)}
        with transaction(db) as s:
            progress = open_attempt(s, rows["ids"], "w-test").carryover
        assert (progress.text, progress.context_ids, progress.tokens) == (" st 810", (*PROMPT_IDS, 301, 302), 1)

        _migrate(engine, command.downgrade, "0007")
        with engine.connect() as conn:
            assert "partial_state" not in {c["name"] for c in inspect(conn).get_columns("attempts")}
            back = dict(conn.execute(text("SELECT request_id, partial_output FROM attempts WHERE number = 1")).all())
        assert {name: back[row_id] for name, row_id in rows.items()} == old
    finally:
        _migrate(engine, command.upgrade, "head")
        engine.dispose()


def test_a_completion_with_stop_strings_resumes_by_text():
    # vLLM holds the last characters back while a stop string could still match: the ids run ahead of the text.
    progress = Carryover(" st 810", 2, 5, context_ids=(*PROMPT_IDS, 301, 302))
    plan = plan_attempt(an_attempt(COMPLETIONS, {"prompt": "Once", "max_tokens": 10, "stop": ["\n\n"]}), progress, True)
    assert plan.resumed and json.loads(plan.body)["prompt"] == "Once st 810"
    kept = plan_attempt(an_attempt(COMPLETIONS, {"prompt": "Once", "max_tokens": 10, "stop": ["\n\n"],
                                               "include_stop_str_in_output": True}), progress, True)
    assert json.loads(kept.body)["prompt"] == [*PROMPT_IDS, 301, 302]


def test_without_ids_a_completion_resumes_by_text_without_its_broken_characters():
    progress = Carryover(" st\ufffd\ufffd", 4, 7)  # no ids: the server did not send them
    plan = plan_attempt(an_attempt(COMPLETIONS, {"prompt": "Once", "max_tokens": 10}), progress, True)
    sent = json.loads(plan.body)
    assert plan.resumed and sent["prompt"] == "Once st" and sent["max_tokens"] == 8
    assert plan.carryover.text == " st", "the assembled text continues from what was resumed"


def test_a_chat_resume_gives_up_a_trailing_broken_character_and_restarts_when_nothing_is_left():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    plan = plan_attempt(an_attempt(CHAT, body), Carryover("ok \ufffd", 3, 12), True)
    sent = json.loads(plan.body)
    # The broken character goes, then the whitespace before it (see the trailing-whitespace test), a token each.
    assert plan.resumed and sent["messages"][-1]["content"] == "ok" and sent["max_tokens"] == 19
    broken_only = plan_attempt(an_attempt(CHAT, body), Carryover("\ufffd", 2, 11), True)
    assert not broken_only.resumed and json.loads(broken_only.body)["messages"] == body["messages"]


def test_a_caller_asking_for_vllms_ids_or_prompt_text_gets_vllms_own_answer():
    assert not resumable(COMPLETIONS, {"prompt": "hi", "return_token_ids": True})
    assert not resumable(CHAT, {"messages": [{"role": "user", "content": "hi"}], "return_prompt_text": True})


# --- 4. the assembled body ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat_stream.sse", "completion_stream.sse"])
def test_the_assembled_body_has_no_chunk_nulls_and_keeps_the_fingerprint(name):
    a = fold(payloads(name))
    assert a.complete
    body = a.body()
    assert "prompt_token_ids" not in body and "prompt_text" not in body
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]
    assert body["system_fingerprint"] == "vllm-0.32.0-170cd3cc", "from the usage chunk"
    assert list(body)[:4] == ["id", "object", "created", "model"]
    assert body["object"] in ("chat.completion", "text_completion") and body["choices"][0]["finish_reason"] == "length"
    text = body["choices"][0]["message"]["content"] if "chat" in name else body["choices"][0]["text"]
    assert text == ("ps{ 670wh" if "chat" in name else " st 810\u001f")
    assert body["usage"]["completion_tokens"] == (4 if "chat" in name else 3)


# --- 5. reasoning ----------------------------------------------------------------------------------------------


def reasoning_chat(spelling: str, thoughts: int = 2, finish: bool = True) -> list[dict | str]:
    """chat_stream.sse with its first content deltas as reasoning deltas (vLLM's reasoning parser streams the
    thinking so), under `spelling`; cut before the finish unless `finish`."""
    out = events("chat_stream.sse")
    n = 0
    for event in out[1:]:
        for choice in choices_of(event):
            if n < thoughts:
                choice["delta"] = {spelling: choice["delta"]["content"]}
                n += 1
    return out if finish else out[:1 + thoughts]


@pytest.mark.parametrize("spelling, fields", [("reasoning", ["reasoning"]),
                                              ("reasoning_content", ["reasoning", "reasoning_content"])])
def test_reasoning_deltas_are_folded_into_the_message(spelling, fields):
    message = fold(reasoning_chat(spelling)).body()["choices"][0]["message"]
    assert message["content"] == " 670wh"
    assert {k: message[k] for k in fields} == {k: "ps{" for k in fields}
    assert [k for k in message if k.startswith("reasoning")] == fields
    only = fold(reasoning_chat(spelling, thoughts=4)).body()["choices"][0]["message"]
    assert only["content"] is None and only["reasoning"] == "ps{ 670wh", "as vLLM answers all-reasoning output"


def test_a_chat_without_reasoning_has_no_reasoning_field():
    assert "reasoning" not in fold(payloads("chat_stream.sse")).body()["choices"][0]["message"]


def test_a_cut_while_only_reasoning_came_restarts_and_one_after_the_answer_began_keeps_the_reasoning(db):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    row_id = new_row(db, CHAT, body)
    _, rec = one_attempt(db, row_id, cut(fold(reasoning_chat("reasoning", finish=False))))
    assert rec.disposition is Disposition.retry
    with db() as s:
        attempt = s.query(Attempt).filter_by(request_id=row_id).one()
        assert (attempt.partial_output, attempt.partial_state) == ("", {"reasoning": "ps{",
                                                                       "reasoning_fields": ["reasoning"]})
    # Only reasoning so far: continuing the answer would drop it, so the request starts over.
    plan, _ = one_attempt(db, row_id, cut(fold(reasoning_chat("reasoning", thoughts=2)[:4])))
    assert not plan.resumed and json.loads(plan.body)["messages"] == body["messages"]
    # That attempt reasoned, then answered " 670" before its cut: the next one continues the answer.
    plan, rec = one_attempt(db, row_id, done(fold(payloads("chat_stream.sse")[4:])))
    assert plan.resumed and json.loads(plan.body)["messages"][-1] == {"role": "assistant", "content": " 670"}
    with db() as s:
        message = json.loads(s.get(RequestRow, row_id).response_body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": " 670wh", "reasoning": "ps{"}


# --- 6. tokens ----------------------------------------------------------------------------------------------------


def test_completion_tokens_come_from_usage_then_token_ids_then_chunks():
    failed = fold(payloads("chat_stream_engine_error.sse"))
    assert (failed.completion_tokens, failed.content_chunks) == (147, 2), "usage, not the two chunks of text"
    # No usage (cut before it came): several tokens in one event, and an empty delta that was a token too.
    several = fold(completion_with_ids([(" st", [301, 302, 303]), ("", [228]), (" 810", [189, 304])]))
    assert (several.completion_tokens, several.content_chunks) == (6, 2)
    assert fold(payloads("completion_stream.sse")[:2]).completion_tokens == 2, "the last resort: chunks"


# --- 7. llm-d -------------------------------------------------------------------------------------------------------


def test_the_objective_and_fairness_id_go_in_both_spellings():
    h = request_headers("batch_req_1", "tnt_1", None)
    assert h["x-llm-d-inference-objective"] == h["x-gateway-inference-objective"] == "batch"
    assert h["x-llm-d-inference-fairness-id"] == h["x-gateway-inference-fairness-id"] == "tnt_1"


async def serve(data: bytes, *, finish: bool):
    """A socket server answering every request with an event stream of `data` (chunked); without `finish` it
    then closes the connection mid-body, as a reset does."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        if finish:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def send_over_socket(data: bytes, *, finish: bool) -> StreamedReply:
    async def run() -> StreamedReply:
        server = await serve(data, finish=finish)
        port = server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                return await send_streamed(http, f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {}, 10)
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(run())


def test_the_exact_bytes_of_a_failed_stream_come_back_as_a_server_error():
    sent = send_over_socket((FIXTURES / "chat_stream_engine_error.sse").read_bytes(), finish=True)
    assert sent.cut and sent.reply.status == 500 and ENGINE_MESSAGE in sent.reply.error
    assert sent.assembly.text == " 514vict"


def test_a_reset_after_output_is_cut_after_output_and_before_output_is_not():
    stream = (FIXTURES / "chat_stream.sse").read_bytes()
    after = send_over_socket(stream[:stream.index(b"data: [DONE]")].rsplit(b"data:", 2)[0], finish=False)
    assert after.cut and after.reply.status is None and after.reply.cut_after_output
    assert after.assembly.text == "ps{ 670"
    head_only = send_over_socket(payloads("chat_stream.sse")[0].join([b"data: ", b"\n\n"]), finish=False)
    assert head_only.reply.status is None and not head_only.reply.cut_after_output


def test_a_stream_cut_after_its_answer_finished_is_that_answer():
    """The gateway's eviction notice, or a reset, after the finishing chunk and before the usage chunk and [DONE]:
    the answer is whole (the finishing chunk carries the usage too), so it is the attempt's success, where a cut
    would make the next attempt compute the whole output again (nothing is left to continue)."""
    stream = (FIXTURES / "chat_stream.sse").read_bytes()
    answer = stream[:stream.index(b"data: [DONE]")].rsplit(b"data:", 1)[0]  # up to the finishing chunk
    notice = b'data: {"error": {"message": "evicted", "type": "rate_limit_error", "param": null, "code": "evicted"}}\n\n'
    for sent in (send_over_socket(answer + notice, finish=True), send_over_socket(answer, finish=False)):
        assert not sent.cut and sent.reply.status == 200, sent.reply
        body = sent.assembly.body()
        assert body["choices"][0]["message"]["content"] == "ps{ 670wh"
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    before_finish = answer.rsplit(b"data:", 1)[0]  # the same cut one chunk earlier: the answer did not finish
    sent = send_over_socket(before_finish + notice, finish=True)
    assert sent.cut and sent.reply.status == 429


def test_a_stream_cut_after_output_retries_off_the_budget_and_one_without_output_spends_it(db):
    row_id = new_row(db, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    policy = RetryPolicy(base=0.1, cap=1.0, transient_budget=2)
    first_chunks = payloads("chat_stream.sse")[:3]
    reset = Reply.transport_error("ServerDisconnectedError", cut_after_output=True)
    for _ in range(6):  # three times the budget: an llm-d eviction looks like this every time
        _, rec = one_attempt(db, row_id, StreamedReply(reset, fold(first_chunks), cut=True), policy)
        assert rec.disposition is Disposition.retry and rec.outcome.kind is AttemptOutcome.transport_error
    with db() as s:
        assert (s.get(RequestRow, row_id).transient_failures, s.get(RequestRow, row_id).attempts) == (0, 6)
    before_output = StreamedReply(Reply.transport_error("reset"), fold(payloads("chat_stream.sse")[:1]), cut=True)
    outcomes = [one_attempt(db, row_id, before_output, policy)[1] for _ in range(2)]
    assert [o.disposition for o in outcomes] == [Disposition.retry, Disposition.final]


def test_an_event_larger_than_aiohttp_s_line_limit_is_read_whole():
    """vLLM puts a long prompt's token ids (`return_token_ids`) or an echoed prompt's logprobs in one event: a line
    of megabytes, where aiohttp's line reader stops at twice its read buffer (512 KiB) and raises an error the
    worker would take for its own failure, retrying the row for ever. The worker reads the line whole."""
    first, *rest = (FIXTURES / "chat_stream.sse").read_bytes().split(b"\n\n", 1)
    head = json.loads(first[len(b"data: "):])
    head["prompt_token_ids"] = list(range(200_000, 400_000))  # about 1.4 MB of JSON
    big = b"data: " + json.dumps(head, separators=(",", ":")).encode() + b"\n\n"
    assert len(big) > 2**20
    sent = send_over_socket(big + rest[0], finish=True)
    whole = send_over_socket((FIXTURES / "chat_stream.sse").read_bytes(), finish=True)
    assert not sent.cut and sent.reply.status == 200, sent.reply
    assert sent.assembly.text == whole.assembly.text and sent.assembly.complete


def test_event_lines_are_the_same_however_the_body_arrives_in_pieces():
    body = (FIXTURES / "chat_stream.sse").read_bytes().replace(b"\n\n", b"\r\n\r\n", 2) + b"data: [DONE]"

    class Pieces:
        def __init__(self, size: int):
            self.size = size

        async def iter_any(self):
            for at in range(0, len(body), self.size):
                yield body[at:at + self.size]

    async def lines(size: int) -> list[bytes]:
        return [line async for line in event_lines(Pieces(size))]  # type: ignore[arg-type]

    expected = body.splitlines(keepends=True)
    assert expected[0].endswith(b"\r\n") and expected[-1] == b"data: [DONE]"  # CRLF events, and no final line end
    for size in (1, 2, 7, 64, 1000, len(body)):
        assert asyncio.run(lines(size)) == expected, size
