"""A batch's plan for the prefix cache: rows sharing a prompt prefix are queued together, deepest sharing first;
a batch that shares nothing keeps file order; fair share between tenants is the fair plan's, untouched."""

from __future__ import annotations

import random

from batch_processor.prefix_plan import BLOCK_CHARS, MAX_BLOCKS, plan_order, prefix_key
from holdback.sim_tokenizer import prompt_text
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401

CHAT = "/v1/chat/completions"


def _document(d: int, words: int = 300) -> str:
    rng = random.Random(d)
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(words))


def _question(d: int, q: int) -> dict:
    return {"custom_id": f"d{d}-q{q}", "method": "POST", "url": CHAT,
            "body": {"model": "m1", "max_tokens": 8, "messages": [
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"{_document(d)}\n\nQuestion {q}: what does it say about item {q}?"}]}}


def _groups_in_order(custom_ids: list[str]) -> list[str]:
    """The documents in the order their questions appear, one entry per contiguous run."""
    runs: list[str] = []
    for cid in custom_ids:
        doc = cid.split("-")[0]
        if not runs or runs[-1] != doc:
            runs.append(doc)
    return runs


def _run(harness: Harness, processor, batch_id: str, rounds: int, seen: list[str]) -> None:
    """Rounds of the processor, the rows it queued answered after each; `seen` gets the queue's new job ids in
    queue order (the order the workers take them)."""
    for _ in range(rounds):
        processor.tick()
        new = [i for i in harness.queued_job_ids() if i not in seen]
        seen.extend(new)
        for row_id in new:
            harness.succeed(row_id)


def test_rows_sharing_a_document_are_grouped_in_file_order_within_each_group():
    texts = {f"r{i}": f"{_document(i % 3)} question {i}" for i in range(9)}
    order = plan_order((rid, prefix_key(text)) for rid, text in texts.items())
    assert order == ["r0", "r3", "r6", "r1", "r4", "r7", "r2", "r5", "r8"]


def test_the_deepest_shared_prefix_runs_first_and_rows_sharing_nothing_keep_file_order_last():
    system = "S" * (3 * BLOCK_CHARS)  # every row shares 3 blocks
    rows = [("a", "lone " + "x" * 400), ("b", system + "q1"), ("c", system + "D" * 600 + "q1"),
            ("d", "other " + "y" * 400), ("e", system + "q2"), ("f", system + "D" * 600 + "q2")]
    order = plan_order((rid, prefix_key(text)) for rid, text in rows)
    # c and f share the system prompt and the document (7 blocks); b and e the system prompt alone (3).
    assert order == ["c", "f", "b", "e", "a", "d"]


def test_nothing_shared_or_already_grouped_keeps_file_order():
    assert plan_order((f"r{i}", prefix_key(f"prompt number {i} " * 20)) for i in range(50)) is None
    assert plan_order([("a", prefix_key("same")), ("b", prefix_key("same")), ("c", None)]) is None
    assert plan_order([("a", None), ("b", None)]) is None


def test_a_partial_last_block_is_shared_only_when_equal():
    assert len(prefix_key("x" * (BLOCK_CHARS + 5))) == 2 * 8
    assert prefix_key("ab")[:8] != prefix_key("abc")[:8]
    assert len(prefix_key("z" * BLOCK_CHARS * (MAX_BLOCKS + 10))) == MAX_BLOCKS * 8  # only the leading blocks


def test_prompt_text_is_the_rendered_prompt_of_each_endpoint():
    chat_text = prompt_text(CHAT, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert chat_text.index("S") < chat_text.index("U")
    assert prompt_text("/v1/completions", {"prompt": "P"}) == "P"
    assert prompt_text("/v1/completions", {"prompt": ["P"]}) == "P"
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) is None
    assert "I" in prompt_text("/v1/responses", {"instructions": "I", "input": "x"})
    assert prompt_text("/v1/embeddings", {"input": "x"}) is None
    assert prompt_text(CHAT, {"messages": "not a list"}) is None


def test_a_shuffled_documents_by_questions_file_is_queued_grouped_by_document(harness: Harness):
    lines = [_question(d, q) for d in range(6) for q in range(5)]
    random.Random(7).shuffle(lines)
    batch_id = harness.submit(jsonl(lines))
    seen: list[str] = []
    _run(harness, harness.processor(window=12), batch_id, 5, seen)  # the first round expands the batch
    custom = {r.id: r.custom_id for r in harness.rows(batch_id)}
    assert all(r.status == "succeeded" for r in harness.rows(batch_id))
    queued_order = [custom[row_id] for row_id in seen]
    assert sorted(queued_order) == sorted(line["custom_id"] for line in lines)  # each row once
    assert len(_groups_in_order(queued_order)) == 6  # each document's questions in one run


def test_a_new_processor_taking_the_batch_over_continues_grouped(harness: Harness):
    lines = [_question(d, q) for d in range(4) for q in range(4)]
    random.Random(3).shuffle(lines)
    batch_id = harness.submit(jsonl(lines))
    seen: list[str] = []
    first = harness.processor(window=6)
    _run(harness, first, batch_id, 1, seen)
    first.close()  # as on SIGTERM: the lease is released, the plan goes with the process
    _run(harness, harness.processor(window=6), batch_id, 4, seen)
    custom = {r.id: r.custom_id for r in harness.rows(batch_id)}
    assert all(r.status == "succeeded" for r in harness.rows(batch_id))
    # The second processor plans the rows still pending afresh: the document the first one's window (6 rows)
    # began may be finished later, after the others, but no other is split.
    assert len(_groups_in_order([custom[i] for i in seen])) <= 5


def test_planning_keeps_the_tenants_interleaved_as_the_fair_plan_says(harness: Harness):
    lines = [_question(d, q) for d in range(3) for q in range(6)]
    random.Random(1).shuffle(lines)
    a = harness.submit(jsonl(lines), tenant="a")
    b = harness.submit(jsonl([chat(i) for i in range(18)]), tenant="b")
    harness.processor(window=32).tick()
    rows = {r.id: r for r in harness.rows(a) + harness.rows(b)}
    queue = harness.queued_job_ids()
    pushed = "".join("a" if rows[i].batch_id == a else "b" for i in queue)
    # Both windows filled in chunks of 16 taking turns (each idle tenant's first chunk at the front), as
    # without a plan; within tenant a's rows, each document's questions are one run.
    assert pushed in ("a" * 16 + "b" * 16 + "aabb", "b" * 16 + "a" * 16 + "bbaa",
                      "a" * 16 + "b" * 16 + "bbaa", "b" * 16 + "a" * 16 + "aabb")
    assert len(_groups_in_order([rows[i].custom_id for i in queue if rows[i].batch_id == a])) == 3


def test_with_the_plan_off_rows_are_queued_in_line_order(harness: Harness):
    lines = [_question(d, q) for d in range(3) for q in range(4)]
    random.Random(5).shuffle(lines)
    batch_id = harness.submit(jsonl(lines))
    harness.processor(window=12, prefix_plan=False).tick()
    assert harness.queued_job_ids() == [r.id for r in harness.rows(batch_id)]


def test_the_plan_is_switched_by_a_flag_or_its_variable(monkeypatch):
    from batch_processor.cli import _parser

    assert _parser().parse_args([]).prefix_plan == "on"
    assert _parser().parse_args(["--prefix-plan", "off"]).prefix_plan == "off"
    monkeypatch.setenv("HOLDBACK_PROCESSOR_PREFIX_PLAN", "off")
    assert _parser().parse_args([]).prefix_plan == "off"
